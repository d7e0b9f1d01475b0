"""The watchdog's model of one engine: progress, work in flight, fitted step costs, budget and state.

Progress is a step that ended (at its own ts), or a generated-token / iteration / prompt-token counter
that moved on the engine's /metrics (at the scrape before the one that saw it move: the moment it is known
to have moved after). The budget is what the next step may take given the work in flight: a
least-squares fit of elapsed_ms ~ a + b*prefill_tokens + c*decoding_requests over the engine's last
64 steps, pulled towards priors (a=20 ms, b=0.06 ms/token, c=0.3 ms/request) while data is scarce;
the expected step is the larger of that prediction and the last step's time (context, which the
fit cannot see, only grows), x10, clamped to [5 s, 1800 s]; nothing running gets the floor. An
engine seen only through /metrics adds two scrape intervals (its progress is seen only per scrape).
States, first match wins: down (engine_down, or a scraped engine silent 120 s); idle (nothing
waiting or running); stalled (no progress for longer than the budget); slow (none for a third of
it, or the last steps > 5x the engine's decode-only median); progressing.

Work in flight is the newest report per engine index, from a step or the queue gauges, whichever is
newer by its ts. The plugin ships steps in batches, so the steps that end a busy spell (the last one
saying 0 running) can wait in its buffer until vLLM's next record() or log(), and a batch can arrive
after a newer scrape: a step never overrides a newer gauge reading, and on a scraped engine no
verdict is drawn from the age of its progress until a gauge reading at or after that progress says
work is still in flight (a wedged engine's gauges keep saying so; an idle one's say 0).
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from stepline.core.linsolve import solve
from stepline.model.rows import EngineSample, Event, GpuSample, Request, Step

STATES = ("idle", "progressing", "slow", "stalled", "down")
# Counters whose movement proves the engine did work (for engines seen only through /metrics).
PROGRESS_COUNTERS = frozenset({"vllm:generation_tokens_total", "vllm:iteration_tokens_total_count",
                               "vllm:prompt_tokens_total"})
QUEUE_GAUGES = frozenset({"vllm:num_requests_waiting", "vllm:num_requests_running"})
WINDOW_S = 60.0  # ITL p99, prefill share and prefix-cache hit ratio look this far back
GPU_WINDOW_S = 10.0
# A prefill of this many of the engine's token budgets (its largest chunk), in flight this long, is what requests
# queue behind (the diagnosis calls a prompt long from the same number of budgets: baseline.LONG_PROMPT_CHUNKS).
LONG_PREFILL_CHUNKS = 4
LONG_PREFILL_AGE_S = 10.0


@dataclass(frozen=True)
class Policy:
    """Every constant of the budget and the states, in one place."""

    prior_a_ms: float = 20.0  # fixed cost of a step (scheduling, sampling, launch)
    prior_b_ms_per_token: float = 0.06  # prefill cost per scheduled token
    prior_c_ms_per_request: float = 0.3  # decode cost per decoding request
    fit_steps: int = 64
    safety_factor: float = 10.0
    floor_s: float = 5.0
    ceiling_s: float = 1800.0
    slow_ratio: float = 5.0  # last steps this many times the decode-only median: slow
    slow_min_ms: float = 250.0  # steps faster than this are never called slow
    down_after_s: float = 120.0  # a scraped engine with no row at all this long is down
    scrape_resolution: float = 2.0  # scrape intervals added to the budget of an engine with no steps
    plugin_silent_after_s: float = 30.0  # counters moving this long with no plugin step: a silent plugin (silence.py)
    plugin_delivery_s: float = 5.0  # a step run before a scrape reaches the collector within this


class StepCosts:
    """An online least-squares fit of step time, regularised towards the priors (ridge around them)."""

    # Typical magnitudes of the features: the priors weigh like a tenth of one step of this size, enough
    # to hold a coefficient the steps say nothing about (no prefill yet) and too little to bias the rest.
    _SCALE = (1.0, 1000.0, 10.0)
    _PRIOR_WEIGHT = 0.1

    def __init__(self, policy: Policy) -> None:
        self._prior = (policy.prior_a_ms, policy.prior_b_ms_per_token, policy.prior_c_ms_per_request)
        self._steps: deque[tuple[float, float, float]] = deque(maxlen=policy.fit_steps)
        self._coefficients: tuple[float, float, float] | None = self._prior

    def add(self, prefill_tokens: float, decoding_requests: float, elapsed_ms: float) -> None:
        self._steps.append((prefill_tokens, decoding_requests, elapsed_ms))
        self._coefficients = None  # refit lazily: the ingest path only appends

    def __len__(self) -> int:
        return len(self._steps)

    def coefficients(self) -> tuple[float, float, float]:
        """(a ms, b ms/token, c ms/request), never negative."""
        if self._coefficients is None:
            self._coefficients = self._fit()
        return self._coefficients

    def predict_ms(self, prefill_tokens: float, decoding_requests: float) -> float:
        a, b, c = self.coefficients()
        return a + b * prefill_tokens + c * decoding_requests

    def _fit(self) -> tuple[float, float, float]:
        # Normal equations (X'X + W) theta = X'y + W prior, with W the priors' weights.
        m = [[0.0] * 3 for _ in range(3)]
        v = [0.0] * 3
        for p, d, y in self._steps:
            x = (1.0, p, d)
            for i in range(3):
                v[i] += x[i] * y
                for j in range(3):
                    m[i][j] += x[i] * x[j]
        for i in range(3):
            w = self._PRIOR_WEIGHT * self._SCALE[i] ** 2
            m[i][i] += w
            v[i] += w * self._prior[i]
        theta = solve(m, v)
        if theta is None:
            return self._prior
        a, b, c = (max(0.0, t) for t in theta)
        return a, b, c



@dataclass(frozen=True)
class Assessment:
    """What the watchdog concludes about one engine at one moment."""

    engine: str
    state: str
    age_s: float
    budget_s: float
    expected_step_s: float
    waiting: int
    running: int
    inflight_prefill_tokens: int
    decoding_requests: int
    longest_context_tokens: int
    queued_behind_prefill: int
    gpu_utilization: float | None  # 0-1
    itl_p99_s: float | None
    prefill_step_share: float | None
    prefix_cache_hit_ratio: float | None
    kv_cache_usage: float | None
    reason: str  # why this state, one phrase


@dataclass
class _WindowStep:
    ts: float
    prefill: bool
    queries: int
    hits: int
    itl: Sequence[float]
    elapsed_s: float = 0.0


@dataclass
class EngineModel:
    """Everything the watchdog keeps about one engine; fed row by row, read by assess()."""

    name: str
    first_seen: float
    policy: Policy = field(default_factory=Policy)
    last_row: float = 0.0
    last_progress: float | None = None
    down_since: float | None = None
    down_message: str = ""
    has_steps: bool = False
    plugin_silent: bool = False  # steps have stopped while /metrics moves (silence.py): judged as if scraped only
    last_scrape: float | None = None
    previous_scrape: float | None = None  # the scrape before last_scrape
    scrape_interval_s: float = 0.0
    last_queue_gauge: float | None = None  # ts of the newest queue gauge reading
    # engine_index -> (ts, waiting, running): newest report wins, from steps or /metrics
    queue: dict[str, tuple[float, int, int]] = field(default_factory=dict)
    kv: dict[str, tuple[float, float]] = field(default_factory=dict)
    last_prefill_tokens: int = 0
    last_decoding: int = 0
    last_elapsed_ms: float = 0.0
    recent_ms: deque[float] = field(default_factory=lambda: deque(maxlen=5))
    decode_only_ms: deque[float] = field(default_factory=lambda: deque(maxlen=256))
    window: deque[_WindowStep] = field(default_factory=deque)
    sample_cache: deque[tuple[float, float, float]] = field(default_factory=deque)  # ts, queries, hits
    gpu_util: deque[tuple[float, float]] = field(default_factory=deque)  # ts, 0-1
    pending_preemptions: int = 0
    # The prompt now prefilling, followed chunk by chunk: a long prompt's chunks are all full but the last.
    max_chunk: int = 0
    prompt_tokens: int = 0
    prompt_start: float = 0.0
    last_prefill_ts: float | None = None
    last_chunk_full: bool = False
    decoding_context: int = 0  # the longest prompt seen prefilled that may still be decoding
    costs: StepCosts = field(init=False)

    def __post_init__(self) -> None:
        self.costs = StepCosts(self.policy)

    # --- feeding (the ingest path: appends and compares only) ---

    def step(self, s: Step) -> None:
        ts = s.ts / 1e6
        self._seen(ts)
        self.has_steps = True
        index = str(s.engine_index)
        if ts >= self.queue.get(index, (0.0, 0, 0))[0]:  # a late batch's step must not undo a newer gauge
            # Deferred requests included in both (the steps table's `waiting`, vllm:num_requests_waiting): queued work.
            self.queue[index] = (ts, s.waiting, s.running)
        if ts >= self.kv.get(index, (0.0, 0.0))[0]:
            self.kv[index] = (ts, s.kv_cache_usage)
        self.pending_preemptions += s.preempted
        if s.is_dummy:  # data-parallel padding: no work, no progress
            return
        self.last_progress = max(self.last_progress or ts, ts)
        elapsed = s.elapsed_ms if s.elapsed_ms == s.elapsed_ms else 0.0  # NaN: no iteration details
        self.last_prefill_tokens, self.last_decoding, self.last_elapsed_ms = (
            s.num_ctx_tokens, s.num_generation_requests, elapsed)
        if elapsed > 0:
            self.costs.add(s.num_ctx_tokens, s.num_generation_requests, elapsed)
            self.recent_ms.append(elapsed)
            if s.num_ctx_tokens == 0 and s.num_generation_requests > 0:
                self.decode_only_ms.append(elapsed)
        if s.num_ctx_tokens > 0:
            self._chunk(ts, s.num_ctx_tokens, elapsed)
        self.window.append(_WindowStep(ts, s.num_ctx_tokens > 0, s.prefix_cache_queries, s.prefix_cache_hits,
                                       s.itl_seconds, elapsed / 1000))

    def _chunk(self, ts: float, tokens: int, elapsed_ms: float) -> None:
        self.max_chunk = max(self.max_chunk, tokens)
        if self.last_chunk_full and self._prefill_in_flight(ts):
            self.prompt_tokens += tokens
        else:
            self._prompt_done()
            self.prompt_tokens, self.prompt_start = tokens, ts - elapsed_ms / 1000
        self.last_prefill_ts = ts
        self.last_chunk_full = tokens >= 0.9 * self.max_chunk and tokens >= 512

    def _prompt_done(self) -> None:
        self.decoding_context = max(self.decoding_context, self.prompt_tokens)
        self.prompt_tokens = 0

    def _prefill_in_flight(self, now: float) -> bool:
        # A chunk follows the last one within a few of its own step times.
        gap = max(5.0, 3 * self.last_elapsed_ms / 1000)
        return self.last_prefill_ts is not None and now - self.last_prefill_ts <= gap

    def sample(self, s: EngineSample) -> None:
        ts = s.ts / 1e6
        self._seen(ts)
        if self.last_scrape is not None and ts > self.last_scrape:
            self.scrape_interval_s = ts - self.last_scrape
            self.previous_scrape = self.last_scrape
        self.last_scrape = max(self.last_scrape or ts, ts)
        if self.down_since is not None and ts > self.down_since:
            self.down_since = None
        metric = s.metric
        if metric in PROGRESS_COUNTERS:
            if s.delta > 0:
                # The counter moved some time after the previous scrape, not at this one: stamped by the data's
                # own time, a scrape that follows the last step must not restart the stall clock.
                moved = self.previous_scrape if self.previous_scrape is not None and ts == self.last_scrape else ts
                self.last_progress = max(self.last_progress or moved, moved)
        elif metric in QUEUE_GAUGES:
            self.last_queue_gauge = max(self.last_queue_gauge or ts, ts)
            index = s.engine_index or "0"
            old_ts, waiting, running = self.queue.get(index, (0.0, 0, 0))
            if ts >= old_ts:
                if metric == "vllm:num_requests_waiting":
                    waiting = int(s.value)
                else:
                    running = int(s.value)
                self.queue[index] = (ts, waiting, running)
        elif metric == "vllm:kv_cache_usage_perc":
            index = s.engine_index or "0"
            if ts >= self.kv.get(index, (0.0, 0.0))[0]:
                self.kv[index] = (ts, s.value)
        elif not self.has_steps:  # steps say these better; counting both would count twice
            if metric == "vllm:num_preemptions_total":
                self.pending_preemptions += int(s.delta)
            elif metric == "vllm:prefix_cache_queries_total" and s.delta > 0:
                self.sample_cache.append((ts, s.delta, 0.0))
            elif metric == "vllm:prefix_cache_hits_total" and s.delta > 0:
                self.sample_cache.append((ts, 0.0, s.delta))

    def event(self, e: Event) -> None:
        ts = e.ts / 1e6
        if e.kind == "engine_down":
            self.down_since, self.down_message = ts, e.message
        elif e.kind in ("engine_up", "engine_restart"):
            self._seen(ts)
            self.down_since = None

    def request(self, r: Request) -> None:
        self._seen(r.ts / 1e6)
        if self.decoding_context and r.prompt_tokens >= 0.9 * self.decoding_context:
            self.decoding_context = 0  # the long request finished

    def gpu(self, g: GpuSample) -> None:
        if g.util_gpu_pct == g.util_gpu_pct:  # NaN: not supported by this GPU
            self.gpu_util.append((g.ts / 1e6, g.util_gpu_pct / 100))

    def _seen(self, ts: float) -> None:
        self.last_row = max(self.last_row, ts)

    # --- judging (the watchdog's thread) ---

    def assess(self, now: float, previous: str | None = None, since: float = 0.0, dwell_s: float = 10.0
               ) -> Assessment:
        """The engine's state at `now`; `previous` held since `since` damps slow/progressing flapping."""
        p = self.policy
        self._prune(now)
        waiting = sum(q[1] for q in self.queue.values())
        running = sum(q[2] for q in self.queue.values())
        if self.prompt_tokens and not self._prefill_in_flight(now):
            self._prompt_done()
        if running == 0:
            self.decoding_context = 0
        in_flight = running > 0
        prefill = self.last_prefill_tokens if in_flight and self.has_steps else 0
        decoding = (self.last_decoding if self.has_steps else running) if in_flight else 0
        expected_ms = self.costs.predict_ms(prefill, decoding) if in_flight else self.costs.coefficients()[0]
        if in_flight:
            expected_ms = max(expected_ms, self.last_elapsed_ms)
        resolution = 0.0 if self.has_steps and not self.plugin_silent else p.scrape_resolution * self.scrape_interval_s
        core = min(p.ceiling_s, max(p.floor_s, p.safety_factor * expected_ms / 1000))
        budget = core + resolution
        age = max(0.0, now - (self.last_progress if self.last_progress is not None else self.first_seen))
        slow_steps = self._slow_steps()
        state, reason = "progressing", "progress within budget"
        if self.down_since is not None:
            state, reason = "down", self.down_message or "engine_down"
        elif self.last_scrape is not None and now - self.last_row > p.down_after_s:
            state, reason = "down", f"no data from the engine for {now - self.last_row:.0f}s"
        elif waiting + running == 0:
            state, reason = "idle", "nothing waiting or running"
        elif self._unconfirmed():
            if slow_steps:  # the step times still speak for themselves
                state, reason = "slow", slow_steps
            else:
                reason = "no queue gauge read since the last progress yet"
        elif age > budget:
            state, reason = "stalled", "no progress for longer than the budget"
        elif age > resolution + core / 3:
            state, reason = "slow", "no progress for over a third of the budget"
        elif slow_steps:
            state, reason = "slow", slow_steps
        if {state, previous} == {"slow", "progressing"} and now - since < dwell_s:
            state, reason = previous or state, "held (flapping damped)"
        prompt = self.prompt_tokens if self._prefill_in_flight(now) else 0
        long_prefill = prompt >= LONG_PREFILL_CHUNKS * self.max_chunk and now - self.prompt_start >= LONG_PREFILL_AGE_S
        queued = waiting if prompt and long_prefill else 0
        return Assessment(
            self.name, state, age, budget, expected_ms / 1000, waiting, running, prefill, decoding,
            max(prompt, self.decoding_context), queued, self._gpu_utilization(now), self._itl_p99(),
            self._prefill_share(), self._hit_ratio(), self._kv(), reason)

    def _unconfirmed(self) -> bool:
        """Whether the work in flight is the plugin's word alone, older than the engine's gauges can vouch for."""
        gauge, progress = self.last_queue_gauge, self.last_progress
        return gauge is not None and progress is not None and gauge < progress

    def _slow_steps(self) -> str:
        if len(self.recent_ms) < 3 or len(self.decode_only_ms) < 5:
            return ""
        recent = statistics.median(self.recent_ms)
        baseline = statistics.median(self.decode_only_ms)
        if recent >= self.policy.slow_min_ms and recent > self.policy.slow_ratio * baseline:
            return f"last steps {recent:.0f}ms against a {baseline:.0f}ms decode-only median"
        return ""

    def _prune(self, now: float) -> None:
        while self.window and self.window[0].ts < now - WINDOW_S:
            self.window.popleft()
        while self.sample_cache and self.sample_cache[0][0] < now - WINDOW_S:
            self.sample_cache.popleft()
        while self.gpu_util and self.gpu_util[0][0] < now - GPU_WINDOW_S:
            self.gpu_util.popleft()

    def _gpu_utilization(self, now: float) -> float | None:
        values = [u for ts, u in self.gpu_util if ts >= now - GPU_WINDOW_S]
        return sum(values) / len(values) if values else None

    def _itl_p99(self) -> float | None:
        itl = sorted(x for w in self.window for x in w.itl)
        return itl[min(len(itl) - 1, math.ceil(0.99 * len(itl)) - 1)] if itl else None

    def _prefill_share(self) -> float | None:
        """The share of the engine's time spent in steps that carry prefill (of steps, without iteration times):
        50 fast decode steps and one 1.4 s chunk are mostly prefill, however the steps count."""
        if not self.window:
            return None
        busy = sum(w.elapsed_s for w in self.window)
        if busy > 0:
            return sum(w.elapsed_s for w in self.window if w.prefill) / busy
        return sum(w.prefill for w in self.window) / len(self.window)

    def _hit_ratio(self) -> float | None:
        """The prefix-cache hit ratio of the window's lookups, each step's lookups weighing alike: vLLM looks a
        request up in the step that first schedules it, so one uncached 300k-token prompt is one step's ratio, not
        the whole window's tokens. An engine seen only through /metrics has counter deltas, weighted by tokens."""
        ratios = [w.hits / w.queries for w in self.window if w.queries > 0]
        if ratios:
            return sum(ratios) / len(ratios)
        queries = sum(q for _, q, _ in self.sample_cache)
        hits = sum(h for _, _, h in self.sample_cache)
        return hits / queries if queries > 0 else None

    def _kv(self) -> float | None:
        return sum(v for _, v in self.kv.values()) / len(self.kv) if self.kv else None
