"""The datagram format between the plugin and the sidecar: compact, versioned, fixed-layout binary.

A datagram is a header, then records. Every number is little-endian.

    header  magic "STPL", version u8, flags u8, engine-name length u16, pid u32, instance u32,
            sequence u64 (per plugin instance, +1 per datagram), dropped u64 (records the plugin
            has dropped so far), then the engine name (UTF-8), then (version 2, flag CREDENTIAL)
            a 16-byte credential
    record  type u8, payload length u16, payload

Step payloads are fixed fields then float32 TTFT and ITL samples; request payloads are fixed fields
then the request id; the configuration payload is JSON (sent once, size does not matter).

Versions. A plugin writes the lowest version that says what it sends: version 1 (no flags) when it has
no token, version 2 when it carries a credential. A collector reads both. So an engine without a token
talks to every collector, and a collector that predates the credential refuses a version-2 datagram by
its version (upgrade collectors before giving engines a token), rather than misreading the credential
as a record. A version-2 flag this collector does not know is refused, never skipped.

The credential is the first 16 bytes of SHA-256 over a fixed context string and the shared token
(STEPLINE_PLUGIN_TOKEN on both sides): the token itself never goes on the wire, and the plugin computes
the credential once, so `record()` costs the same with or without it. It is a bearer secret: it keeps
out whoever can write to the socket but does not know the token (another container or user sharing the
socket's directory); it does not sign the datagram.
"""

from __future__ import annotations

import hashlib
import json
import math
import struct
import sys
from array import array
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

MAGIC = b"STPL"
VERSION = 2  # the newest version this stepline writes
VERSIONS = (1, 2)  # the versions this stepline reads
FLAG_CREDENTIAL = 1  # version 2: a credential follows the engine name
KNOWN_FLAGS = {1: 0, 2: FLAG_CREDENTIAL}  # per version, the flags a reader understands
CREDENTIAL_SIZE = 16
_CREDENTIAL_CONTEXT = b"stepline plugin datagram credential v2\x00"
MAX_DATAGRAM = 60_000  # under the 64 KiB a Unix datagram socket takes with default buffers
MAX_ENGINE_NAME = 200
MAX_REQUEST_ID = 512
# TTFT and ITL samples one step record carries at most (a u16 count each; these keep a record under MAX_DATAGRAM).
MAX_TTFT_SAMPLES = 4096
MAX_ITL_SAMPLES = 8192

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
# The engine core stepped through its batch queue (async scheduling or pipeline parallelism): elapsed_ms is the
# core's wait for a step it launched earlier (vLLM 0.33 vllm/v1/engine/core.py:777-783). Readers of version 2
# that predate the flag ignore it, as they read elapsed_ms as before.
STEP_BATCH_QUEUE = 4
FINISH_REASONS = ("", "stop", "length", "abort", "error", "repetition")
FINISH_CODE = {name: code for code, name in enumerate(FINISH_REASONS)}
U32 = 0xFFFFFFFF
MAX_TS = 2.0**63 / 1e6  # seconds: past this a timestamp does not fit the store's microseconds (and is no time)


class WireError(ValueError):
    """A datagram that is not a valid stepline datagram; the message says what is wrong."""


class Header(NamedTuple):
    """Who sent a datagram, where it stands in that sender's sequence, and the credential it carries (or b"")."""

    engine: str
    pid: int
    instance: int
    sequence: int
    dropped: int
    version: int = 1
    credential: bytes = b""


class StepFields(NamedTuple):
    """A step record's fixed fields as STEP lays them out, by name: the one place that knows their order."""

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
    flags: int
    n_ttft: int
    n_itl: int


class RequestFields(NamedTuple):
    """A request record's fixed fields as REQUEST lays them out, by name; the request id follows them."""

    ts: float
    engine_index: int
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
    finish_code: int
    request_id_length: int


@dataclass(frozen=True)
class StepRecord:
    """One engine iteration; elapsed_ms is NaN when vLLM gave no iteration details. `waiting` and `skipped_waiting`
    are vLLM's num_waiting_reqs and num_skipped_waiting_reqs, apart: the first leaves out the deferred waiters the
    second counts (the `steps` row's `waiting` is their sum)."""

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
    batch_queue: bool = False  # STEP_BATCH_QUEUE: elapsed_ms is the core's wait for the step, not its time


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


def credential_for(token: str) -> bytes:
    """The 16-byte credential a datagram carries for `token` (never the token itself)."""
    return hashlib.sha256(_CREDENTIAL_CONTEXT + token.encode("utf-8")).digest()[:CREDENTIAL_SIZE]


