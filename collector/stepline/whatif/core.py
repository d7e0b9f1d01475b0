"""Replay the recorded window through the simulator's scheduler, under the recorded settings and under each lever.

The replay keeps what the recording says of every request (arrival, prompt, cached, generated tokens) and of
every engine (its settings and its fitted step cost), and changes only the lever. What it cannot know it
assumes, and says so: a request's prefix-cache hit recurs as recorded (on whichever engine serves it), and a
request that arrived before the window is not replayed.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Any

from stepline.core.clock import ManualClock
from stepline.core.stats import nearest_rank
from stepline.sim.config import EngineConfig
from stepline.sim.costmodel import CostModel
from stepline.sim.engine import Simulation
from stepline.sim.records import FinishReason, StepRecord
from stepline.sim.workloads import Arrival, Workload
from stepline.whatif.figures import BANDS, Figures, Objectives, Served, band, figures
from stepline.whatif.fit import Fit, FitError, Jitter, fit, scaled
from stepline.whatif.intervals import (
    INTERVAL_REPLAYS,
    Band,
    Headroom,
    Verdict,
    at_capacity,
    bands,
    headroom_edge,
    knife_edge,
    misses,
    opened,
    outside,
    past_capacity,
    verdict,
    widened,
)
from stepline.whatif.levers import Lever, baseline_config, candidates
from stepline.whatif.router import RouterBar
from stepline.whatif.trace import EngineTrace

CALIBRATION_TOLERANCE = 0.15  # the replay reproduces the recording when every figure is within this
TIMELINE_BUCKETS = 120
MAX_STEPS_FACTOR = 50  # a replay running this many times the recorded steps (and at least MIN_STEP_LIMIT) stops
MIN_STEP_LIMIT = 200_000
# Each step of a replay takes the fitted model's time, or that plus the residual of a recorded step of about the
# same predicted time: the first is the engine's mean behaviour, the second also its jitter (a real engine's
# step times scatter, which its ITL tail shows). The baseline is replayed both ways; the levers are priced the
# way whose baseline comes closer to the recording.
STEP_TIMES = ("the fitted model", "the fitted model plus recorded residuals")
_FINISH: dict[str, FinishReason] = {"stop": "stop", "length": "length", "abort": "abort"}


class WhatIfError(ValueError):
    """The window cannot be replayed (no requests, or no engine whose cost can be fitted)."""


@dataclass(frozen=True, slots=True)
class Lane:
    """One engine as the replay runs it: settings with the fitted cost, the requests it serves, and the residuals
    of its fit that each step's time draws from (none: the model's time exactly)."""

    engine: str
    config: EngineConfig
    arrivals: tuple[Arrival, ...]
    residuals: tuple[tuple[float, tuple[float, ...]], ...] = ()
    seed: str = ""  # the residuals' draws (the engine's name when empty: every lever draws alike)


@dataclass(slots=True)
class Replay:
    """What one replay produced."""

    figures: Figures
    timeline: list[tuple[float, float]]  # (bucket start, epoch s; ITL p99 in it, s)
    steps: int
    stopped: str = ""  # why the replay stopped before draining ('' when it drained)
    loads: dict[str, float] = field(default_factory=dict)  # each lane's share of its capacity over the window (load)

    @property
    def busiest(self) -> tuple[str, float] | None:
        """The lane with the highest load, and the load."""
        if not self.loads:
            return None
        engine = max(self.loads, key=lambda e: self.loads[e])
        return engine, self.loads[engine]


@dataclass(slots=True)
class Priced:
    lever: Lever
    replay: Replay | None  # None when unavailable
    spread: list[Replay] = field(default_factory=list)  # its perturbed replays (intervals)
    widen: dict[str, float] = field(default_factory=dict)  # the calibration's misses (WhatIf.misses)
    headroom: list[Headroom] = field(default_factory=list)  # its lanes within their fit's error of capacity
    dearer: Replay | None = None  # replayed with every step as dear as the fit's error allows (lanes in headroom)

    def bands(self) -> dict[str, Band]:
        """Each figure's interval over the replays (the dearer one too), widened by what the calibration missed;
        open-ended where the dearer replay took a lane past its capacity."""
        if self.replay is None:
            return {}
        extra = [self.dearer.figures] if self.dearer is not None else []
        out = widened(bands(self.replay.figures, [r.figures for r in self.spread] + extra), self.widen)
        d = self.dearer
        return opened(out) if d is not None and past_capacity(self.headroom, d.figures, d.stopped, d.loads) else out

    @property
    def knife_edge(self) -> str:
        if self.replay is None:
            return ""
        d = self.dearer
        dearer = (d.figures, d.stopped, d.loads) if d is not None else None
        # The lanes short of headroom name their load themselves; the replays' disagreement then names none.
        return "; ".join(why for why in (_edge(self.replay, self.spread, named=not self.headroom),
                                         headroom_edge(self.headroom, dearer)) if why)

    def delta(self, baseline: Figures) -> float:
        if self.replay is None or baseline.goodput_rps <= 0:
            return math.nan
        return self.replay.figures.goodput_rps / baseline.goodput_rps - 1.0


@dataclass(slots=True)
class WhatIf:
    start: float
    end: float
    objectives: Objectives
    engines: list[str]
    fits: dict[str, Fit]
    skipped: dict[str, str]  # engine -> why it is not replayed
    assumed: list[str]
    settings: dict[str, EngineConfig]
    recorded: Figures
    recorded_timeline: list[tuple[float, float]]
    baseline: Replay
    levers: list[Priced] = field(default_factory=list)
    step_times: str = STEP_TIMES[0]  # how the replays timed each step (the mode whose baseline came closer)
    other_mode_worst: float = math.nan  # the other mode's worst calibration error
    baseline_spread: list[Replay] = field(default_factory=list)  # the baseline's perturbed replays

    @property
    def replays(self) -> int:
        """Replays behind each interval, the central one included (1: no intervals)."""
        return 1 + len(self.baseline_spread)

    def baseline_bands(self) -> dict[str, Band]:
        return bands(self.baseline.figures, [r.figures for r in self.baseline_spread])

    @property
    def baseline_knife_edge(self) -> str:
        return _edge(self.baseline, self.baseline_spread)

    def misses(self) -> dict[str, float]:
        """figure -> how far the recording lies outside the replayed baseline's own interval (intervals.misses)."""
        return misses(self.recorded, self.baseline_bands()) if self.baseline_spread else {}

    def recorded_outside(self) -> dict[str, tuple[float, Band]]:
        """The calibration figures whose recorded value falls outside the baseline's interval (with intervals)."""
        return outside(self.recorded, self.baseline_bands()) if self.baseline_spread else {}

    def verdict(self) -> Verdict:
        """The lever to recommend, or the tie, over the replayed baseline and every available lever."""
        base = widened(self.baseline_bands(), self.misses())["goodput_rps"]
        plans = sorted([("the recorded settings", base, [self.baseline, *self.baseline_spread]),
                        *((p.lever.name, p.bands()["goodput_rps"], [p.replay, *p.spread]) for p in self.levers
                          if p.replay is not None)], key=lambda x: -x[1].value)
        return verdict([name for name, _, _ in plans], [band for _, band, _ in plans],
                       [[r.figures.goodput_rps for r in runs if r is not None] for _, _, runs in plans])

    @property
    def calibration_errors(self) -> dict[str, float]:
        """Relative error of the replayed baseline against the recording, per figure."""
        return calibration(self.recorded, self.baseline.figures)

    @property
    def reproduces(self) -> bool:
        return all(abs(e) <= CALIBRATION_TOLERANCE for e in self.calibration_errors.values()) \
            and not self.baseline.stopped

    def ranked(self) -> list[Priced]:
        """Available levers best first (goodput, then TTFT p99), then the unavailable ones."""
        priced = [p for p in self.levers if p.replay is not None]
        priced.sort(key=lambda p: (-p.replay.figures.goodput_rps, p.replay.figures.ttft_p99_s)  # type: ignore[union-attr]
                    )
        return priced + [p for p in self.levers if p.replay is None]


