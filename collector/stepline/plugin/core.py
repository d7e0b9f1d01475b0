"""The plugin's vLLM-free core: vLLM's stats in, datagrams to the sidecar out, never blocking, never raising.

Transport: a Unix datagram socket, non-blocking. Chosen over UDP on loopback because every failure
is visible to the sender: no listener is an immediate error, a full receive queue is EAGAIN. UDP
would drop silently in both cases, and a plugin that cannot count its drops hides the very stalls
stepline exists to show. `record()` encodes and appends to the open batch; batches of up to 60 KB are
sealed every `flush_interval_s` (at once when the engine goes idle: 0 running, 0 waiting, 0 deferred) and
sent by the outbox's own thread (outbox.py), which waits for the socket when the sidecar's short queue
(net.unix.max_dgram_qlen) is full, so a backlog drains whether or not vLLM still calls.

Steps. With `--enable-logging-iteration-details` every engine iteration carries its details (its index,
batch and time); a row in `steps` is one of those. vLLM also hands its loggers scheduler stats without
details (a 0-token step, e.g. while idle): those are not iterations, so they make no step row; their
prefix-cache, preemption and spec-decode counts (deltas vLLM would otherwise add to its counters) are
added to the engine's next step, so the steps' sums still match vLLM's counters; their queue and KV
gauges are left to /metrics. Without iteration details (the engine's setting, or none seen yet when
the setting is not known), every set of scheduler stats is one step, numbered by the plugin.

Several API servers (--api-server-count N): each front-end runs its own plugin (its own sender to the sidecar), the
engine core hands each step's scheduler stats to one of them, and each front-end's iteration stats cover its own
requests. So every step and request arrives once, from one sender; a front-end's latency samples and preemptions
that came without the step's stats go to its own next step.

With a token (STEPLINE_PLUGIN_TOKEN, the collector's too), every datagram carries the credential derived
from it (see wire.py); the credential is computed once here, so `record()` costs the same with or without.
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Callable
from typing import Any

from stepline.plugin import wire
from stepline.plugin.outbox import Outbox

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


class _Carried:
    """Counts not yet on a step (scheduler stats without details, or iteration stats without scheduler stats), waiting
    for the engine's next step from this plugin."""

    __slots__ = ("accepted", "draft_tokens", "drafts", "generation_tokens", "hits", "itl", "preempted", "queries",
                 "ttft")

    def __init__(self) -> None:
        self.queries = self.hits = self.preempted = self.drafts = self.draft_tokens = self.accepted = 0
        self.generation_tokens = 0  # used by steps without iteration details, whose work is this count
        self.ttft: list[float] = []
        self.itl: list[float] = []