def encode_header(engine: bytes, pid: int, instance: int, sequence: int, dropped: int,
                  credential: bytes = b"") -> bytes:
    """A header: version 1 without a credential, version 2 with one (see the module docstring)."""
    if credential:
        if len(credential) != CREDENTIAL_SIZE:
            raise ValueError(f"a credential is {CREDENTIAL_SIZE} bytes, got {len(credential)}")
        fixed = HEADER.pack(MAGIC, 2, FLAG_CREDENTIAL, len(engine), pid, instance, sequence, dropped)
        return fixed + engine + credential
    return HEADER.pack(MAGIC, 1, 0, len(engine), pid, instance, sequence, dropped) + engine


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
    ttft, itl = list(ttft or ())[:MAX_TTFT_SAMPLES], list(itl or ())[:MAX_ITL_SAMPLES]
    try:
        data = array("f", ttft).tobytes() + array("f", itl).tobytes()
    except (TypeError, OverflowError):
        data = array("f", [_clean("f", v) for v in (*ttft, *itl)]).tobytes()
    return len(ttft), len(itl), data


def encode_step(step: StepRecord) -> bytes:
    n_ttft, n_itl, samples = pack_samples(step.ttft_seconds, step.itl_seconds)
    flags = ((STEP_DUMMY if step.is_dummy else 0) | (0 if math.isnan(step.elapsed_ms) else STEP_HAS_DETAILS)
             | (STEP_BATCH_QUEUE if step.batch_queue else 0))
    return pack_record(STEP_RECORD, STEP, (
        step.ts, step.iteration, step.engine_index, step.elapsed_ms, step.num_ctx_requests, step.num_ctx_tokens,
        step.num_generation_requests, step.num_generation_tokens, step.running, step.waiting, step.skipped_waiting,
        step.kv_cache_usage, step.prefix_cache_queries, step.prefix_cache_hits, step.preempted,
        step.spec_num_drafts, step.spec_num_draft_tokens, step.spec_num_accepted_tokens, flags, n_ttft, n_itl,
    ), samples)


def encode_config(config: dict[str, Any]) -> bytes:
    payload = json.dumps(config, default=str, sort_keys=True).encode()[:MAX_DATAGRAM - 1024]
    return RECORD.pack(CONFIG_RECORD, len(payload)) + payload


def decode(data: bytes) -> Datagram:
    """Decode and validate one datagram; raise WireError naming the first problem."""
    header, offset = decode_header(data)
    datagram = Datagram(header)
    records = datagram.records
    for kind, fields, first, second in iter_records(data, offset):
        if kind == STEP_RECORD:
            records.append(_step_record(fields, first, second))
        elif kind == REQUEST_RECORD:
            records.append(_request_record(fields, first))
        else:
            records.append(ConfigRecord(first))
    return datagram


def decode_header(data: bytes) -> tuple[Header, int]:
    """Validate a datagram's header; returns it and the offset of the first record. Raises WireError."""
    if len(data) > MAX_DATAGRAM:
        raise WireError(f"datagram of {len(data)} bytes exceeds {MAX_DATAGRAM}")
    if len(data) < HEADER.size:
        raise WireError(f"datagram of {len(data)} bytes is shorter than a header")
    magic, version, flags, name_len, pid, instance, sequence, dropped = HEADER.unpack_from(data)
    if magic != MAGIC:
        raise WireError("not a stepline datagram (bad magic)")
    if version not in KNOWN_FLAGS:
        raise WireError(f"datagram version {version}, this collector reads versions {VERSIONS[0]}-{VERSIONS[-1]}: "
                        "upgrade stepline")
    if flags & ~KNOWN_FLAGS[version]:
        raise WireError(f"datagram version {version} with unknown flags {flags:#04x}: upgrade stepline")
    offset = HEADER.size + name_len
    if name_len > MAX_ENGINE_NAME or offset > len(data):
        raise WireError(f"engine name of {name_len} bytes does not fit")
    try:
        engine = data[HEADER.size:offset].decode("utf-8")
    except UnicodeDecodeError:
        raise WireError("engine name is not UTF-8") from None
    given = b""
    if flags & FLAG_CREDENTIAL:
        given = data[offset:offset + CREDENTIAL_SIZE]
        offset += CREDENTIAL_SIZE
        if offset > len(data):
            raise WireError("credential does not fit")
    return Header(engine, pid, instance, sequence, dropped, version, given), offset


# The collector's hot path: one struct call per record's fixed fields, samples as arrays of the buffer's bytes.
_STEP_SIZE, _REQUEST_SIZE, _RECORD_SIZE = STEP.size, REQUEST.size, RECORD.size
_LITTLE_ENDIAN = sys.byteorder == "little"
_N_REASONS = len(FINISH_REASONS)


def _samples(data: bytes, start: int, end: int) -> array[float]:
    """A step's samples as the wire carried them: an array of float32 over a copy of their bytes, with no float object
    per sample (what the store's Native Array(Float32) column takes as it is, stepline.store.batches). A list of
    floats cost 0.9 us an array to make, 63 ITL samples a step, and 2 KiB to hold; this 0.2 us and 0.3 KiB."""
    samples = array("f", data[start:end])
    if not _LITTLE_ENDIAN:
        samples.byteswap()
    return samples