def calibration(recorded: Figures, replayed: Figures) -> dict[str, float]:
    """Relative error of a replay against the recording, per figure the calibration check compares."""
    out: dict[str, float] = {}
    for name in ("ttft_p50_s", "ttft_p99_s", "itl_p99_s", "goodput_rps"):
        rec, rep = getattr(recorded, name), getattr(replayed, name)
        if rec > 0 and not math.isnan(rep):
            out[name] = rep / rec - 1.0
    return out


def _worst(errors: dict[str, float]) -> float:
    return max((abs(e) for e in errors.values()), default=0.0)


def served_recorded(traces: Iterable[EngineTrace]) -> list[Served]:
    return [Served(r.prompt_tokens, r.generation_tokens, r.ttft_s, r.decode_s) for t in traces for r in t.requests]


def arrival_span(traces: Sequence[EngineTrace]) -> tuple[float, float]:
    """First and last arrival of the traces' requests."""
    arrivals = [r.arrival for t in traces for r in t.requests]
    return min(arrivals), max(arrivals)


def recorded_figures(traces: Sequence[EngineTrace], objectives: Objectives) -> Figures:
    """The figures of what the traces recorded, computed as a replay's are."""
    start, end = arrival_span(traces)
    return figures(served_recorded(traces), (x for t in traces for s in t.steps.itls for x in s), objectives,
                   max(end - start, 1.0))


