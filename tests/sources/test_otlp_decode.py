"""The OTLP decoder on its own: bodies inflated within a limit, spans to request rows, each span's bad id, name or
time rejecting that span alone, and random bytes raising only the decoder's own errors (the receiver over HTTP:
test_otlp.py)."""

from __future__ import annotations

import contextlib
import gzip
import math
import zlib
from typing import Any

import pytest
from google.protobuf import json_format  # type: ignore[import-untyped]
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, ArrayValue, KeyValue
from opentelemetry.proto.trace.v1.trace_pb2 import Span as ProtoSpan

from stepline.sources.otlp_decode import JSON, PROTOBUF, BodyTooLarge, OtlpDecodeError, decode, inflate, to_rows
from tests.sources.test_otlp import ARRIVAL_NS, FINISH_NS, HOST, VLLM_ATTRIBUTES, good_span, request_of, span


@pytest.mark.parametrize(("attributes", "resource", "what", "characters"), [
    ({"gen_ai__request__id": {"string_value": "é" * 513}}, {}, "gen_ai.request.id", 513),
    ({"gen_ai__response__model": {"string_value": "m" * 1025}}, {}, "gen_ai.response.model", 1025),
    ({"gen_ai__request__model": {"string_value": "m" * 1025}}, {}, "gen_ai.request.model", 1025),
    ({"gen_ai__response__finish_reasons": {"array_value": ArrayValue(values=[AnyValue(string_value="s" * 2000)])}},
     {}, "gen_ai.response.finish_reasons", 2000),
    ({}, {"stepline.engine": "e" * 1025}, "the resource's engine name", 1025),
    ({}, {"service.name": "e" * 1025}, "the resource's engine name", 1025),
])
def test_an_id_or_name_over_the_bound_rejects_its_span(attributes: dict[str, Any], resource: dict[str, str],
                                                       what: str, characters: int) -> None:
    decoded = to_rows(request_of(good_span("r1", **attributes), resource={"service.name": "raw", **resource}), HOST)
    assert (decoded.rows, decoded.rejected) == ([], 1)
    assert decoded.problems[0].endswith(f"{what} is over the 1024-byte limit for ids and names ({characters} "
                                        "characters)")


def test_an_id_or_name_at_the_bound_is_kept_whole() -> None:
    reasons = ArrayValue(values=[AnyValue(string_value="s" * 1024)])
    names = {"gen_ai__response__model": {"string_value": "m" * 1024},
             "gen_ai__response__finish_reasons": {"array_value": reasons}}
    [row] = to_rows(request_of(good_span("é" * 512, **names), resource={"stepline.engine": "e" * 1024}), HOST).rows
    assert (row.request_id, row.model_name, row.finish_reason, row.engine) == ("é" * 512, "m" * 1024, "s" * 1024,
                                                                              "e" * 1024)


def test_tolerant_number_kinds() -> None:
    message = request_of(good_span(
        "t",
        gen_ai__latency__time_in_queue={"int_value": 2},
        gen_ai__latency__e2e={"string_value": " 0.75 "},
        gen_ai__usage__prompt_tokens={"double_value": 12.0},
        gen_ai__usage__completion_tokens={"string_value": "3"},
        gen_ai__request__max_tokens={"int_value": 64},
        gen_ai__response__finish_reasons={"array_value": ArrayValue(values=[AnyValue(string_value="stop")])},
    ), resource={"service.name": "s", "stepline.engine": ""})
    [row] = to_rows(message, HOST).rows
    assert (row.queue_seconds, row.e2e_seconds, row.prompt_tokens, row.generation_tokens) == (2.0, 0.75, 12, 3)
    assert (row.max_tokens, row.finish_reason, row.engine) == (64, "stop", "s")
    assert row.mean_tpot_seconds == 0.2


@pytest.mark.parametrize(("start", "end"), [(0, FINISH_NS), (FINISH_NS, ARRIVAL_NS), (ARRIVAL_NS, 0),
                                            (ARRIVAL_NS, 1 << 63), (1, FINISH_NS), (946_684_799 * 10**9, FINISH_NS)])
def test_invalid_span_times_are_rejected(start: int, end: int) -> None:
    decoded = to_rows(request_of(span(start=start, end=end, gen_ai__request__id={"string_value": "x"})), HOST)
    assert (decoded.rows, decoded.rejected) == ([], 1)



