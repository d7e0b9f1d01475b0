"""Fast replay: run a workload on a virtual clock and hand out /metrics scrapes as if live."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

from stepline.core.clock import Clock, ManualClock, SystemClock
from stepline.sim.config import EngineConfig
from stepline.sim.engine import Simulation, StepCallback
from stepline.sim.records import FinishedRequest, StepRecord
from stepline.sim.workloads import Workload

ScrapeCallback = Callable[[float, bytes], None]


@dataclass(slots=True)
class ReplayResult:
    """What a replay covered and, when kept, every step and finished request."""

    start_ts: float
    end_ts: float
    scrapes: int
    drained: bool
    rejected: int
    steps: list[StepRecord] = field(default_factory=list)
    finished: list[FinishedRequest] = field(default_factory=list)


def replay(
    workload: Workload,
    config: EngineConfig | None,
    scrape_interval_s: float,
    on_scrape: ScrapeCallback,
    end_at: float | None = None,
    *,
    duration_s: float | None = None,
    on_step: StepCallback | None = None,
    keep_records: bool = True,
    clock: Clock | None = None,
) -> ReplayResult:
    """Run `workload` as fast as the CPU allows, scraping every `scrape_interval_s` simulated seconds.

    The run is stamped as if it had happened in real time and ended at `end_at` (default: now):
    it covers `duration_s` (default: the workload's duration plus its drain time, rounded up to
    whole scrape intervals), and `on_scrape(ts, exposition)` sees ts = end_at - span, ..., end_at.
    """
    if scrape_interval_s <= 0:
        raise ValueError(f"scrape_interval_s must be positive, got {scrape_interval_s}")
    span = duration_s if duration_s is not None else workload.duration_s + workload.drain_s
    if span <= 0:
        raise ValueError(f"duration must be positive, got {span}")
    scrapes = math.ceil(span / scrape_interval_s - 1e-9)
    end = end_at if end_at is not None else (clock or SystemClock()).time()
    start = end - scrapes * scrape_interval_s
    virtual = ManualClock(start)
    result = ReplayResult(start_ts=start, end_ts=end, scrapes=0, drained=False, rejected=0)

    def record(step: StepRecord) -> None:
        result.steps.append(step)
        result.finished.extend(step.finished_requests)
        if on_step is not None:
            on_step(step)

    sim = Simulation(workload, config, virtual, on_step=record if keep_records else on_step)
    for k in range(scrapes + 1):
        offset = k * scrape_interval_s
        sim.advance_to(offset)
        virtual.set(start + offset)
        on_scrape(start + offset, sim.render_metrics())
        result.scrapes += 1
    result.drained = sim.is_done()
    result.rejected = sim.rejected
    return result
