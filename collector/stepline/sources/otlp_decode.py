"""OTLP/HTTP trace payloads to rows: inflate with a cap, parse, map vLLM's `llm_request` spans to `Request` rows
and gateways' decision spans (stepline.gateway.decisions) to `GatewayDecision` rows.

What vLLM's span says (vLLM 0.33, vllm/v1/engine/output_processor.py:941-1000, `do_tracing`): gen_ai.request.id,
the gen_ai.usage token counts, the gen_ai.latency.* times and, when set, gen_ai.request.top_p, max_tokens,
temperature and n. No model and no finish reason: vllm/tracing/utils.py:28 defines gen_ai.response.model and
nothing in vLLM sets it; gen_ai.request.model and gen_ai.response.finish_reasons it does not define. A request
only a span reported is named with its engine's model as the collector knows it (`model_of`), and its finish
reason is UNKNOWN_FINISH_REASON; both attributes are still read from other senders' spans.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from google.protobuf import json_format  # type: ignore[import-untyped]
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue

from stepline.core.oneline import one_line
from stepline.gateway.decisions import (
    DECISION_SPAN,
    DEFAULT_GATEWAY,
    MAX_NAME_BYTES,
    DecisionRejected,
    text_cut,
    to_decision,
)
from stepline.model.rows import UNKNOWN_FINISH_REASON, GatewayDecision, Request

SPAN_NAME = "llm_request"
PROTOBUF = "application/x-protobuf"
JSON = "application/json"
ENCODINGS = frozenset({"", "identity", "gzip", "x-gzip", "deflate"})
DEFAULT_ENGINE = "vllm"
MAX_PROBLEMS = 3  # reasons kept per payload for the partial_success message
_MAX_NANOS = (1 << 63) - 1  # int64 nanoseconds (year 2262): what every OTLP SDK means; DateTime64(6) holds it
_MIN_NANOS = 946_684_800 * 10**9  # 2000-01-01T00:00:00Z
_MAX_COUNT = (1 << 32) - 1  # token columns are UInt32

_LATENCIES = (
    ("queue_seconds", "gen_ai.latency.time_in_queue"),
    ("prefill_seconds", "gen_ai.latency.time_in_model_prefill"),
    ("decode_seconds", "gen_ai.latency.time_in_model_decode"),
    ("inference_seconds", "gen_ai.latency.time_in_model_inference"),
    ("e2e_seconds", "gen_ai.latency.e2e"),
    ("ttft_seconds", "gen_ai.latency.time_to_first_token"),
)


class OtlpDecodeError(ValueError):
    """The payload is not an OTLP trace export (corrupt compression, protobuf or JSON); the client should not retry."""


class BodyTooLarge(ValueError):
    """The payload inflates past the size limit."""


class SpanRejected(ValueError):
    """One `llm_request` span cannot become a row; the message names why."""


@dataclass
class Decoded:
    """What one export request held."""

    rows: list[Request] = field(default_factory=list)
    decisions: list[GatewayDecision] = field(default_factory=list)
    ignored: int = 0
    rejected: int = 0
    truncated: int = 0  # spans kept with their free text cut short
    problems: list[str] = field(default_factory=list)

    def reject(self, problem: str) -> None:
        self.rejected += 1
        if len(self.problems) < MAX_PROBLEMS:
            self.problems.append(problem)

    @property
    def error_message(self) -> str:
        """One line for partial_success: how many were rejected and the first reasons."""
        if not self.rejected:
            return ""
        more = "; ..." if self.rejected > len(self.problems) else ""
        return f"{self.rejected} span(s) rejected: {'; '.join(self.problems)}{more}"


def inflate(body: bytes, encoding: str, limit: int) -> bytes:
    """Undo a Content-Encoding without ever holding more than `limit` + one chunk of output (no gzip bombs)."""
    encoding = encoding.strip().lower()
    if encoding in ("", "identity"):
        if len(body) > limit:
            raise BodyTooLarge(f"body of {len(body)} bytes is over the {limit}-byte limit")
        return body
    if encoding in ("gzip", "x-gzip"):
        wbits, what = 16 + zlib.MAX_WBITS, "gzip"
    elif encoding == "deflate":
        # HTTP "deflate" is zlib-wrapped (what the OTel exporters send), but some clients send raw deflate.
        zlib_header = len(body) >= 2 and body[0] & 0x0F == 8 and (body[0] << 8 | body[1]) % 31 == 0
        wbits, what = (zlib.MAX_WBITS if zlib_header else -zlib.MAX_WBITS), "deflate"
    else:
        raise OtlpDecodeError(f"unsupported Content-Encoding {encoding!r}")
    out = bytearray()
    rest = body
    try:
        while True:  # one pass per gzip member: concatenated members are valid gzip
            inflater = zlib.decompressobj(wbits)
            data = rest
            while data and not inflater.eof:
                out += inflater.decompress(data, limit + 1 - len(out))
                if len(out) > limit:
                    raise BodyTooLarge(f"{what} body inflates past the {limit}-byte limit")
                data = inflater.unconsumed_tail
            if not inflater.eof:
                raise OtlpDecodeError(f"{what} body is truncated")
            rest = inflater.unused_data
            if not rest or what != "gzip":
                break
    except zlib.error as exc:
        raise OtlpDecodeError(f"corrupt {what} body ({exc})") from None
    if rest:
        raise OtlpDecodeError(f"{len(rest)} bytes of garbage after the {what} stream")
    return bytes(out)


def parse(body: bytes, media_type: str) -> ExportTraceServiceRequest:
    """An ExportTraceServiceRequest from protobuf or OTLP/JSON bytes."""
    message = ExportTraceServiceRequest()
    try:
        if media_type == JSON:
            # OTLP/JSON writes trace and span ids in hex, not base64: both decode here and the ids are unused.
            json_format.Parse(body.decode("utf-8"), message, ignore_unknown_fields=True)
        else:
            message.ParseFromString(body)
    except Exception as exc:  # untrusted bytes: any parser failure means a bad payload
        what = "OTLP/JSON" if media_type == JSON else "protobuf"
        detail = one_line(exc, 160) or type(exc).__name__
        raise OtlpDecodeError(f"not a valid {what} ExportTraceServiceRequest ({detail})") from None
    return message


def _no_model(engine: str) -> str:
    return ""


def decode(body: bytes, media_type: str, host: str, model_of: Callable[[str], str] = _no_model) -> Decoded:
    """Rows for the `llm_request` spans of one (inflated) export request; raises OtlpDecodeError only.
    `model_of`: an engine's model by its name ("" when not known), for spans that name none."""
    return to_rows(parse(body, media_type), host, model_of)