def test_inflate_encodings() -> None:
    data = b"payload" * 100
    assert inflate(data, "", 1000) == data
    assert inflate(gzip.compress(data), "gzip", 1000) == data
    assert inflate(gzip.compress(data[:300]) + gzip.compress(data[300:]), "gzip", 1000) == data  # two members
    assert inflate(zlib.compress(data), "deflate", 1000) == data
    raw = zlib.compressobj(wbits=-15)
    assert inflate(raw.compress(data) + raw.flush(), "deflate", 1000) == data
    with pytest.raises(OtlpDecodeError, match="corrupt gzip"):
        inflate(gzip.compress(data) + b"junk", "gzip", 1000)
    with pytest.raises(OtlpDecodeError, match="garbage"):
        inflate(zlib.compress(data) + b"junk", "deflate", 1000)
    with pytest.raises(OtlpDecodeError, match="truncated"):
        inflate(b"", "gzip", 1000)
    with pytest.raises(BodyTooLarge):
        inflate(data, "identity", 10)
    with pytest.raises(BodyTooLarge):
        inflate(zlib.compress(data), "deflate", 699)
    assert inflate(zlib.compress(data), "deflate", 700) == data


ANY_VALUES = st.one_of(
    st.builds(lambda v: AnyValue(int_value=v), st.integers(-(1 << 63), (1 << 63) - 1)),
    st.builds(lambda v: AnyValue(double_value=v), st.floats()),
    st.builds(lambda v: AnyValue(string_value=v), st.text(max_size=20) | st.from_regex(r"-?\d{1,12}(\.\d*)?")),
    st.builds(lambda v: AnyValue(bool_value=v), st.booleans()),
    st.builds(lambda v: AnyValue(bytes_value=v), st.binary(max_size=8)),
    st.builds(lambda v: AnyValue(array_value=ArrayValue(values=[AnyValue(string_value=s) for s in v])),
              st.lists(st.text(max_size=5), max_size=3)),
)
ATTRIBUTE_KEYS = st.sampled_from([*VLLM_ATTRIBUTES, "gen_ai.response.model", "gen_ai.request.model",
                                  "gen_ai.response.finish_reasons", "x"])
NANOS = st.integers(0, (1 << 64) - 1) | st.just(ARRIVAL_NS) | st.just(FINISH_NS)
SPANS = st.builds(
    lambda name, start, end, attrs: ProtoSpan(name=name, start_time_unix_nano=start, end_time_unix_nano=end,
                                              attributes=[KeyValue(key=k, value=v) for k, v in attrs]),
    st.sampled_from(["llm_request", "llm_request", "other", ""]), NANOS, NANOS,
    st.lists(st.tuples(ATTRIBUTE_KEYS, ANY_VALUES), max_size=16),
)
MESSAGES = st.builds(
    lambda spans, engine: request_of(*spans, resource={"stepline.engine": engine} if engine else None),
    st.lists(SPANS, max_size=6), st.sampled_from(["", "e1"]),
)


@settings(max_examples=300, deadline=2000)
@given(st.binary(max_size=2048), st.sampled_from([PROTOBUF, JSON]))
def test_decode_random_bytes_raises_only_its_own_error(body: bytes, media_type: str) -> None:
    with contextlib.suppress(OtlpDecodeError):
        decode(body, media_type, HOST)


@settings(max_examples=300, deadline=2000)
@given(st.binary(max_size=2048), st.sampled_from(["gzip", "deflate", "identity", "br"]))
def test_inflate_random_bytes_raises_only_its_own_errors(body: bytes, encoding: str) -> None:
    with contextlib.suppress(OtlpDecodeError, BodyTooLarge):
        assert len(inflate(body, encoding, 512)) <= 512


@settings(max_examples=200, deadline=2000, suppress_health_check=[HealthCheck.too_slow])
@given(MESSAGES)
def test_valid_ish_messages_give_valid_rows(message: ExportTraceServiceRequest) -> None:
    decoded = decode(message.SerializeToString(), PROTOBUF, HOST)
    spans = [s for rs in message.resource_spans for ss in rs.scope_spans for s in ss.spans]
    assert len(decoded.rows) + decoded.rejected + decoded.ignored == len(spans)
    assert decoded.ignored == sum(s.name != "llm_request" for s in spans)
    for row in decoded.rows:
        assert 0 < row.arrival_ts <= row.ts and row.request_id and row.source == "otlp"
        for count in (row.prompt_tokens, row.generation_tokens, row.max_tokens):
            assert 0 <= count < 1 << 32
        for seconds in (row.queue_seconds, row.prefill_seconds, row.decode_seconds, row.inference_seconds,
                        row.e2e_seconds, row.ttft_seconds):
            assert math.isnan(seconds) or (math.isfinite(seconds) and seconds >= 0)
    as_json = decode(json_format.MessageToJson(message).encode(), JSON, HOST)
    assert (as_json.ignored, as_json.rejected) == (decoded.ignored, decoded.rejected)
    assert [r.request_id for r in as_json.rows] == [r.request_id for r in decoded.rows]