def whatif(traces: list[EngineTrace], objectives: Objectives, *, levers: Sequence[Lever] | None = None,
           chars_per_token: float | None = None, jobs: int | None = None, bars: Sequence[RouterBar] = (),
           replays: int = INTERVAL_REPLAYS) -> WhatIf:
    """Fit, calibrate, and price every lever (or `levers`) on the window's `traces`; `bars`, the size bars of the
    gateways in front (whatif.router), price shape-sharding in the router's unit; `replays` perturbed replays of
    each plan give its figures intervals (0: none)."""
    fits: dict[str, Fit] = {}
    skipped: dict[str, str] = {}
    for t in traces:
        try:
            fits[t.engine] = fit(t)
        except FitError as exc:
            skipped[t.engine] = str(exc)
    used = [t for t in traces if t.engine in fits]
    if not used:
        reasons = "; ".join(skipped.values()) or "no finished requests arrived in the window"
        raise WhatIfError(f"nothing to replay: {reasons}")
    assumed: list[str] = []
    configs: list[EngineConfig] = []
    for t in used:
        config, guessed = baseline_config(t)
        configs.append(replace(config, cost=fits[t.engine].cost))
        assumed.extend(f"{t.engine}: {g} (not in its engine_config)" for g in guessed)
        if not t.config:
            assumed.append(f"{t.engine}: no engine_config event; vLLM's defaults replayed")
    start, end = arrival_span(used)
    span = max(end - start, 1.0)
    recorded_steps = sum(len(t.steps) for t in used)
    limit = max(MIN_STEP_LIMIT, MAX_STEPS_FACTOR * recorded_steps)
    recorded = recorded_figures(used, objectives)
    recorded_timeline = itl_timeline(((ts, itls) for t in used for ts, itls in zip(t.steps.ts, t.steps.itls,
                                                                                  strict=True)), start, end)
    chosen = list(levers) if levers is not None else candidates(used, configs, objectives.tpot_s, chars_per_token,
                                                                bars)
    modes: list[list[tuple[tuple[float, tuple[float, ...]], ...]]] = [[], [fits[t.engine].residuals for t in used]]
    base_plans = [lanes(used, configs, None, start, m) for m in modes]
    bases = _run_all(base_plans, start, end, span, objectives, limit, jobs)
    worst = [_worst(calibration(recorded, b.figures)) for b in bases]
    pick = min(range(len(modes)), key=lambda k: worst[k])  # ties: the plain model
    plans = [lanes(used, configs, lv, start, modes[pick]) for lv in chosen if not lv.unavailable]
    # Each plan again under each of the fits' drawn costs (the same draws for every plan), with residuals drawn
    # under another seed: the baseline's first, then each lever's.
    draws = {t.engine: fits[t.engine].draws(replays, t.engine) for t in used} if replays > 0 else {}
    perturbed = [[_perturbed(plan, draws, k, pick == 1) for k in range(replays)]
                 for plan in [base_plans[pick], *plans]] if draws else []
    results = _run_all(plans + [p for each in perturbed for p in each], start, end, span, objectives, limit, jobs)
    central, spread = results[:len(plans)], results[len(plans):]
    spreads = [spread[i * replays:(i + 1) * replays] for i in range(len(perturbed))]
    result = WhatIf(start, end, objectives, [t.engine for t in used], fits, skipped, assumed,
                    {t.engine: c for t, c in zip(used, configs, strict=True)}, recorded, recorded_timeline,
                    bases[pick], step_times=STEP_TIMES[pick], other_mode_worst=worst[1 - pick],
                    baseline_spread=spreads[0] if spreads else [])
    # A lane whose headroom the fit's error could use up is replayed once more at that error (intervals only).
    errors = {t.engine: fits[t.engine].model_error for t in used}
    short = [at_capacity(r.loads, errors) for r in central]
    edged = [i for i, lanes_short in enumerate(short) if lanes_short] if replays > 0 else []
    dear = dict(zip(edged, _run_all([_dearer(plans[i], errors) for i in edged], start, end, span, objectives, limit,
                                    jobs), strict=True)) if edged else {}
    it = iter(enumerate(zip(central, spreads[1:] if spreads else [[] for _ in central], strict=True)))
    miss = result.misses()
    priced = []
    for lv in chosen:
        if lv.unavailable:
            priced.append(Priced(lv, None))
            continue
        i, (replayed, spread_i) = next(it)
        priced.append(Priced(lv, replayed, spread_i, widen=miss, headroom=short[i], dearer=dear.get(i)))
    result.levers = priced
    return result


