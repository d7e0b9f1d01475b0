"""The datagram format between the plugin and the sidecar: every record round-trips, both versions' headers read, odd
values are cleaned rather than refused at the sender, and a bad datagram is refused naming the first problem. The
decoders name every field of a record's layout: a value lands under its own name, whatever its place."""

from __future__ import annotations

import dataclasses
import math
import struct

import pytest

from stepline.core.clock import ManualClock
from stepline.model.rows import Request, Step
from stepline.plugin import wire
from stepline.sources.base import SourceContext
from stepline.sources.plugin_receiver import PluginReceiver

STEP = wire.StepRecord(1_700_000_000.25, 42, 1, 12.5, 1, 2048, 7, 7, 8, 3, 1, 0.5, 2048, 1024, 0, 2, 6, 4, False,
                       (0.25,), (0.015625, 0.03125), batch_queue=True)


def _request(request_id: str = "req-1", reason: int = 1) -> bytes:
    encoded = request_id.encode()
    return wire.pack_record(wire.REQUEST_RECORD, wire.REQUEST, (
        1_700_000_001.0, 0, 2.0, 0.25, 0.5, 1.75, 1.25, 0.05, 1000, 26, 64, 512, 1, reason, len(encoded)), encoded)


def _datagram(*records: bytes, credential: bytes = b"") -> bytes:
    return wire.encode_header(b"vllm-0", 4321, 7, 99, 3, credential) + b"".join(records)


def test_a_step_a_request_and_the_configuration_round_trip() -> None:
    data = _datagram(wire.encode_step(STEP), _request(), wire.encode_config({"max_num_seqs": 64, "model": "m"}))
    decoded = wire.decode(data)
    assert decoded.header == wire.Header("vllm-0", 4321, 7, 99, 3, 1, b"")
    step, request, config = decoded.records
    assert step == STEP  # the samples are float32: these are exact in it
    assert isinstance(request, wire.RequestRecord)
    assert (request.request_id, request.finish_reason, request.prompt_tokens, request.cached_tokens) == (
        "req-1", "stop", 1000, 512)
    assert request.e2e_seconds == 2.0 and request.preemptions == 1
    assert config == wire.ConfigRecord({"max_num_seqs": 64, "model": "m"})


def test_a_step_without_iteration_details_reads_back_nan() -> None:
    bare = wire.StepRecord(1.0, 1, 0, math.nan, 0, 0, 0, 0, 0, 0, 0, 0.0, 0, 0, 0, 0, 0, 0, True)
    (step,) = wire.decode(_datagram(wire.encode_step(bare))).records
    assert isinstance(step, wire.StepRecord) and math.isnan(step.elapsed_ms) and step.is_dummy


def test_a_token_makes_a_version_2_header_carrying_its_credential_not_the_token() -> None:
    credential = wire.credential_for("s3cret")
    assert len(credential) == wire.CREDENTIAL_SIZE and credential != wire.credential_for("other")
    data = _datagram(wire.encode_step(STEP), credential=credential)
    assert b"s3cret" not in data
    header, _ = wire.decode_header(data)
    assert (header.version, header.credential) == (2, credential)
    with pytest.raises(ValueError, match="a credential is 16 bytes, got 3"):
        wire.encode_header(b"e", 1, 1, 1, 0, b"abc")


def test_odd_values_are_cleaned_not_refused() -> None:
    record = wire.pack_record(wire.STEP_RECORD, wire.STEP, (
        1.0, -5, 0, "fast", None, 2**40, 0, 0, 0, 0, 0, 0.1, 0, 0, 0, 0, 0, 0, wire.STEP_HAS_DETAILS, 0, 0))
    (step,) = wire.decode(_datagram(record)).records
    assert isinstance(step, wire.StepRecord)
    assert (step.iteration, step.num_ctx_requests, step.num_ctx_tokens) == (0, 0, wire.U32)
    assert math.isnan(step.elapsed_ms)
    assert wire.pack_samples([0.5, "x"], None)[:2] == (2, 0)


@pytest.mark.parametrize(("data", "message"), [
    (b"STPL", "shorter than a header"),
    (b"XXXX" + _datagram()[4:], "bad magic"),
    (_datagram()[:4] + bytes([9]) + _datagram()[5:], "version 9, this collector reads versions 1-2"),
    (_datagram()[:5] + bytes([0x80]) + _datagram()[6:], "unknown flags 0x80"),
    (_datagram(_request()[:-2]), "runs past the datagram"),
    (_datagram(_request(reason=len(wire.FINISH_REASONS))), "unknown finish reason code"),
    (_datagram(struct.pack("<BH", 9, 0)), "unknown record type 9"),
    (_datagram(struct.pack("<BH", wire.CONFIG_RECORD, 2) + b"[]"), "not a JSON object"),
    (b"\0" * (wire.MAX_DATAGRAM + 1), "exceeds"),
])
def test_a_bad_datagram_is_refused_naming_the_problem(data: bytes, message: str) -> None:
    with pytest.raises(wire.WireError, match=message):
        wire.decode(data)


