"""The datagram format between the plugin and the sidecar: compact, versioned, fixed-layout binary.

A datagram is a header, then records. Every number is little-endian.

    header  magic "STPL", version u8, flags u8, engine-name length u16, pid u32, instance u32,
            sequence u64 (per plugin instance, +1 per datagram), dropped u64 (records the plugin
            has dropped so far), then the engine name (UTF-8)
    record  type u8, payload length u16, payload

Step payloads are fixed fields then float32 TTFT and ITL samples; request payloads are fixed fields
then the request id; the configuration payload is JSON (sent once, size does not matter).
"""

from __future__ import annotations

import json
import math
import struct
from array import array
from dataclasses import dataclass, field
from typing import Any

MAGIC = b"STPL"
VERSION = 1
MAX_DATAGRAM = 60_000  # under the 64 KiB a Unix datagram socket takes with default buffers
MAX_ENGINE_NAME = 200
MAX_REQUEST_ID = 512

HEADER = struct.Struct("<4sBBHIIQQ")
RECORD = struct.Struct("<BH")
# ts, iteration, engine index, elapsed ms, ctx reqs/tokens, gen reqs/tokens, running, waiting, skipped,
# KV usage, prefix queries/hits, preempted, spec drafts/draft tokens/accepted, flags, #TTFT, #ITL
STEP = struct.Struct("<dQHfIIIIIIIfIIIIIIBHH")
# ts, engine index, e2e, queued, prefill, inference, decode, mean TPOT, prompt, generated, max tokens,
# cached, preemptions, finish reason, request-id length
REQUEST = struct.Struct("<dHffffffIIIIIBH")

STEP_RECORD, REQUEST_RECORD, CONFIG_RECORD = 1, 2, 3
STEP_DUMMY, STEP_HAS_DETAILS = 1, 2
FINISH_REASONS = ("", "stop", "length", "abort", "error", "repetition")
FINISH_CODE = {name: code for code, name in enumerate(FINISH_REASONS)}
U32 = 0xFFFFFFFF


class WireError(ValueError):
    """A datagram that is not a valid stepline datagram; the message says what is wrong."""


@dataclass(frozen=True)
class Header:
    """Who sent a datagram, and where it stands in that sender's sequence."""

    engine: str
    pid: int
    instance: int
    sequence: int
    dropped: int


@dataclass(frozen=True)
class StepRecord:
    """One engine iteration; elapsed_ms is NaN when vLLM gave no iteration details."""

    ts: float
    iteration: int
    engine_index: int
    elapsed_ms: float
    num_ctx_requests: int
    num_ctx_tokens: int
    num_generation_requests: int
    num_generation_tokens: int
    running: int
    waiting: int
    skipped_waiting: int
    kv_cache_usage: float
    prefix_cache_queries: int
    prefix_cache_hits: int
    preempted: int
    spec_num_drafts: int
    spec_num_draft_tokens: int
    spec_num_accepted_tokens: int
    is_dummy: bool
    ttft_seconds: tuple[float, ...] = ()
    itl_seconds: tuple[float, ...] = ()


@dataclass(frozen=True)
class RequestRecord:
    """One finished request, as vLLM's FinishedRequestStats has it; ts is the finishing iteration's."""

    ts: float
    engine_index: int
    request_id: str
    finish_reason: str
    e2e_seconds: float
    queued_seconds: float
    prefill_seconds: float
    inference_seconds: float
    decode_seconds: float
    mean_tpot_seconds: float
    prompt_tokens: int
    generation_tokens: int
    max_tokens: int
    cached_tokens: int
    preemptions: int


@dataclass(frozen=True)
class ConfigRecord:
    """The engine's configuration, sent once when the engine is initialised."""

    config: dict[str, Any]


@dataclass
class Datagram:
    """A decoded datagram."""

    header: Header
    records: list[StepRecord | RequestRecord | ConfigRecord] = field(default_factory=list)


