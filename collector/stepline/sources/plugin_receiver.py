"""Source: the stat-logger plugin's datagrams, one `steps` row per iteration, one `requests` row per request."""

from __future__ import annotations

import contextlib
import logging
import math
import os
import socket
import stat
import threading
import time
from dataclasses import dataclass

from stepline.plugin import wire
from stepline.ratelimit import RateLimitedLog
from stepline.rows import Event, Request, Row, Step, micros
from stepline.sources.base import Emit, SourceContext

log = logging.getLogger(__name__)

EMIT_BATCH_ROWS = 5_000


@dataclass
class _Sender:
    """What the receiver knows of one plugin instance (one vLLM process)."""

    sequence: int
    dropped: int


class PluginReceiver:
    """Listens on a Unix datagram socket; each poll reads for up to `window_s` and emits rows."""

    name = "plugin"

    def __init__(self, ctx: SourceContext, socket_path: str, *, window_s: float = 0.2,
                 receive_buffer_bytes: int = 4 << 20) -> None:
        self._ctx = ctx
        self.socket_path = socket_path
        self._window_s = window_s
        self._receive_buffer_bytes = receive_buffer_bytes
        self._sock: socket.socket | None = None
        self._leftover: list[Row] = []
        self._lock = threading.Lock()
        self._senders: dict[tuple[str, int, int], _Sender] = {}
        self._models: dict[str, str] = {}
        self._bad_log = RateLimitedLog(log, interval_s=30.0)
        self._drop_events_at: dict[str, float] = {}
        self.counts = {"datagrams": 0, "malformed": 0, "steps": 0, "requests": 0, "lost_datagrams": 0,
                       "plugin_dropped_records": 0}

    def stats(self) -> dict[str, int]:
        return dict(self.counts)

    def start(self) -> None:
        """Bind the socket; a stale socket file from an earlier run is replaced, anything else is refused."""
        path = self.socket_path
        try:
            mode = os.lstat(path).st_mode
        except FileNotFoundError:
            mode = None
        if mode is not None:
            if not stat.S_ISSOCK(mode):
                raise OSError(f"plugin socket path {path} exists and is not a socket")
            if _listening(path):
                raise OSError(f"plugin socket {path} is in use by another collector")
            os.unlink(path)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, self._receive_buffer_bytes)
            os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
            sock.bind(path)
            # Whoever can write the socket can put rows on the timeline: owner and group only.
            os.chmod(path, 0o660)
        except OSError:
            sock.close()
            raise
        self._sock = sock

    def stop(self) -> None:
        """Read what is already queued, then close; the next poll emits it."""
        sock, self._sock = self._sock, None
        if sock is None:
            return
        rows: list[Row] = []
        sock.setblocking(False)
        with contextlib.suppress(BlockingIOError, InterruptedError):
            while True:
                rows.extend(self._rows(sock.recv(wire.MAX_DATAGRAM + 1)))
        sock.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.socket_path)
        with self._lock:
            self._leftover.extend(rows)

    def poll(self, emit: Emit) -> None:
        """Emit rows from the datagrams that arrive within the window (and any left from stop)."""
        with self._lock:
            rows, self._leftover = self._leftover, []
        sock = self._sock
        deadline = time.monotonic() + self._window_s
        while sock is not None and self._sock is sock:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            sock.settimeout(remaining)
            try:
                data = sock.recv(wire.MAX_DATAGRAM + 1)
            except TimeoutError:
                break
            except OSError:
                break  # closed by stop(): what it read is emitted by the next poll
            rows.extend(self._rows(data))
            if len(rows) >= EMIT_BATCH_ROWS:
                emit(rows)
                rows = []
        emit(rows)

    def _rows(self, data: bytes) -> list[Row]:
        self.counts["datagrams"] += 1
        try:
            datagram = wire.decode(data)
        except wire.WireError as exc:
            self.counts["malformed"] += 1
            self._bad_log.warning("malformed", "dropped a malformed plugin datagram: %s", exc)
            return []
        header = datagram.header
        rows: list[Row] = self._account(header)
        host, engine = self._ctx.host, header.engine
        for record in datagram.records:
            if isinstance(record, wire.StepRecord):
                self.counts["steps"] += 1
                rows.append(_step_row(record, host, engine, self._models.get(engine, "")))
            elif isinstance(record, wire.RequestRecord):
                self.counts["requests"] += 1
                rows.append(_request_row(record, host, engine, self._models.get(engine, "")))
            else:
                self._models[engine] = str(record.config.get("model", ""))
                rows.append(_config_event(record.config, host, engine, self._ctx.clock.time()))
        return rows

    def _account(self, header: wire.Header) -> list[Row]:
        """Track each sender's sequence and drop counter; say so on the timeline when data was lost."""
        key = (header.engine, header.pid, header.instance)
        sender = self._senders.get(key)
        self._senders[key] = _Sender(header.sequence, header.dropped)
        if sender is None:
            return []
        lost = max(0, header.sequence - sender.sequence - 1)
        dropped = max(0, header.dropped - sender.dropped)
        self.counts["lost_datagrams"] += lost
        self.counts["plugin_dropped_records"] += dropped
        if not (lost or dropped):
            return []
        now = self._ctx.clock.time()
        if now - self._drop_events_at.get(header.engine, -math.inf) < 60:
            return []  # counted always; put on the timeline at most once a minute per engine
        self._drop_events_at[header.engine] = now
        return [Event(micros(now), self._ctx.host, header.engine, "plugin", "plugin_data_lost", "warning",
                      f"engine {header.engine}: the plugin dropped {dropped} records and {lost} datagrams were lost "
                      "(sidecar absent or too slow)", {"dropped_records": str(dropped), "lost_datagrams": str(lost),
                                                        "pid": str(header.pid)})]