NOW = 1_790_000_000.25
# A step and a request whose every integer field is a value of its own (and within its struct code's range), so
# that two fields swapped show.
DISTINCT_STEP = wire.StepRecord(NOW, 101, 2, 12.5, 103, 104, 105, 106, 107, 108, 109, 0.75, 111, 112, 113, 114, 115,
                                116, False, (0.5,), (0.25, 0.125))


def _request_record(code: int, request_id: bytes = b"cmpl-7") -> bytes:
    return wire.pack_record(wire.REQUEST_RECORD, wire.REQUEST, (
        NOW, 3, 9.0, 1.0, 2.0, 7.5, 6.0, 0.5, 201, 202, 203, 204, 205, code, len(request_id)), request_id)


def _prod_a_datagram(*records: bytes) -> bytes:
    return wire.encode_header(b"prod-a", 42, 1, 0, 0) + b"".join(records)


def test_the_named_fields_cover_each_layout_exactly() -> None:
    codes = {"StepFields": wire.STEP.format[1:], "RequestFields": wire.REQUEST.format[1:]}
    assert len(wire.StepFields._fields) == len(codes["StepFields"]) == 21
    assert len(wire.RequestFields._fields) == len(codes["RequestFields"]) == 15
    assert struct.calcsize("<" + codes["StepFields"]) == wire.STEP.size


def test_a_step_decodes_field_by_field_under_its_names() -> None:
    data = _prod_a_datagram(wire.encode_step(DISTINCT_STEP))
    (_, fields, ttft, itl), = wire.iter_records(data, wire.HEADER.size + len(b"prod-a"))
    assert isinstance(fields, wire.StepFields)
    assert fields.iteration == 101 and fields.num_ctx_requests == 103 and fields.waiting == 108
    assert fields.skipped_waiting == 109 and fields.spec_num_accepted_tokens == 116
    assert fields.flags == wire.STEP_HAS_DETAILS and (fields.n_ttft, fields.n_itl) == (1, 2)
    assert list(ttft) == [0.5] and list(itl) == [0.25, 0.125]
    (record,) = wire.decode(_prod_a_datagram(wire.encode_step(DISTINCT_STEP))).records
    assert record == DISTINCT_STEP  # every field of StepRecord back where it was


def test_a_request_decodes_under_its_names() -> None:
    (record,) = wire.decode(_prod_a_datagram(_request_record(wire.FINISH_CODE["length"]))).records
    assert record == wire.RequestRecord(NOW, 3, "cmpl-7", "length", 9.0, 1.0, 2.0, 7.5, 6.0, 0.5, 201, 202, 203, 204,
                                        205)


def test_the_receiver_puts_each_wire_field_in_its_own_column() -> None:
    receiver = PluginReceiver(SourceContext("node-1", ManualClock(NOW)), "/nonexistent/plugin.sock")
    rows = receiver.rows(_prod_a_datagram(wire.encode_step(DISTINCT_STEP),
                                          _request_record(wire.FINISH_CODE["stop"])))
    (step,) = [r for r in rows if isinstance(r, Step)]
    assert (step.engine_index, step.step, step.elapsed_ms, step.vllm_elapsed_ms) == (2, 101, 12.5, 12.5)
    assert (step.num_ctx_requests, step.num_ctx_tokens, step.num_generation_requests, step.num_generation_tokens,
            step.running) == (103, 104, 105, 106, 107)
    assert (step.waiting, step.skipped_waiting) == (108 + 109, 109)  # waiting holds the deferred waiters too
    assert (step.kv_cache_usage, step.prefix_cache_queries, step.prefix_cache_hits, step.preempted,
            step.spec_num_drafts, step.spec_num_draft_tokens, step.spec_num_accepted_tokens) == (
        0.75, 111, 112, 113, 114, 115, 116)
    assert list(step.ttft_seconds) == [0.5] and list(step.itl_seconds) == [0.25, 0.125] and not step.is_dummy
    (request,) = [r for r in rows if isinstance(r, Request)]
    assert (request.engine_index, request.request_id, request.finish_reason) == (3, "cmpl-7", "stop")
    assert (request.e2e_seconds, request.queue_seconds, request.prefill_seconds, request.inference_seconds,
            request.decode_seconds, request.mean_tpot_seconds) == (9.0, 1.0, 2.0, 7.5, 6.0, 0.5)
    assert request.ttft_seconds == 3.0 and request.arrival_ts == round((NOW - 9.0) * 1_000_000)
    assert (request.prompt_tokens, request.generation_tokens, request.max_tokens, request.cached_tokens,
            request.preemptions) == (201, 202, 203, 204, 205)


def test_a_step_made_bare_keeps_its_other_fields_named() -> None:
    bare = dataclasses.replace(DISTINCT_STEP, elapsed_ms=math.nan, is_dummy=True)
    (record,) = wire.decode(_prod_a_datagram(wire.encode_step(bare))).records
    assert isinstance(record, wire.StepRecord) and math.isnan(record.elapsed_ms) and record.is_dummy
    assert (record.iteration, record.waiting, record.spec_num_accepted_tokens) == (101, 108, 116)