def to_rows(message: ExportTraceServiceRequest, host: str, model_of: Callable[[str], str] = _no_model) -> Decoded:
    """Rows for the `llm_request` and decision spans of a parsed export request; other spans are counted as
    ignored."""
    out = Decoded()
    for resource_spans in message.resource_spans:
        engine = engine_name(resource_spans.resource.attributes)
        for scope_spans in resource_spans.scope_spans:
            for span in scope_spans.spans:
                if span.name not in (SPAN_NAME, DECISION_SPAN):
                    out.ignored += 1
                    continue
                start, end = span.start_time_unix_nano, span.end_time_unix_nano
                try:
                    if span.name == SPAN_NAME:
                        out.rows.append(_request({kv.key: kv.value for kv in span.attributes}, start, end, engine,
                                                 host, model_of))
                        continue
                    _check_interval("decision", start, end)
                    gateway = engine if engine != DEFAULT_ENGINE else DEFAULT_GATEWAY
                    attrs = {kv.key: _plain(kv.value) for kv in span.attributes}
                    out.decisions.append(to_decision(attrs, start, end, gateway, host))
                    out.truncated += text_cut(attrs)
                except (SpanRejected, DecisionRejected) as exc:
                    out.reject(str(exc))
    return out


def _plain(value: AnyValue) -> object:
    """An attribute's value as Python: str, int, float, bool, or a list of them."""
    kind = value.WhichOneof("value")
    if kind == "array_value":
        return [_plain(v) for v in value.array_value.values]
    return getattr(value, kind) if kind in ("string_value", "int_value", "double_value", "bool_value") else None


def engine_name(resource: Iterable[KeyValue]) -> str:
    """`stepline.engine` if set, else a service.name the operator chose, else "vllm"."""
    attrs = {kv.key: kv.value for kv in resource}
    explicit = _text(attrs.get("stepline.engine"))
    if explicit:
        return explicit
    service = _text(attrs.get("service.name"))
    # The SDK names an unnamed service "unknown_service[:process]": that names no engine.
    return service if service and not service.startswith("unknown_service") else DEFAULT_ENGINE


