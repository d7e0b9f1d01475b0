"""Source: the stat-logger plugin's datagrams, one `steps` row per iteration, one `requests` row per request.

With a token (STEPLINE_PLUGIN_TOKEN), only datagrams carrying its credential are read; the rest are counted
(`unauthorized`) and logged at most once a minute, never with the token. Data an engine's plugin dropped, or
datagrams lost on the way, go on the timeline as `plugin_data_lost` events: at once, then at most once a
minute per engine with the counts of the minute in between, and whatever is still untold when the receiver
stops; what a plugin dropped before this receiver first heard from it is told at that first datagram.

What it keeps per sender and per engine is bounded (MAX_SENDERS): past it the one heard from least recently is
forgotten and counted (`evicted_senders`); a forgotten sender heard from again is met as after a restart, and counted
(`resumed_senders`).
"""

from __future__ import annotations

import contextlib
import hmac
import logging
import math
import os
import select
import socket
import stat
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass

from stepline.core.ratelimit import RateLimitedLog
from stepline.model.rows import UNKNOWN_FINISH_REASON, Event, Request, Row, Step, micros
from stepline.plugin import wire
from stepline.plugin.config import model_name
from stepline.sources.base import Emit, SourceContext
from stepline.sources.step_time import ELAPSED, StepTimes

log = logging.getLogger(__name__)

EMIT_BATCH_ROWS = 5_000
LOSS_EVENT_INTERVAL_S = 60.0  # per engine, at most one plugin_data_lost event in this long
# Senders (engine, pid, plugin instance) and engines remembered at once. A host runs a handful of vLLM API-server
# processes per engine, each one sender: a few thousand is generous, and it caps what datagrams with made-up senders
# can make the receiver keep (200k of them grew it by 80 MB).
MAX_SENDERS = 4_096

_STEP, _REQUEST, _HAS_DETAILS, _DUMMY = wire.STEP_RECORD, wire.REQUEST_RECORD, wire.STEP_HAS_DETAILS, wire.STEP_DUMMY
_BATCH_QUEUE = wire.STEP_BATCH_QUEUE
_REASONS = (UNKNOWN_FINISH_REASON, *wire.FINISH_REASONS[1:])  # code 0: a reason the plugin did not know
_U32 = wire.U32
_new_step = Step._make
_new_request = Request._make


@dataclass(slots=True)
class _Sender:
    """What the receiver knows of one plugin instance (one vLLM process)."""

    sequence: int
    dropped: int


@dataclass
class _Untold:
    """Loss counted for an engine and not yet on the timeline."""

    dropped: int = 0
    lost: int = 0
    pid: int = 0