class PluginCore:
    """Turns each `record()` call into compact records and hands them to the outbox, which ships them."""

    def __init__(
        self,
        engine: str,
        socket_path: str = DEFAULT_SOCKET,
        *,
        max_buffer_bytes: int = 8 << 20,
        flush_interval_s: float = 0.05,
        reconnect_interval_s: float = 5.0,
        log_interval_s: float = 60.0,
        exit_timeout_s: float = 1.0,
        token: str | None = None,
        iteration_details: bool | None = None,
        batch_queue: bool = False,
        monotonic: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
    ) -> None:
        """`iteration_details`: whether the engine logs them (vLLM's enable_logging_iteration_details); None
        when not known, in which case stats without details count as steps until a step with details is seen.
        `batch_queue`: the engine core steps through its batch queue (async scheduling, pipeline parallelism;
        plugin.config.batch_queue): each step says so, for its elapsed_ms is then a wait, not the step's time."""
        self.engine = engine
        self.socket_path = socket_path
        engine_bytes = engine.encode("utf-8", errors="replace")[: wire.MAX_ENGINE_NAME]
        credential = wire.credential_for(token) if token else b""  # the token itself is not kept
        self._outbox = Outbox(socket_path, engine_bytes, credential, max_buffer_bytes=max_buffer_bytes,
                              flush_interval_s=flush_interval_s, reconnect_interval_s=reconnect_interval_s,
                              log_interval_s=log_interval_s, exit_timeout_s=exit_timeout_s, monotonic=monotonic)
        self._wall = wall
        self._details = iteration_details
        self._step_flags = wire.STEP_HAS_DETAILS | (wire.STEP_BATCH_QUEUE if batch_queue else 0)
        self._iteration: dict[int, int] = {}
        self._carried: dict[int, _Carried] = {}
        self._reason_codes: dict[Any, int] = {}
        self.internal_errors = 0
        self.stats_without_details = 0  # scheduler stats that were not a step (their counts went to the next one)

    # Counters: cumulative, for tests, the benchmarks and the simulator; drops are also logged, rate-limited.
    @property
    def records_sent(self) -> int:
        return self._outbox.records_sent

    @property
    def datagrams_sent(self) -> int:
        return self._outbox.datagrams_sent

    @property
    def dropped(self) -> dict[str, int]:
        return self._outbox.dropped

    @property
    def dropped_total(self) -> int:
        return self._outbox.dropped_total

    @property
    def records_held(self) -> int:
        """Records encoded but neither sent nor dropped yet: the open batch and batches waiting for the socket."""
        return self._outbox.records_held

    def accounting(self) -> tuple[int, dict[str, int], int]:
        """(sent, dropped by reason, held), read together, so that they add up to every record made."""
        return self._outbox.accounting()

    # -- what vLLM calls ---------------------------------------------------------------------------

    def record(self, scheduler_stats: Any, iteration_stats: Any, engine_idx: int = 0) -> None:
        """Encode one engine-core output batch; never raises, never blocks."""
        try:
            ts = getattr(iteration_stats, "iteration_timestamp", None) or self._wall()
            records: list[bytes] = []
            idle = False
            if scheduler_stats is not None:
                step = self._step(ts, scheduler_stats, iteration_stats, engine_idx)
                if step is not None:
                    records.append(step)
                # The engine just went idle: what it did last goes out now, not a flush interval later. Deferred
                # waiters are not in num_waiting_reqs (vLLM 0.33 vllm/v1/core/sched/scheduler.py:3287-3292,
                # Scheduler.make_stats: num_waiting_reqs = num_waiting - num_deferred, num_skipped_waiting_reqs =
                # num_deferred); an engine holding them is not idle.
                idle = (scheduler_stats.num_running_reqs == 0 and scheduler_stats.num_waiting_reqs == 0
                        and not getattr(scheduler_stats, "num_skipped_waiting_reqs", 0))
            elif iteration_stats is not None:
                # Several API servers (--api-server-count N): the engine core returns each step's scheduler stats to
                # only one front-end (vLLM 0.33 vllm/v1/core/sched/scheduler.py:2669-2674), but every front-end makes
                # IterationStats from its own requests' outputs and records them, with scheduler_stats None when the
                # stats went elsewhere (vllm/v1/engine/async_llm.py:883-885, 924-935). Each front-end loads its own
                # plugin (async_llm.py:155-156, 204-212); iteration indexes are the engine core's, shared by all.
                # This front-end's TTFT/ITL samples and preemptions go to its own next step, not lost.
                self._carry(engine_idx, None, None, iteration_stats)
            if iteration_stats is not None:
                for finished in iteration_stats.finished_requests:
                    records.append(self._request(ts, finished, engine_idx))
            self._outbox.put(records, idle)
        except Exception:  # vLLM's serving path must never see our failure; it is counted and logged
            self.internal_errors += 1
            self._outbox.drop("plugin_error", 1)
            if self.internal_errors == 1:
                log.exception("stepline plugin: could not encode a step (counted; later failures are counted only)")

    def engine_initialized(self, config: dict[str, Any]) -> None:
        """Send the engine's configuration once, ahead of its steps; start the sender off the hot path."""
        try:
            self._outbox.put((wire.encode_config(config),))
            self._outbox.flush()
            self._outbox.start()
        except Exception:
            self.internal_errors += 1
            log.exception("stepline plugin: could not send the engine configuration")

    def flush(self) -> None:
        """vLLM's periodic `log()`: seal what is pending, send what the socket takes now, report drops."""
        try:
            self._outbox.flush()
        except Exception:
            self.internal_errors += 1
            if self.internal_errors == 1:
                log.exception("stepline plugin: flush failed (counted; later failures are counted only)")

    def close(self, drain_timeout_s: float = 2.0) -> None:
        """Send what is buffered, waiting up to drain_timeout_s for a busy sidecar; then count and log the rest."""
        self._outbox.close(drain_timeout_s)

    # -- reading vLLM's stats --------------------------------------------------------------------------
    # The hot path: attributes go straight into one struct.pack; wire.pack_record cleans odd values only
    # when that pack fails, so well-formed stats cost no per-field Python work.

    def _step(self, ts: float, s: Any, it: Any, engine_idx: int) -> bytes | None:
        details = s.iteration_details
        prefix = s.prefix_cache_stats
        spec = getattr(s, "spec_decoding_stats", None)
        if details is not None:
            iteration = details.iteration_index
            self._iteration[engine_idx] = iteration
            self._details = True
            flags = (wire.STEP_DUMMY if details.is_dummy else 0) | self._step_flags
            # num_generation_tokens here is scheduled, drafts included; readers derive the tokens generated from it
            # and the step's spec-decode counts (stepline.queries.steps.GENERATED).
            work = (details.elapsed_ms, details.num_ctx_requests, details.num_ctx_tokens,
                    details.num_generation_requests, details.num_generation_tokens)
        elif self._details:
            self.stats_without_details += 1
            self._carry(engine_idx, prefix, spec, it)
            return None
        else:
            # One count per plugin instance: with several API servers, each front-end's plugin numbers the steps
            # it is handed, so two senders of one engine may both send a step 7 (rows stay apart: ts differs).
            iteration = self._iteration.get(engine_idx, -1) + 1
            self._iteration[engine_idx] = iteration
            flags = 0
            carried_tokens = self._carried[engine_idx].generation_tokens if engine_idx in self._carried else 0
            work = (math.nan, 0, 0, 0, _count(getattr(it, "num_generation_tokens", 0)) + carried_tokens)
        if it is not None:
            ttft, itl, preempted = it.time_to_first_tokens_iter, it.inter_token_latencies_iter, it.num_preempted_reqs
        else:
            ttft, itl, preempted = (), (), 0
        queries = prefix.queries if prefix is not None else 0
        hits = prefix.hits if prefix is not None else 0
        drafts = spec.num_drafts if spec is not None else 0
        draft_tokens = spec.num_draft_tokens if spec is not None else 0
        accepted = spec.num_accepted_tokens if spec is not None else 0
        if self._carried:
            carried = self._carried.pop(engine_idx, None)
            if carried is not None:
                queries, hits, preempted = queries + carried.queries, hits + carried.hits, preempted + carried.preempted
                drafts, draft_tokens = drafts + carried.drafts, draft_tokens + carried.draft_tokens
                accepted += carried.accepted
                ttft, itl = [*carried.ttft, *(ttft or ())], [*carried.itl, *(itl or ())]
        n_ttft, n_itl, samples = wire.pack_samples(ttft, itl)
        return wire.pack_record(wire.STEP_RECORD, wire.STEP, (
            ts, iteration, engine_idx, *work, s.num_running_reqs, s.num_waiting_reqs,
            getattr(s, "num_skipped_waiting_reqs", 0), s.kv_cache_usage,
            # Preempted requests re-query the cache; vLLM's own counters keep them apart, and so do we.
            queries, hits, preempted, drafts, draft_tokens, accepted, flags, n_ttft, n_itl,
        ), samples)

    def _carry(self, engine_idx: int, prefix: Any, spec: Any, it: Any) -> None:
        """Keep the counts of stats that are not a step (scheduler stats without details, or another front-end's
        iteration stats) for the engine's next step from this plugin."""
        carried = self._carried.get(engine_idx)
        if carried is None:
            carried = self._carried[engine_idx] = _Carried()
        if prefix is not None:
            carried.queries += _count(prefix.queries)
            carried.hits += _count(prefix.hits)
        if spec is not None:
            carried.drafts += _count(spec.num_drafts)
            carried.draft_tokens += _count(spec.num_draft_tokens)
            carried.accepted += _count(spec.num_accepted_tokens)
        if it is not None:
            carried.preempted += _count(it.num_preempted_reqs)
            carried.generation_tokens += _count(getattr(it, "num_generation_tokens", 0))
            # Bounded by the wire's own sample caps, however long the engine goes without a step.
            carried.ttft.extend(list(it.time_to_first_tokens_iter or ())[: wire.MAX_TTFT_SAMPLES - len(carried.ttft)])
            carried.itl.extend(list(it.inter_token_latencies_iter or ())[: wire.MAX_ITL_SAMPLES - len(carried.itl)])

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


def _count(value: Any) -> int:
    """A count from vLLM's stats as a non-negative int (odd values count as 0, as the wire would clean them)."""
    try:
        number = int(value or 0)
    except (TypeError, ValueError, OverflowError):
        return 0
    return max(0, number)