def _request(attrs: dict[str, AnyValue], start_ns: int, end_ns: int, engine: str, host: str,
             model_of: Callable[[str], str]) -> Request:
    request_id = _text(attrs.get("gen_ai.request.id"))
    if not request_id:
        raise SpanRejected("a span without gen_ai.request.id")
    where = f"span {request_id[:64]!r}"
    _check_name(request_id, "gen_ai.request.id", where)
    _check_name(engine, "the resource's engine name", where)
    _check_interval(where, start_ns, end_ns)
    latencies = {column: _latency(attrs, key, where) for column, key in _LATENCIES}
    prompt_tokens = _count(attrs, "gen_ai.usage.prompt_tokens", where)
    generation_tokens = _count(attrs, "gen_ai.usage.completion_tokens", where)
    decode_s = latencies["decode_seconds"]
    # The model the response names, else the one its engine serves (what the plugin's rows of it carry), else the one
    # the request asked for.
    model = _check_name(_text(attrs.get("gen_ai.response.model")), "gen_ai.response.model", where)
    if not model:
        model = model_of(engine) or _check_name(_text(attrs.get("gen_ai.request.model")), "gen_ai.request.model",
                                                where)
    reason = _check_name(_first_text(attrs.get("gen_ai.response.finish_reasons")), "gen_ai.response.finish_reasons",
                         where)
    return Request(
        ts=_micros(end_ns),
        host=host,
        engine=engine,
        engine_index=0,
        model_name=model,
        request_id=request_id,
        source="otlp",
        finish_reason=reason or UNKNOWN_FINISH_REASON,
        arrival_ts=_micros(start_ns),
        mean_tpot_seconds=decode_s / (generation_tokens - 1) if generation_tokens > 1 else math.nan,
        prompt_tokens=prompt_tokens,
        cached_tokens=0,  # spans do not carry it; the stat-logger plugin's rows do
        generation_tokens=generation_tokens,
        max_tokens=_count(attrs, "gen_ai.request.max_tokens", where),
        preemptions=0,
        **latencies,
    )


def _check_interval(where: str, start_ns: int, end_ns: int) -> None:
    """SpanRejected unless the span's times make an interval: a start before 2000 is an unset or broken clock, not
    a request or a decision (it would sit at the epoch on the timeline)."""
    if not _MIN_NANOS <= start_ns <= end_ns <= _MAX_NANOS:
        raise SpanRejected(f"{where}: start/end time {start_ns}/{end_ns} ns is not a valid interval")


def _check_name(text: str, what: str, where: str) -> str:
    """The id or name as given; SpanRejected when it is over MAX_NAME_BYTES (cutting it could merge two)."""
    # Characters first: the resource's name is checked once per span, and len() does not read it.
    if len(text) > MAX_NAME_BYTES or len(text.encode("utf-8", "surrogatepass")) > MAX_NAME_BYTES:
        raise SpanRejected(f"{where}: {what} is over the {MAX_NAME_BYTES}-byte limit for ids and names "
                           f"({len(text)} characters)")
    return text


def _micros(nanos: int) -> int:
    return (nanos + 500) // 1000  # to the nearest microsecond, like rows.micros()


def _text(value: AnyValue | None) -> str:
    if value is None:
        return ""
    kind = value.WhichOneof("value")
    if kind == "string_value":
        return value.string_value
    if kind == "int_value":
        return str(value.int_value)
    return ""


def _first_text(value: AnyValue | None) -> str:
    if value is not None and value.WhichOneof("value") == "array_value":
        return next((_text(v) for v in value.array_value.values if _text(v)), "")
    return _text(value)


def _number(attrs: dict[str, AnyValue], key: str, where: str) -> float | int | None:
    """The attribute as a number (ints stay exact); None when absent; SpanRejected when it is not a number."""
    value = attrs.get(key)
    kind = value.WhichOneof("value") if value is not None else None
    if value is None or kind is None:
        return None
    if kind == "int_value":
        return value.int_value
    if kind == "double_value":
        return value.double_value
    if kind == "string_value":
        text = value.string_value.strip()
        try:
            return int(text)
        except ValueError:
            pass
        try:
            return float(text)
        except ValueError:
            pass
        raise SpanRejected(f"{where}: {key} is {text[:32]!r}, not a number")
    raise SpanRejected(f"{where}: {key} is a {kind.removesuffix('_value')}, not a number")


def _latency(attrs: dict[str, AnyValue], key: str, where: str) -> float:
    number = _number(attrs, key, where)
    if number is None:
        return math.nan
    seconds = float(number)
    if not (math.isfinite(seconds) and seconds >= 0):
        raise SpanRejected(f"{where}: {key} is {seconds}, not a finite non-negative number of seconds")
    return seconds


def _count(attrs: dict[str, AnyValue], key: str, where: str) -> int:
    number = _number(attrs, key, where)
    if number is None:
        return 0
    if isinstance(number, float):
        if not (math.isfinite(number) and number.is_integer()):
            raise SpanRejected(f"{where}: {key} is {number}, not a whole number")
        number = int(number)
    if not 0 <= number <= _MAX_COUNT:
        raise SpanRejected(f"{where}: {key} is {number}, outside 0-{_MAX_COUNT}")
    return number