def _dearer(plan: list[Lane], errors: dict[str, float]) -> list[Lane]:
    """`plan` with every lane's steps as dear as its fit's error allows."""
    return [replace(lane, config=replace(lane.config, cost=scaled(lane.config.cost, 1.0 + errors[lane.engine])))
            for lane in plan]


def _perturbed(plan: list[Lane], draws: dict[str, list[CostModel]], k: int, jitter: bool) -> list[Lane]:
    """`plan` under the k-th drawn cost of each engine, its residuals (when steps draw them) under the k-th seed."""
    return [replace(lane, config=replace(lane.config, cost=draws[lane.engine][k]),
                    seed=f"{lane.engine}/{k + 1}" if jitter else "") for lane in plan]


def _edge(central: Replay, spread: Sequence[Replay], *, named: bool = True) -> str:
    if not spread:
        return ""
    return knife_edge((central.figures, central.stopped), [(r.figures, r.stopped) for r in spread],
                      central.busiest if named else None)


def lanes(traces: list[EngineTrace], configs: list[EngineConfig], lever: Lever | None, t0: float,
          residuals: Sequence[tuple[tuple[float, tuple[float, ...]], ...]] = ()) -> list[Lane]:
    """Each engine's settings under `lever` and the requests it would serve (sharded, when the lever says so)."""
    settings: dict[str, Any] = dict(lever.settings) if lever else {}
    tuned = [replace(c, **settings) for c in configs]
    requests = [[(r, t.engine) for r in t.requests] for t in traces]
    if lever is not None and lever.shard_tokens is not None and len(traces) >= 2:
        pooled = sorted((x for rs in requests for x in rs), key=lambda x: x[0].arrival)
        long_lane = max(range(len(tuned)), key=lambda i: (tuned[i].kv_capacity_tokens, -i))
        short = [i for i in range(len(tuned)) if i != long_lane]
        requests = [[] for _ in tuned]
        turn = 0
        for x in pooled:
            if x[0].prompt_tokens >= lever.shard_tokens:
                requests[long_lane].append(x)
            else:
                requests[short[turn % len(short)]].append(x)
                turn += 1
    priority = lever is not None and lever.priority_by_band
    names = [name for name, _ in BANDS]
    out = []
    for i, (t, config, rs) in enumerate(zip(traces, tuned, requests, strict=True)):
        arrivals = tuple(Arrival(r.arrival - t0, f"{source}/{r.request_id}", max(1, r.prompt_tokens),
                                 max(1, r.generation_tokens),
                                 r.cached_tokens / r.prompt_tokens if r.prompt_tokens else 0.0,
                                 _FINISH.get(r.finish_reason, "length"), max(r.max_tokens, r.generation_tokens, 1),
                                 names.index(band(r.prompt_tokens)) if priority else 0)
                         for r, source in sorted(rs, key=lambda x: x[0].arrival))
        out.append(Lane(t.engine, config, arrivals, residuals[i] if i < len(residuals) else ()))
    return out


