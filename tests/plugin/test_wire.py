"""The datagram format between the plugin and the sidecar: every record round-trips, both versions' headers read, odd
values are cleaned rather than refused at the sender, and a bad datagram is refused naming the first problem."""

from __future__ import annotations

import math
import struct

import pytest

from stepline.plugin import wire

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
