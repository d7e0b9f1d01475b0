"""The plugin's vLLM-free core: vLLM's stats in, datagrams to the sidecar out, never blocking, never raising.

Transport: a Unix datagram socket, non-blocking. Chosen over UDP on loopback because every failure
is visible to the sender: no listener is an immediate error, a full receive queue is EAGAIN. UDP
would drop silently in both cases, and a plugin that cannot count its drops hides the very stalls
stepline exists to show. Records are batched into datagrams of up to 60 KB and sent at most every
`flush_interval_s` (and on vLLM's periodic `log()`), which keeps `record()` to an encode and an append
on most calls and makes the kernel's short datagram queue (net.unix.max_dgram_qlen) hold many steps.

With a token (STEPLINE_PLUGIN_TOKEN, the collector's too), every datagram carries the credential derived
from it (see wire.py); the credential is computed once here, so `record()` costs the same with or without.
"""

from __future__ import annotations

import logging
import math
import os
import random
import socket
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from stepline.plugin import wire

log = logging.getLogger("stepline.plugin")

DEFAULT_SOCKET = "/tmp/stepline-plugin.sock"
DEFAULT_ENGINE = "vllm"


def engine_name_from_env(environ: dict[str, str] | None = None) -> str:
    """STEPLINE_ENGINE, else OTEL_SERVICE_NAME (so OTLP spans and steps agree), else "vllm"."""
    env = os.environ if environ is None else environ
    return (env.get("STEPLINE_ENGINE") or env.get("OTEL_SERVICE_NAME") or DEFAULT_ENGINE)[: wire.MAX_ENGINE_NAME]


def finish_reason_name(reason: Any) -> str:
    """vLLM's FinishReason (an IntEnum whose str() is the name), or a plain string, as lower-case text."""
    if isinstance(reason, str):
        return reason.lower()
    name = getattr(reason, "name", None)
    return name.lower() if isinstance(name, str) else str(reason).lower()