class PluginReceiver:
    """Listens on a Unix datagram socket; each poll reads for up to `window_s` and emits rows."""

    name = "plugin"

    def __init__(self, ctx: SourceContext, socket_path: str, *, token: str | None = None, window_s: float = 0.2,
                 receive_buffer_bytes: int = 4 << 20) -> None:
        self._ctx = ctx
        self.socket_path = socket_path
        # Only the credential is kept: the token itself stays out of this object, its repr and its logs.
        self._credential = wire.credential_for(token) if token else None
        self._window_s = window_s
        self._receive_buffer_bytes = receive_buffer_bytes
        self._sock: socket.socket | None = None
        self._leftover: list[Row] = []
        self._lock = threading.Lock()
        # Least recently heard first: the one to forget when full.
        self._senders: OrderedDict[tuple[str, int, int], _Sender] = OrderedDict()
        self._models = ctx.engine_models  # shared with the OTLP receiver, which names its requests from it
        self._bad_log = RateLimitedLog(log, interval_s=30.0)
        self._auth_log = RateLimitedLog(log, interval_s=60.0)
        self._told_at: OrderedDict[str, float] = OrderedDict()
        self._untold: dict[str, _Untold] = {}
        self._step_times = StepTimes(MAX_SENDERS)
        self.counts = {"datagrams": 0, "malformed": 0, "unauthorized": 0, "steps": 0, "requests": 0,
                       "lost_datagrams": 0, "plugin_dropped_records": 0, "evicted_senders": 0, "resumed_senders": 0}

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
            sock.setblocking(False)
        except OSError:
            sock.close()
            raise
        self._sock = sock

    def stop(self) -> None:
        """Refuse new datagrams, read what is already queued, then close; the next poll emits it."""
        sock, self._sock = self._sock, None
        if sock is None:
            return
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.socket_path)
        # From here a plugin's send fails at once (EPIPE): it counts those records as dropped itself, instead of
        # handing them to a queue that close() would discard without anyone counting them.
        with contextlib.suppress(OSError):
            sock.shutdown(socket.SHUT_RD)
        rows: list[Row] = []
        sock.setblocking(False)
        with contextlib.suppress(BlockingIOError, InterruptedError):
            while data := sock.recv(wire.MAX_DATAGRAM + 1):  # after SHUT_RD, b"" is the end of the queue
                rows.extend(self.rows(data))
        sock.close()
        now = self._ctx.clock.time()
        for engine in list(self._untold):
            rows.extend(self._tell(engine, now))
        with self._lock:
            self._leftover.extend(rows)

    def poll(self, emit: Emit) -> None:
        """Emit rows from the datagrams that arrive within the window (and any left from stop)."""
        with self._lock:
            rows, self._leftover = self._leftover, []
        sock = self._sock
        if sock is None:
            emit(rows)
            return
        # The socket is non-blocking: a queued datagram costs one recv; only an empty queue waits, in poll(2).
        waiter = select.poll()
        waiter.register(sock, select.POLLIN)
        recv, size, monotonic = sock.recv, wire.MAX_DATAGRAM + 1, time.monotonic
        deadline = monotonic() + self._window_s
        while self._sock is sock:
            try:
                data = recv(size)
            except BlockingIOError:
                remaining = deadline - monotonic()
                if remaining <= 0 or not waiter.poll(remaining * 1000):
                    break
                continue
            except OSError:
                break  # closed by stop(): what it read is emitted by the next poll
            if not data:
                if self._sock is not sock:
                    break  # shut down by stop()
                self.counts["datagrams"] += 1
                self.counts["malformed"] += 1  # an empty datagram: no header, nothing to decode
                continue
            rows.extend(self.rows(data))
            if len(rows) >= EMIT_BATCH_ROWS:
                emit(rows)
                rows = []
            if monotonic() >= deadline:
                break
        emit(rows)

    def rows(self, data: bytes) -> list[Row]:
        """The rows of one datagram, as a poll emits them; a malformed or unauthorized one is counted and gives none."""
        counts = self.counts
        counts["datagrams"] += 1
        try:
            header, offset = wire.decode_header(data)
            if self._credential is not None and not hmac.compare_digest(header.credential, self._credential):
                self._unauthorized(header)
                return []
            rows, steps, requests = self._records(data, offset, header.engine)
        except wire.WireError as exc:
            counts["malformed"] += 1
            self._bad_log.warning("malformed", "dropped a malformed plugin datagram: %s", exc)
            return []
        counts["steps"] += steps
        counts["requests"] += requests
        rows.extend(self._account(header))
        return rows

    def _records(self, data: bytes, offset: int, engine: str) -> tuple[list[Row], int, int]:
        """Rows built straight from the wire's fields (the collector's hot path); and how many steps and requests."""
        host = self._ctx.host
        model = self._models.model_of(engine)
        rows: list[Row] = []
        append = rows.append
        steps = requests = 0
        nan = math.nan
        for kind, f, first, second in wire.iter_records(data, offset):
            if kind == _STEP:
                # `waiting`: the wire carries vLLM's num_waiting_reqs, which leaves out the deferred waiters it counts
                # in num_skipped_waiting_reqs (vLLM 0.33 vllm/v1/core/sched/scheduler.py:3287-3292); the column holds
                # both, as vllm:num_requests_waiting does (vllm/v1/metrics/loggers.py:1150-1154); a UInt32 column,
                # whatever two counts a datagram claims.
                # elapsed_ms is the step's duration: vLLM's reading, or where the engine core steps through its
                # batch queue and that reading is a wait, the cadence of its step ends (sources/step_time.py).
                # The row is built in Step's column order from the wire's fields by name (wire.StepFields): keyword
                # arguments would cost 1.3 us a row on the collector's hot path.
                flags, ts = f.flags, round(f.ts * 1_000_000)
                if not flags & _HAS_DETAILS:
                    vllm_ms = elapsed = nan
                    how = ""
                elif flags & _BATCH_QUEUE:
                    vllm_ms = f.elapsed_ms
                    elapsed, how = self._step_times.duration(engine, f.engine_index, f.iteration, ts, vllm_ms,
                                                             f.running)
                else:
                    vllm_ms = elapsed = f.elapsed_ms
                    how = ELAPSED
                append(_new_step((ts, host, engine, f.engine_index, model, f.iteration, elapsed, f.num_ctx_requests,
                                  f.num_ctx_tokens, f.num_generation_requests, f.num_generation_tokens, f.running,
                                  min(f.waiting + f.skipped_waiting, _U32), f.skipped_waiting, f.kv_cache_usage,
                                  f.prefix_cache_queries, f.prefix_cache_hits, f.preempted, f.spec_num_drafts,
                                  f.spec_num_draft_tokens, f.spec_num_accepted_tokens, first, second,
                                  bool(flags & _DUMMY), vllm_ms, how)))
                steps += 1
            elif kind == _REQUEST:
                ts, e2e, decode = f.ts, f.e2e_seconds, f.decode_seconds
                # vLLM gives no per-request TTFT here; e2e less decode is arrival to first token, as its
                # histogram measures. An e2e that is not a duration within the epoch leaves arrival at ts.
                arrival = round((ts - e2e if 0 <= e2e <= ts else ts) * 1_000_000)
                append(_new_request((round(ts * 1_000_000), host, engine, f.engine_index, model, first, "plugin",
                                     _REASONS[f.finish_code], arrival, f.queued_seconds, f.prefill_seconds, decode,
                                     f.inference_seconds, e2e, e2e - decode, f.mean_tpot_seconds, f.prompt_tokens,
                                     f.cached_tokens, f.generation_tokens, f.max_tokens, f.preemptions)))
                requests += 1
            else:
                model = model_name(first)  # the served name, as /metrics labels it; the path stays in the event
                self._models.announce(engine, model)
                append(_config_event(first, host, engine, self._ctx.clock.time()))
        return rows, steps, requests

    def _unauthorized(self, header: wire.Header) -> None:
        self.counts["unauthorized"] += 1
        why = ("carries no credential (its plugin has no STEPLINE_PLUGIN_TOKEN, or predates the token)"
               if not header.credential else "carries the credential of another token")
        self._auth_log.warning("unauthorized", "rejected a plugin datagram from engine %r (pid %d): it %s; give the "
                               "engine the collector's STEPLINE_PLUGIN_TOKEN (or _FILE)", header.engine[:64],
                               header.pid, why)

    def _account(self, header: wire.Header) -> list[Row]:
        """Track each sender's sequence and drop counter; say so on the timeline when data was lost."""
        key = (header.engine, header.pid, header.instance)
        senders = self._senders
        sender = senders.get(key)
        if sender is None:
            # At the first datagram of a plugin instance, what it dropped so far (while no sidecar listened) is news.
            lost, dropped = 0, header.dropped
            self._meet(header)
            senders[key] = _Sender(header.sequence, header.dropped)
        else:
            senders.move_to_end(key)
            lost = max(0, header.sequence - sender.sequence - 1)
            dropped = max(0, header.dropped - sender.dropped)
            sender.sequence, sender.dropped = header.sequence, header.dropped
        engine = header.engine
        told: list[Row] = []
        if lost or dropped:
            self.counts["lost_datagrams"] += lost
            self.counts["plugin_dropped_records"] += dropped
            untold = self._untold.get(engine)
            if untold is None:
                if len(self._untold) >= MAX_SENDERS:
                    # Told early rather than forgotten: what was counted still reaches the timeline.
                    told = self._tell(next(iter(self._untold)), self._ctx.clock.time())
                untold = self._untold[engine] = _Untold()
            untold.dropped += dropped
            untold.lost += lost
            untold.pid = header.pid
        elif engine not in self._untold:
            return []
        now = self._ctx.clock.time()
        if now - self._told_at.get(engine, -math.inf) < LOSS_EVENT_INTERVAL_S:
            return told  # counted already; on the timeline with the next event for this engine
        return told + self._tell(engine, now)

    def _meet(self, header: wire.Header) -> None:
        """Make room for a sender not in the table, forgetting the one heard from least recently."""
        counts = self.counts
        if header.sequence and counts["evicted_senders"]:
            # Past its first datagram and maybe one forgotten below: met as after a collector restart, its gap since
            # then unseen and its drops told from its start again. Counted, so that this is never silent.
            counts["resumed_senders"] += 1
            self._bad_log.warning("resumed", "met plugin sender engine %r (pid %d) at sequence %d after senders were "
                                  "forgotten: if it was one of them, datagrams it lost meanwhile are not counted",
                                  header.engine[:64], header.pid, header.sequence)
        if len(self._senders) >= MAX_SENDERS:
            self._senders.popitem(last=False)
            counts["evicted_senders"] += 1
            self._bad_log.warning("evicted", "forgot the plugin sender heard from least recently: more than %d "
                                  "senders (engine, pid, instance) at once; are datagrams forged?", MAX_SENDERS)

    def _tell(self, engine: str, now: float) -> list[Row]:
        untold = self._untold.pop(engine)
        told_at = self._told_at
        told_at[engine] = now
        told_at.move_to_end(engine)
        if len(told_at) > MAX_SENDERS:
            told_at.popitem(last=False)  # that engine's next event may come sooner than a minute, no more
        return [Event(micros(now), self._ctx.host, engine, "plugin", "plugin_data_lost", "warning",
                      f"engine {engine}: the plugin dropped {untold.dropped} records and {untold.lost} datagrams were "
                      "lost (sidecar absent or too slow)",
                      {"dropped_records": str(untold.dropped), "lost_datagrams": str(untold.lost),
                       "pid": str(untold.pid)})]


def _listening(path: str) -> bool:
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    try:
        probe.connect(path)
    except OSError:
        return False
    finally:
        probe.close()
    return True


def _config_event(config: dict[str, object], host: str, engine: str, now: float) -> Event:
    shown = ", ".join(f"{k}={config[k]}" for k in ("served_model_name", "model", "max_num_batched_tokens",
                                                    "max_num_seqs", "long_prefill_token_threshold",
                                                    "enable_chunked_prefill") if k in config)
    return Event(micros(now), host, engine, "plugin", "engine_config", "info", f"engine {engine} configured: {shown}",
                 {str(k): str(v) for k, v in config.items()})