def iter_records(data: bytes, offset: int) -> Iterator[tuple[int, Any, Any, Any]]:
    """The records from `offset` on, validated, as plain values (for code that builds its own rows):

        (STEP_RECORD, StepFields, TTFT samples, ITL samples: arrays of float32)
        (REQUEST_RECORD, RequestFields, request id, None)
        (CONFIG_RECORD, (), configuration dict, None)

    Raises WireError at the first bad record (records before it were yielded: discard them).
    """
    end = len(data)
    unpack_record, unpack_step, unpack_request = RECORD.unpack_from, STEP.unpack_from, REQUEST.unpack_from
    step_fields, request_fields = StepFields._make, RequestFields._make  # 0.2 us a record
    max_ts = MAX_TS  # a local: this loop is the collector's hot path
    while offset < end:
        if offset + _RECORD_SIZE > end:
            raise WireError(f"truncated record header at byte {offset}")
        kind, length = unpack_record(data, offset)
        start = offset + _RECORD_SIZE
        offset = start + length
        if offset > end:
            raise WireError(f"record of {length} bytes at byte {start} runs past the datagram")
        if kind == STEP_RECORD:
            if length < _STEP_SIZE:
                raise WireError(f"step record of {length} bytes, need {_STEP_SIZE}")
            step = step_fields(unpack_step(data, start))
            n_ttft, n_itl = step.n_ttft, step.n_itl
            if length != _STEP_SIZE + 4 * (n_ttft + n_itl):
                raise WireError(f"step record of {length} bytes does not hold {n_ttft} TTFT and {n_itl} ITL samples")
            if not -max_ts < step.ts < max_ts:  # NaN fails too
                raise WireError(f"step timestamp {step.ts} is not a time")
            split = start + _STEP_SIZE + 4 * n_ttft
            yield STEP_RECORD, step, _samples(data, start + _STEP_SIZE, split), _samples(data, split, offset)
        elif kind == REQUEST_RECORD:
            if length < _REQUEST_SIZE:
                raise WireError(f"request record of {length} bytes, need {_REQUEST_SIZE}")
            request = request_fields(unpack_request(data, start))
            if length != _REQUEST_SIZE + request.request_id_length:
                raise WireError(f"request record of {length} bytes does not hold a {request.request_id_length}-byte "
                                "request id")
            if not -max_ts < request.ts < max_ts:  # NaN fails too
                raise WireError(f"request timestamp {request.ts} is not a time")
            if request.finish_code >= _N_REASONS:
                raise WireError(f"unknown finish reason code {request.finish_code}")
            try:
                request_id = data[start + _REQUEST_SIZE:offset].decode("utf-8")
            except UnicodeDecodeError:
                raise WireError("request id is not UTF-8") from None
            yield REQUEST_RECORD, request, request_id, None
        elif kind == CONFIG_RECORD:
            yield CONFIG_RECORD, (), _decode_config(data[start:offset]), None
        else:
            raise WireError(f"unknown record type {kind}")


def _step_record(f: StepFields, ttft: Sequence[float], itl: Sequence[float]) -> StepRecord:
    return StepRecord(
        ts=f.ts, iteration=f.iteration, engine_index=f.engine_index,
        elapsed_ms=f.elapsed_ms if f.flags & STEP_HAS_DETAILS else math.nan, num_ctx_requests=f.num_ctx_requests,
        num_ctx_tokens=f.num_ctx_tokens, num_generation_requests=f.num_generation_requests,
        num_generation_tokens=f.num_generation_tokens, running=f.running, waiting=f.waiting,
        skipped_waiting=f.skipped_waiting, kv_cache_usage=f.kv_cache_usage,
        prefix_cache_queries=f.prefix_cache_queries, prefix_cache_hits=f.prefix_cache_hits, preempted=f.preempted,
        spec_num_drafts=f.spec_num_drafts, spec_num_draft_tokens=f.spec_num_draft_tokens,
        spec_num_accepted_tokens=f.spec_num_accepted_tokens, is_dummy=bool(f.flags & STEP_DUMMY),
        ttft_seconds=tuple(ttft), itl_seconds=tuple(itl), batch_queue=bool(f.flags & STEP_BATCH_QUEUE),
    )


def _request_record(f: RequestFields, request_id: str) -> RequestRecord:
    return RequestRecord(
        ts=f.ts, engine_index=f.engine_index, request_id=request_id, finish_reason=FINISH_REASONS[f.finish_code],
        e2e_seconds=f.e2e_seconds, queued_seconds=f.queued_seconds, prefill_seconds=f.prefill_seconds,
        inference_seconds=f.inference_seconds, decode_seconds=f.decode_seconds,
        mean_tpot_seconds=f.mean_tpot_seconds, prompt_tokens=f.prompt_tokens,
        generation_tokens=f.generation_tokens, max_tokens=f.max_tokens, cached_tokens=f.cached_tokens,
        preemptions=f.preemptions,
    )


def _decode_config(payload: bytes) -> dict[str, Any]:
    try:
        config = json.loads(payload)
    except (ValueError, RecursionError) as exc:  # not UTF-8, not JSON, or nested past the parser's depth
        raise WireError(f"configuration record is not JSON: {type(exc).__name__}") from None
    if not isinstance(config, dict):
        raise WireError("configuration record is not a JSON object")
    return config