class _Runaway(Exception):
    pass


def replay(plan: list[Lane], t0: float, end: float, span: float, objectives: Objectives, limit: int) -> Replay:
    """Run every lane of `plan` to the end of its work (or `limit` steps)."""
    served: list[Served] = []
    stamped: list[tuple[float, tuple[float, ...]]] = []
    steps = 0
    stopped = ""
    unfinished = 0
    busy = 0.0  # the current lane's seconds of stepping at its capacity (load)
    loads: dict[str, float] = {}
    current: EngineConfig | None = None  # the settings of the lane being replayed

    def on_step(step: StepRecord) -> None:
        nonlocal steps, busy
        steps += 1
        busy += step.elapsed_ms / 1000 * fill(step, current) if current is not None else 0.0
        stamped.append((step.ts, step.inter_token_latencies_iter))
        served.extend(Served(f.num_prompt_tokens, f.num_generation_tokens, f.time_to_first_token, f.decode_time)
                      for f in step.finished_requests)
        if steps > limit:
            raise _Runaway

    for lane in plan:
        if not lane.arrivals:
            continue
        last = lane.arrivals[-1].offset_s
        sim = Simulation(Workload("whatif", last, 0.0, lane.arrivals), lane.config, ManualClock(t0),
                         on_step=on_step, step_noise=Jitter(lane.residuals, lane.seed or lane.engine)
                         if lane.residuals else None)
        before = len(served)
        busy = 0.0
        current = lane.config
        try:
            sim.advance_to(math.inf)
        except _Runaway:
            stopped = f"{lane.engine}: stopped after {limit:,} steps without draining"
        unfinished += len(lane.arrivals) - (len(served) - before)
        loads[lane.engine] = busy / span
    itls = (x for _, s in stamped for x in s)
    return Replay(figures(served, itls, objectives, span, unfinished), itl_timeline(stamped, t0, end), steps,
                  stopped, loads)


def fill(step: StepRecord, config: EngineConfig) -> float:
    """The share of its engine's capacity a step used: of the token budget, or of the sequence slots, whichever
    is fuller. A continuous-batching engine steps whenever a request decodes, so the share of the time it steps says
    nothing of its headroom; the steps' fill, weighted by their time, does: a lane whose every step is full has none.
    """
    tokens = (step.num_ctx_tokens + step.num_generation_tokens) / max(1, config.max_num_batched_tokens)
    seqs = (step.num_ctx_requests + step.num_generation_requests) / max(1, config.max_num_seqs)
    return min(1.0, max(tokens, seqs))


def _run_one(args: tuple[list[Lane], float, float, float, Objectives, int]) -> Replay:
    return replay(*args)


def _run_all(plans: list[list[Lane]], t0: float, end: float, span: float, objectives: Objectives, limit: int,
             jobs: int | None) -> list[Replay]:
    work = [(p, t0, end, span, objectives, limit) for p in plans]
    workers = min(len(work), jobs if jobs is not None else (os.cpu_count() or 1))
    if workers <= 1:
        return [_run_one(w) for w in work]
    with ProcessPoolExecutor(max_workers=workers) as pool:
        return list(pool.map(_run_one, work))


def itl_timeline(stamped: Iterable[tuple[float, Sequence[float]]], start: float, end: float
                 ) -> list[tuple[float, float]]:
    """ITL p99 per bucket of the window (TIMELINE_BUCKETS of them, at least 1 s), for the overlay plot."""
    width = max(1.0, (end - start) / TIMELINE_BUCKETS)
    buckets: dict[int, list[float]] = {}
    for ts, itls in stamped:
        if itls:
            buckets.setdefault(int((ts - start) // width), []).extend(itls)
    return [(start + k * width, nearest_rank(sorted(buckets[k]), 0.99)) for k in sorted(buckets)]
