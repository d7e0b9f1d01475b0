"""The simulation driver: arrivals in, steps run in simulated time, records and /metrics out."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from stepline.core.clock import Clock, SystemClock
from stepline.sim.config import EngineConfig
from stepline.sim.metrics import VllmMetrics
from stepline.sim.records import FinishedRequest, StepRecord, StepWork
from stepline.sim.scheduler import Batch, Request, Scheduler
from stepline.sim.workloads import Arrival, Workload

StepCallback = Callable[[StepRecord], None]
# Asked, as each workload arrival reaches the engine (arrival, simulated second), whether it is let in: a gateway in
# front of the engine that may refuse it (sim/gateway.py). None: every arrival reaches the engine.
Admit = Callable[[Arrival, float], bool]


@dataclass(frozen=True, slots=True)
class Token:
    """One token sampled for a submitted request: its 1-based index, wall time, and whether it was the last."""

    request_id: str
    index: int
    ts: float
    finished: bool


TokenCallback = Callable[[Token], None]


class Simulation:
    """One simulated engine serving `workload`; time is seconds since the simulation started.

    A step's outputs exist only once it has ended: `advance_to(t)` runs the steps that end by `t`
    and leaves one that ends later in flight, as a real engine would be mid-step at time t.
    """

    def __init__(
        self,
        workload: Workload,
        config: EngineConfig | None = None,
        clock: Clock | None = None,
        *,
        on_step: StepCallback | None = None,
        repeat: bool = False,
        step_noise: Callable[[float], float] | None = None,
        admit: Admit | None = None,
    ) -> None:
        """`step_noise` maps the cost model's seconds for a step to the seconds it takes (a replay of a real
        engine draws its recorded jitter there); None: exactly the model's. `admit` lets a gateway in front refuse
        arrivals (counted in `refused`)."""
        self.workload = workload
        self.config = config or EngineConfig()
        # Wall-clock time of simulated second 0; records are stamped start_ts + simulated seconds.
        self.start_ts = (clock or SystemClock()).time()
        self.now = 0.0
        self.iteration_index = 0
        self.rejected = 0  # arrivals whose KV could never fit: a real server refuses them at the API
        self.refused = 0  # arrivals a gateway in front (`admit`) never let through
        self._admit = admit
        self.metrics = VllmMetrics(self.config)
        self._scheduler = Scheduler(self.config)
        self._cost = self.config.cost
        self._step_noise = step_noise
        self._on_step = on_step
        self._repeat = repeat and bool(workload.arrivals)
        self._cursor = 0
        self._cycle = 0
        self._cycle_base = 0.0
        self._inflight: tuple[Batch, float] | None = None
        # Async scheduling: the start of the step that just ended, when the next one was scheduled (None: at once).
        self._scheduled_at: float | None = None
        self._listeners: dict[str, TokenCallback] = {}

    @property
    def scheduler(self) -> Scheduler:
        """The scheduler, for inspection."""
        return self._scheduler

    def is_done(self) -> bool:
        """True when every arrival has come and every request has finished."""
        return (
            not self._repeat
            and self._cursor >= len(self.workload.arrivals)
            and self._inflight is None
            and not self._scheduler.has_work()
        )

    @property
    def has_listeners(self) -> bool:
        """True while a submitted request still waits for tokens."""
        return bool(self._listeners)

    def next_step_end(self) -> float | None:
        """Simulated second the step in flight ends, or None when none is."""
        return self._inflight[1] if self._inflight is not None else None

    def submit(
        self,
        request_id: str,
        prompt_tokens: int,
        max_tokens: int,
        on_token: TokenCallback,
        *,
        cached_tokens: int = 0,
        at: float | None = None,
    ) -> None:
        """Queue a request arriving at simulated second `at` (default: now) beside the workload's.

        `on_token` is called, from whoever advances the simulation, once per sampled token as its step
        ends. Raises ValueError when the request can never fit the KV cache, as vLLM refuses it.
        """
        if request_id in self._listeners:
            raise ValueError(f"request {request_id} is already running")
        if not self._scheduler.fits(prompt_tokens, max_tokens):
            raise ValueError(
                f"this request needs {prompt_tokens + max_tokens} tokens of KV cache "
                f"(prompt {prompt_tokens} + max_tokens {max_tokens}); the engine holds "
                f"{self.config.kv_capacity_tokens}"
            )
        arrival = self.now if at is None else at
        if self._inflight is None:
            self.now = max(self.now, arrival)  # an idle engine starts the next step when the request arrives
        cached_fraction = min(1.0, max(0, cached_tokens) / prompt_tokens)
        self._scheduler.add(Request(request_id, arrival, prompt_tokens, max_tokens, cached_fraction, "length"))
        self._listeners[request_id] = on_token

    def forget(self, request_id: str) -> None:
        """Stop reporting tokens of a submitted request (its client went away); it still runs to the end."""
        self._listeners.pop(request_id, None)

    def render_metrics(self) -> bytes:
        """The engine's /metrics exposition: counters as of its last completed step, queue gauges as of now."""
        # vLLM's engine loop publishes scheduler stats even when it can schedule nothing, so a stalled
        # engine's /metrics still shows its queue; the simulator's steps alone would freeze them.
        scheduler = self._scheduler
        self.metrics.observe_queue(len(scheduler.running), len(scheduler.waiting), scheduler.kv_cache_usage)
        return self.metrics.render()

    def advance_to(self, t: float) -> None:
        """Run every step that ends by simulated second `t`."""
        scheduler = self._scheduler
        while True:
            if self._inflight is not None:
                batch, end = self._inflight
                if end > t:
                    return
                self.now = end
                self._inflight = None
                self._finish_step(batch, end)
                continue
            # Async scheduling: the step after the one that just ended was scheduled when that one began, from the
            # requests the engine core had then; an idle engine schedules at once.
            intake, self._scheduled_at = (self._scheduled_at if self._scheduled_at is not None else self.now), None
            self._take_arrivals(intake)
            if scheduler.has_work():
                batch = scheduler.schedule(self.now)
                if not batch.is_empty:
                    # Draft tokens are verified like prompt tokens: a forward pass over each, beside the decodes.
                    cost = self._cost.step_seconds(
                        batch.prefill_tokens + batch.draft_tokens,
                        batch.prefill_pairs,
                        len(batch.decodes),
                        batch.decode_context_tokens,
                    )
                    if self._step_noise is not None:
                        cost = self._step_noise(cost)
                    self._inflight = (batch, self.now + cost)
                    continue
                if batch.num_preempted:
                    continue  # the only runner preempted itself; it is first in line for the next try
            upcoming = self._next_arrival()
            if upcoming is None or upcoming > t:
                self.now = max(self.now, t)
                return
            self.now = max(self.now, upcoming)

    def _next_arrival(self) -> float | None:
        arrivals = self.workload.arrivals
        if self._cursor < len(arrivals):
            return self._cycle_base + arrivals[self._cursor].offset_s
        if self._repeat:
            return self._cycle_base + self.workload.duration_s + arrivals[0].offset_s
        return None

    def _take_arrivals(self, now: float) -> None:
        arrivals = self.workload.arrivals
        while True:
            if self._cursor >= len(arrivals):
                if not self._repeat:
                    return
                self._cursor = 0
                self._cycle += 1
                self._cycle_base += self.workload.duration_s
            arrival = arrivals[self._cursor]
            offset = self._cycle_base + arrival.offset_s
            if offset > now:
                return
            self._cursor += 1
            if not self._scheduler.fits(arrival.prompt_tokens, arrival.output_tokens):
                self.rejected += 1
                continue
            if self._admit is not None and not self._admit(arrival, offset):
                self.refused += 1
                continue
            suffix = f"-{self._cycle}" if self._cycle else ""
            self._scheduler.add(
                Request(
                    arrival.request_id + suffix,
                    offset,
                    arrival.prompt_tokens,
                    arrival.output_tokens,
                    arrival.cached_fraction,
                    arrival.finish_reason,
                    arrival.max_tokens,
                    priority=arrival.priority,
                )
            )

    def _finish_step(self, batch: Batch, end: float) -> None:
        scheduler = self._scheduler
        drafts = sum(1 for r in batch.decodes if r.drafted)
        work = _work(batch)  # before `complete`, which moves the requests' counters on
        outcome = scheduler.complete(batch, end)
        wait_ms = None
        if self.config.async_scheduling:
            # vLLM's engine core takes new requests in after the step it waited for; the next step was scheduled
            # before them (as this one began), so they wait one step more than with synchronous scheduling.
            self._scheduled_at = batch.start
            wait_ms = max(0.0, end - batch.start - self.config.host_overhead_s) * 1e3
        else:
            # Requests that arrived during the step are in the queue when the stats are taken.
            self._take_arrivals(end)
        finished = tuple(self._finished_record(r, end) for r in outcome.finished)
        record = StepRecord(
            ts=self.start_ts + end,
            iteration_index=self.iteration_index,
            elapsed_ms=(end - batch.start) * 1e3,
            num_ctx_requests=len(batch.prefills),
            num_ctx_tokens=batch.prefill_tokens,
            num_generation_requests=len(batch.decodes),
            # Scheduled, as vLLM 0.33 counts them: 1 + its drafts per decoding request, accepted or not
            # (vllm/v1/utils.py:854-862 sums num_scheduled_tokens; vllm/v1/core/sched/scheduler.py:839-843).
            num_generation_tokens=len(batch.decodes) + batch.draft_tokens,
            num_running_reqs=len(scheduler.running),
            num_waiting_reqs=len(scheduler.waiting),
            kv_cache_usage=scheduler.kv_cache_usage,
            prefix_cache_requests=batch.prefix_cache_requests,
            prefix_cache_queries=batch.prefix_cache_queries,
            prefix_cache_hits=batch.prefix_cache_hits,
            num_preempted_reqs=batch.num_preempted,
            num_prompt_tokens=outcome.prompt_tokens,
            num_prompt_tokens_computed=outcome.prompt_tokens - outcome.prompt_tokens_cached,
            num_prompt_tokens_cached=outcome.prompt_tokens_cached,
            num_output_tokens=outcome.output_tokens,
            time_to_first_tokens_iter=tuple(outcome.ttfts),
            inter_token_latencies_iter=tuple(outcome.itls),
            finished_requests=finished,
            spec_num_drafts=drafts,
            spec_num_draft_tokens=batch.draft_tokens,
            spec_num_accepted_tokens=outcome.spec_accepted_tokens,
            spec_accepted_per_pos=tuple(outcome.spec_accepted_per_pos),
            wait_ms=wait_ms,
            work=work,
        )
        self.iteration_index += 1
        self.metrics.observe_step(record)
        if self._listeners:
            self._report_tokens(batch, end)
        if self._on_step is not None:
            self._on_step(record)

    def _report_tokens(self, batch: Batch, end: float) -> None:
        sampled = [*batch.decodes, *(r for r, _, _ in batch.prefills)]
        for request in sampled:
            listener = self._listeners.get(request.request_id)
            if listener is None or request.last_token != end:
                continue  # a workload request, or a prefill chunk that sampled nothing
            if request.finished:
                del self._listeners[request.request_id]
            listener(Token(request.request_id, request.generated, self.start_ts + end, request.finished))

    def _finished_record(self, request: Request, end: float) -> FinishedRequest:
        scheduled = request.first_scheduled if request.first_scheduled is not None else request.arrival
        first_token = request.first_token if request.first_token is not None else end
        decode_time = end - first_token
        generated = request.generated
        return FinishedRequest(
            request_id=request.request_id,
            finish_reason=request.finish_reason,
            arrival_ts=self.start_ts + request.arrival,
            finished_ts=self.start_ts + end,
            e2e_latency=end - request.arrival,
            queued_time=scheduled - request.arrival,
            prefill_time=first_token - scheduled,
            decode_time=decode_time,
            inference_time=end - scheduled,
            time_to_first_token=first_token - request.arrival,
            mean_time_per_output_token=decode_time / (generated - 1) if generated > 1 else 0.0,
            num_prompt_tokens=request.prompt_tokens,
            num_cached_tokens=max(0, request.num_cached_tokens),
            num_generation_tokens=generated,
            max_tokens_param=request.max_tokens,
            num_preemptions=request.num_preemptions,
        )


def _work(batch: Batch) -> tuple[StepWork, ...]:
    """Each request's part of `batch`: its decode (context as scheduled, drafts) and its prefill chunks."""
    decodes = tuple(StepWork(r.request_id, 0, 0, r.computed, r.drafted) for r in batch.decodes)
    return decodes + tuple(StepWork(r.request_id, start, tokens, 0) for r, start, tokens in batch.prefills)