class PluginCore:
    """Turns each `record()` call into compact records and ships them in batches to the sidecar."""

    def __init__(
        self,
        engine: str,
        socket_path: str = DEFAULT_SOCKET,
        *,
        max_buffer_bytes: int = 8 << 20,
        flush_interval_s: float = 0.05,
        reconnect_interval_s: float = 5.0,
        log_interval_s: float = 60.0,
        token: str | None = None,
        monotonic: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
    ) -> None:
        self.engine = engine
        self.socket_path = socket_path
        self._engine_bytes = engine.encode("utf-8", errors="replace")[: wire.MAX_ENGINE_NAME]
        self._credential = wire.credential_for(token) if token else b""  # the token itself is not kept
        self._body_limit = wire.MAX_DATAGRAM - wire.HEADER.size - len(self._engine_bytes) - len(self._credential)
        self._max_buffer_bytes = max_buffer_bytes
        self._flush_interval_s = flush_interval_s
        self._reconnect_interval_s = reconnect_interval_s
        self._log_interval_s = log_interval_s
        self._monotonic = monotonic
        self._wall = wall
        self._pid = os.getpid() & wire.U32
        self._instance = random.getrandbits(32)
        self._sequence = 0
        self._pending = bytearray()
        self._pending_records = 0
        self._queue: deque[tuple[bytes, int]] = deque()  # sealed batch bodies and their record counts
        self._queued_bytes = 0
        self._sock: socket.socket | None = None
        self._next_connect = 0.0
        self._last_flush = monotonic()
        self._iteration: dict[int, int] = {}
        self._reason_codes: dict[Any, int] = {}
        # Counters: cumulative, exposed for tests and the benchmark; drops also logged once per interval.
        self.records_sent = 0
        self.datagrams_sent = 0
        self.dropped: dict[str, int] = {}
        self.internal_errors = 0
        self._dropped_since_log: dict[str, int] = {}
        self._last_log = monotonic()

    @property
    def dropped_total(self) -> int:
        return sum(self.dropped.values())

    @property
    def records_held(self) -> int:
        """Records encoded but neither sent nor dropped yet: the open batch and batches waiting for the socket."""
        return self._pending_records + sum(n for _, n in self._queue)

    # -- what vLLM calls ---------------------------------------------------------------------------

    def record(self, scheduler_stats: Any, iteration_stats: Any, engine_idx: int = 0) -> None:
        """Encode one engine-core output batch; never raises, never blocks."""
        try:
            ts = getattr(iteration_stats, "iteration_timestamp", None) or self._wall()
            if scheduler_stats is not None:
                self._add(self._step(ts, scheduler_stats, iteration_stats, engine_idx))
            if iteration_stats is not None:
                for finished in iteration_stats.finished_requests:
                    self._add(self._request(ts, finished, engine_idx))
            if self._monotonic() - self._last_flush >= self._flush_interval_s:
                self.flush()
        except Exception:  # vLLM's serving path must never see our failure; it is counted and logged
            self.internal_errors += 1
            self._drop("plugin_error", 1)
            if self.internal_errors == 1:
                log.exception("stepline plugin: could not encode a step (counted; later failures are counted only)")

    def engine_initialized(self, config: dict[str, Any]) -> None:
        """Send the engine's configuration once, ahead of its steps."""
        try:
            self._add(wire.encode_config(config))
            self.flush()
        except Exception:
            self.internal_errors += 1
            log.exception("stepline plugin: could not send the engine configuration")

    def flush(self) -> None:
        """Seal what is pending and send what the socket takes now; also reports drops, rate-limited."""
        try:
            now = self._monotonic()
            self._last_flush = now
            self._seal()
            self._send_queued(now)
            if self._dropped_since_log and now - self._last_log >= self._log_interval_s:
                self._log_drops(now)
        except Exception:
            self.internal_errors += 1
            if self.internal_errors == 1:
                log.exception("stepline plugin: flush failed (counted; later failures are counted only)")

    def close(self, drain_timeout_s: float = 2.0) -> None:
        """Send what is buffered, waiting up to drain_timeout_s for a busy sidecar; then count the rest."""
        deadline = self._monotonic() + drain_timeout_s
        self.flush()
        while (self._queue or self._pending_records) and self._sock is not None and self._monotonic() < deadline:
            time.sleep(0.005)
            self.flush()
        self._drop_queue("closed")
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    # -- reading vLLM's stats --------------------------------------------------------------------------
    # The hot path: attributes go straight into one struct.pack; wire.pack_record cleans odd values only
    # when that pack fails, so well-formed stats cost no per-field Python work.

    def _step(self, ts: float, s: Any, it: Any, engine_idx: int) -> bytes:
        details = s.iteration_details
        prefix = s.prefix_cache_stats
        spec = getattr(s, "spec_decoding_stats", None)
        if details is not None:
            iteration = details.iteration_index
            self._iteration[engine_idx] = iteration
            flags = (wire.STEP_DUMMY if details.is_dummy else 0) | wire.STEP_HAS_DETAILS
            work = (details.elapsed_ms, details.num_ctx_requests, details.num_ctx_tokens,
                    details.num_generation_requests, details.num_generation_tokens)
        else:
            iteration = self._iteration.get(engine_idx, -1) + 1
            self._iteration[engine_idx] = iteration
            flags = 0
            work = (math.nan, 0, 0, 0, getattr(it, "num_generation_tokens", 0))
        if it is not None:
            n_ttft, n_itl, samples = wire.pack_samples(it.time_to_first_tokens_iter, it.inter_token_latencies_iter)
            preempted = it.num_preempted_reqs
        else:
            n_ttft, n_itl, samples, preempted = 0, 0, b"", 0
        return wire.pack_record(wire.STEP_RECORD, wire.STEP, (
            ts, iteration, engine_idx, *work, s.num_running_reqs, s.num_waiting_reqs,
            getattr(s, "num_skipped_waiting_reqs", 0), s.kv_cache_usage,
            # Preempted requests re-query the cache; vLLM's own counters keep them apart, and so do we.
            prefix.queries if prefix is not None else 0, prefix.hits if prefix is not None else 0, preempted,
            spec.num_drafts if spec is not None else 0, spec.num_draft_tokens if spec is not None else 0,
            spec.num_accepted_tokens if spec is not None else 0, flags, n_ttft, n_itl,
        ), samples)

    def _request(self, ts: float, f: Any, engine_idx: int) -> bytes:
        request_id = f.request_id
        encoded = (request_id if isinstance(request_id, str) else str(request_id or "")).encode(
            "utf-8", errors="replace")[: wire.MAX_REQUEST_ID]
        reason = f.finish_reason
        code = self._reason_codes.get(reason)
        if code is None:
            code = wire.FINISH_CODE.get(finish_reason_name(reason), 0)
            if len(self._reason_codes) < 64:  # vLLM has a handful of reasons; never grow without bound
                self._reason_codes[reason] = code
        return wire.pack_record(wire.REQUEST_RECORD, wire.REQUEST, (
            ts, engine_idx, f.e2e_latency, f.queued_time, f.prefill_time, f.inference_time, f.decode_time,
            f.mean_time_per_output_token, f.num_prompt_tokens, f.num_generation_tokens, f.max_tokens_param or 0,
            getattr(f, "num_cached_tokens", 0), getattr(f, "num_preemptions", 0), code, len(encoded),
        ), encoded)

    # -- batching and sending --------------------------------------------------------------------------

    def _add(self, record: bytes) -> None:
        if len(record) > self._body_limit:
            self._drop("too_large", 1)
            return
        if len(self._pending) + len(record) > self._body_limit:
            self._seal()
        self._pending += record
        self._pending_records += 1

    def _seal(self) -> None:
        if not self._pending_records:
            return
        body = bytes(self._pending)
        self._queue.append((body, self._pending_records))
        self._queued_bytes += len(body)
        self._pending.clear()
        self._pending_records = 0
        # Bounded: when the sidecar is slow, the oldest batches go first, and are counted.
        while self._queued_bytes > self._max_buffer_bytes and len(self._queue) > 1:
            old, count = self._queue.popleft()
            self._queued_bytes -= len(old)
            self._drop("buffer_full", count)

    def _send_queued(self, now: float) -> None:
        sock = self._connected(now)
        if sock is None:
            self._drop_queue("no_sidecar")
            return
        while self._queue:
            body, count = self._queue[0]
            header = wire.encode_header(self._engine_bytes, self._pid, self._instance, self._sequence,
                                        self.dropped_total, self._credential)
            try:
                sock.send(header + body)
            except BlockingIOError:
                return  # the sidecar's queue is full: keep the batch, try on the next flush
            except OSError:
                # The sidecar went away (ECONNREFUSED; EPIPE while it stops; ENOENT after a restart): reconnect later.
                sock.close()
                self._sock = None
                self._next_connect = now + self._reconnect_interval_s
                self._drop_queue("no_sidecar")
                return
            self._queue.popleft()
            self._queued_bytes -= len(body)
            self._sequence += 1
            self.datagrams_sent += 1
            self.records_sent += count

    def _connected(self, now: float) -> socket.socket | None:
        if self._sock is not None:
            return self._sock
        if now < self._next_connect:
            return None
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        sock.setblocking(False)
        try:
            sock.connect(self.socket_path)
        except OSError:
            sock.close()
            self._next_connect = now + self._reconnect_interval_s
            return None
        self._sock = sock
        return sock

    def _drop_queue(self, reason: str) -> None:
        count = sum(n for _, n in self._queue)
        self._queue.clear()
        self._queued_bytes = 0
        if count:
            self._drop(reason, count)

    def _drop(self, reason: str, count: int) -> None:
        self.dropped[reason] = self.dropped.get(reason, 0) + count
        self._dropped_since_log[reason] = self._dropped_since_log.get(reason, 0) + count

    def _log_drops(self, now: float) -> None:
        parts = ", ".join(f"{n} ({reason})" for reason, n in sorted(self._dropped_since_log.items()))
        log.warning("stepline plugin: dropped %s records in the last %.0f s; sidecar socket %s",
                    parts, now - self._last_log, self.socket_path)
        self._dropped_since_log.clear()
        self._last_log = now