def encode_header(engine: bytes, pid: int, instance: int, sequence: int, dropped: int) -> bytes:
    return HEADER.pack(MAGIC, VERSION, 0, len(engine), pid, instance, sequence, dropped) + engine


_LIMITS = {"B": 0xFF, "H": 0xFFFF, "I": U32, "Q": (1 << 64) - 1}


def _clean(code: str, value: Any) -> Any:
    """One value made packable: floats become NaN when they are not numbers, integers saturate."""
    if code in "df":
        try:
            return float(value)
        except (TypeError, ValueError, OverflowError):
            return math.nan
    try:
        number = int(value or 0)
    except (TypeError, ValueError, OverflowError):
        return 0
    return 0 if number < 0 else min(number, _LIMITS[code])


def pack_record(kind: int, layout: struct.Struct, values: tuple[Any, ...], tail: bytes = b"") -> bytes:
    """A record of fixed fields plus a tail. Well-formed values pack in one call (the hot path); anything
    odd (None, a negative count, a string) is cleaned field by field and packed again."""
    try:
        payload = layout.pack(*values) + tail
    except (struct.error, TypeError, ValueError, OverflowError):
        payload = layout.pack(*(_clean(code, v) for code, v in zip(layout.format[1:], values, strict=True))) + tail
    return RECORD.pack(kind, len(payload)) + payload


def pack_samples(ttft: Any, itl: Any) -> tuple[int, int, bytes]:
    """TTFT and ITL samples as float32, capped in count; odd values become NaN."""
    ttft, itl = list(ttft or ())[:4096], list(itl or ())[:8192]
    try:
        data = array("f", ttft).tobytes() + array("f", itl).tobytes()
    except (TypeError, OverflowError):
        data = array("f", [_clean("f", v) for v in (*ttft, *itl)]).tobytes()
    return len(ttft), len(itl), data


def encode_step(step: StepRecord) -> bytes:
    n_ttft, n_itl, samples = pack_samples(step.ttft_seconds, step.itl_seconds)
    flags = (STEP_DUMMY if step.is_dummy else 0) | (0 if math.isnan(step.elapsed_ms) else STEP_HAS_DETAILS)
    return pack_record(STEP_RECORD, STEP, (
        step.ts, step.iteration, step.engine_index, step.elapsed_ms, step.num_ctx_requests, step.num_ctx_tokens,
        step.num_generation_requests, step.num_generation_tokens, step.running, step.waiting, step.skipped_waiting,
        step.kv_cache_usage, step.prefix_cache_queries, step.prefix_cache_hits, step.preempted,
        step.spec_num_drafts, step.spec_num_draft_tokens, step.spec_num_accepted_tokens, flags, n_ttft, n_itl,
    ), samples)


def encode_request(request: RequestRecord) -> bytes:
    request_id = request.request_id.encode("utf-8", errors="replace")[:MAX_REQUEST_ID]
    return pack_record(REQUEST_RECORD, REQUEST, (
        request.ts, request.engine_index, request.e2e_seconds, request.queued_seconds, request.prefill_seconds,
        request.inference_seconds, request.decode_seconds, request.mean_tpot_seconds, request.prompt_tokens,
        request.generation_tokens, request.max_tokens, request.cached_tokens, request.preemptions,
        FINISH_CODE.get(request.finish_reason, 0), len(request_id),
    ), request_id)


def encode_config(config: dict[str, Any]) -> bytes:
    payload = json.dumps(config, default=str, sort_keys=True).encode()[:MAX_DATAGRAM - 1024]
    return RECORD.pack(CONFIG_RECORD, len(payload)) + payload