def _listening(path: str) -> bool:
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    try:
        probe.connect(path)
    except OSError:
        return False
    finally:
        probe.close()
    return True


def _step_row(r: wire.StepRecord, host: str, engine: str, model: str) -> Step:
    return Step(micros(r.ts), host, engine, r.engine_index, model, r.iteration, r.elapsed_ms, r.num_ctx_requests,
                r.num_ctx_tokens, r.num_generation_requests, r.num_generation_tokens, r.running, r.waiting,
                r.skipped_waiting, r.kv_cache_usage, r.prefix_cache_queries, r.prefix_cache_hits, r.preempted,
                r.spec_num_drafts, r.spec_num_draft_tokens, r.spec_num_accepted_tokens, list(r.ttft_seconds),
                list(r.itl_seconds), r.is_dummy)


def _request_row(r: wire.RequestRecord, host: str, engine: str, model: str) -> Request:
    # vLLM gives no per-request TTFT here; e2e less decode is arrival to first token, as its histogram measures.
    ttft = r.e2e_seconds - r.decode_seconds
    return Request(micros(r.ts), host, engine, r.engine_index, model, r.request_id, "plugin", r.finish_reason,
                   micros(r.ts - r.e2e_seconds) if math.isfinite(r.e2e_seconds) else micros(r.ts),
                   r.queued_seconds, r.prefill_seconds, r.decode_seconds, r.inference_seconds, r.e2e_seconds, ttft,
                   r.mean_tpot_seconds, r.prompt_tokens, r.cached_tokens, r.generation_tokens, r.max_tokens,
                   r.preemptions)


def _config_event(config: dict[str, object], host: str, engine: str, now: float) -> Event:
    shown = ", ".join(f"{k}={config[k]}" for k in ("model", "max_num_batched_tokens", "max_num_seqs",
                                                    "long_prefill_token_threshold", "enable_chunked_prefill")
                      if k in config)
    return Event(micros(now), host, engine, "plugin", "engine_config", "info", f"engine {engine} configured: {shown}",
                 {str(k): str(v) for k, v in config.items()})
