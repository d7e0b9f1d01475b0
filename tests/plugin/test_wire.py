"""The wire's decoders name every field of a record's layout: a value lands under its own name, whatever its place."""

from __future__ import annotations

import dataclasses
import math
import struct

from stepline.core.clock import ManualClock
from stepline.model.rows import Request, Step
from stepline.plugin import wire
from stepline.sources.base import SourceContext
from stepline.sources.plugin_receiver import PluginReceiver

NOW = 1_790_000_000.25
# Every integer field a value of its own (and within its struct code's range), so that two fields swapped show.
_STEP = wire.StepRecord(NOW, 101, 2, 12.5, 103, 104, 105, 106, 107, 108, 109, 0.75, 111, 112, 113, 114, 115, 116,
                        False, (0.5,), (0.25, 0.125))


def _request_record(code: int, request_id: bytes = b"cmpl-7") -> bytes:
    return wire.pack_record(wire.REQUEST_RECORD, wire.REQUEST, (
        NOW, 3, 9.0, 1.0, 2.0, 7.5, 6.0, 0.5, 201, 202, 203, 204, 205, code, len(request_id)), request_id)


def _datagram(*records: bytes) -> bytes:
    return wire.encode_header(b"prod-a", 42, 1, 0, 0) + b"".join(records)


def test_the_named_fields_cover_each_layout_exactly() -> None:
    codes = {"StepFields": wire.STEP.format[1:], "RequestFields": wire.REQUEST.format[1:]}
    assert len(wire.StepFields._fields) == len(codes["StepFields"]) == 21
    assert len(wire.RequestFields._fields) == len(codes["RequestFields"]) == 15
    assert struct.calcsize("<" + codes["StepFields"]) == wire.STEP.size


def test_a_step_decodes_field_by_field_under_its_names() -> None:
    (_, fields, ttft, itl), = wire.iter_records(_datagram(wire.encode_step(_STEP)), wire.HEADER.size + len(b"prod-a"))
    assert isinstance(fields, wire.StepFields)
    assert fields.iteration == 101 and fields.num_ctx_requests == 103 and fields.waiting == 108
    assert fields.skipped_waiting == 109 and fields.spec_num_accepted_tokens == 116
    assert fields.flags == wire.STEP_HAS_DETAILS and (fields.n_ttft, fields.n_itl) == (1, 2)
    assert list(ttft) == [0.5] and list(itl) == [0.25, 0.125]
    (record,) = wire.decode(_datagram(wire.encode_step(_STEP))).records
    assert record == _STEP  # every field of StepRecord back where it was


def test_a_request_decodes_under_its_names() -> None:
    (record,) = wire.decode(_datagram(_request_record(wire.FINISH_CODE["length"]))).records
    assert record == wire.RequestRecord(NOW, 3, "cmpl-7", "length", 9.0, 1.0, 2.0, 7.5, 6.0, 0.5, 201, 202, 203, 204,
                                        205)


def test_the_receiver_puts_each_wire_field_in_its_own_column() -> None:
    receiver = PluginReceiver(SourceContext("node-1", ManualClock(NOW)), "/nonexistent/plugin.sock")
    rows = receiver.rows(_datagram(wire.encode_step(_STEP), _request_record(wire.FINISH_CODE["stop"])))
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


def test_a_step_without_details_decodes_with_no_elapsed_time() -> None:
    bare = dataclasses.replace(_STEP, elapsed_ms=math.nan, is_dummy=True)
    (record,) = wire.decode(_datagram(wire.encode_step(bare))).records
    assert isinstance(record, wire.StepRecord) and math.isnan(record.elapsed_ms) and record.is_dummy