def decode(data: bytes) -> Datagram:
    """Decode and validate one datagram; raise WireError naming the first problem."""
    if len(data) > MAX_DATAGRAM:
        raise WireError(f"datagram of {len(data)} bytes exceeds {MAX_DATAGRAM}")
    if len(data) < HEADER.size:
        raise WireError(f"datagram of {len(data)} bytes is shorter than a header")
    magic, version, _flags, name_len, pid, instance, sequence, dropped = HEADER.unpack_from(data)
    if magic != MAGIC:
        raise WireError("not a stepline datagram (bad magic)")
    if version != VERSION:
        raise WireError(f"datagram version {version}, this collector reads version {VERSION}: upgrade stepline")
    offset = HEADER.size + name_len
    if name_len > MAX_ENGINE_NAME or offset > len(data):
        raise WireError(f"engine name of {name_len} bytes does not fit")
    try:
        engine = data[HEADER.size:offset].decode("utf-8")
    except UnicodeDecodeError:
        raise WireError("engine name is not UTF-8") from None
    datagram = Datagram(Header(engine, pid, instance, sequence, dropped))
    while offset < len(data):
        if offset + RECORD.size > len(data):
            raise WireError(f"truncated record header at byte {offset}")
        kind, length = RECORD.unpack_from(data, offset)
        start, offset = offset + RECORD.size, offset + RECORD.size + length
        if offset > len(data):
            raise WireError(f"record of {length} bytes at byte {start} runs past the datagram")
        payload = data[start:offset]
        if kind == STEP_RECORD:
            datagram.records.append(_decode_step(payload))
        elif kind == REQUEST_RECORD:
            datagram.records.append(_decode_request(payload))
        elif kind == CONFIG_RECORD:
            datagram.records.append(_decode_config(payload))
        else:
            raise WireError(f"unknown record type {kind}")
    return datagram


def _decode_step(payload: bytes) -> StepRecord:
    if len(payload) < STEP.size:
        raise WireError(f"step record of {len(payload)} bytes, need {STEP.size}")
    (ts, iteration, engine_index, elapsed, ctx_reqs, ctx_tokens, gen_reqs, gen_tokens, running, waiting, skipped,
     kv, queries, hits, preempted, drafts, draft_tokens, accepted, flags, n_ttft, n_itl) = STEP.unpack_from(payload)
    if len(payload) != STEP.size + 4 * (n_ttft + n_itl):
        raise WireError(f"step record of {len(payload)} bytes does not hold {n_ttft} TTFT and {n_itl} ITL samples")
    if not math.isfinite(ts):
        raise WireError("step timestamp is not finite")
    samples = struct.unpack_from(f"<{n_ttft + n_itl}f", payload, STEP.size)
    return StepRecord(
        ts, iteration, engine_index, elapsed if flags & STEP_HAS_DETAILS else math.nan, ctx_reqs, ctx_tokens,
        gen_reqs, gen_tokens, running, waiting, skipped, kv, queries, hits, preempted, drafts, draft_tokens, accepted,
        bool(flags & STEP_DUMMY), samples[:n_ttft], samples[n_ttft:],
    )


def _decode_request(payload: bytes) -> RequestRecord:
    if len(payload) < REQUEST.size:
        raise WireError(f"request record of {len(payload)} bytes, need {REQUEST.size}")
    (ts, engine_index, e2e, queued, prefill, inference, decode_s, tpot, prompt, generated, max_tokens, cached,
     preemptions, reason, id_len) = REQUEST.unpack_from(payload)
    if len(payload) != REQUEST.size + id_len:
        raise WireError(f"request record of {len(payload)} bytes does not hold a {id_len}-byte request id")
    if not math.isfinite(ts):
        raise WireError("request timestamp is not finite")
    if reason >= len(FINISH_REASONS):
        raise WireError(f"unknown finish reason code {reason}")
    try:
        request_id = payload[REQUEST.size:].decode("utf-8")
    except UnicodeDecodeError:
        raise WireError("request id is not UTF-8") from None
    return RequestRecord(ts, engine_index, request_id, FINISH_REASONS[reason], e2e, queued, prefill, inference,
                         decode_s, tpot, prompt, generated, max_tokens, cached, preemptions)


def _decode_config(payload: bytes) -> ConfigRecord:
    try:
        config = json.loads(payload)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise WireError(f"configuration record is not JSON: {exc}") from None
    if not isinstance(config, dict):
        raise WireError("configuration record is not a JSON object")
    return ConfigRecord(config)
