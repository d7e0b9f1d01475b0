"""What the simulated engine's GPUs would read: the hardware side follows the step mix.

A step carrying prefill is compute-bound: tensor pipes busy, power near the board limit. A
decode-only step is memory-bound: DRAM bandwidth high, tensor activity low, power moderate. The
`power-cap` scenario caps board power below what prefill draws, so SM clocks drop (with the
`sw_power_cap` clock-event reason) exactly when prefill runs; the `xid` scenario also reports one
XID error part-way through (any scenario does, given `xid_at_s`). Figures are for an H200-class GPU
(700 W, 1980 MHz boost).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

from stepline.core.clock import ManualClock
from stepline.model.rows import GpuSample, Row
from stepline.sim.records import StepRecord
from stepline.sources.base import Emit, SourceContext
from stepline.sources.gpu.source import GpuSource
from stepline.testing.fake_nvml import FakeGpuState, FakeNvml

BOOST_MHZ = 1980.0
MEM_MHZ = 3201.0
IDLE_W = 90.0
TDP_W = 700.0
# Bytes one token moves over NVLink per step in tensor parallelism: hidden 4096 x 2 bytes x 36 layers x 2 all-reduces.
NVLINK_BYTES_PER_TOKEN = 4096 * 2 * 36 * 2
SW_POWER_CAP = 0x4  # nvmlClocksEventReasonSwPowerCap
GPU_IDLE = 0x1  # nvmlClocksEventReasonGpuIdle
SCENARIOS = ("normal", "power-cap", "xid")


@dataclass(frozen=True)
class GpuReading:
    """One GPU's instantaneous figures."""

    sm_clock_mhz: float
    power_w: float
    util_gpu_pct: float
    util_mem_copy_pct: float
    dram_bw_util_pct: float
    tensor_active_pct: float
    sm_occupancy_pct: float
    nvlink_bytes_per_s: float
    pcie_bytes_per_s: float
    temp_gpu_c: float
    reasons: int


IDLE = GpuReading(BOOST_MHZ, IDLE_W, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 1e6, 32.0, GPU_IDLE)


class GpuModel:
    """Turns each simulated step into what the engine's GPUs read while it runs."""

    def __init__(self, gpus: int = 2, scenario: str = "power-cap", *, power_cap_w: float = 520.0,
                 xid_at_s: float | None = None, xid_code: int = 94) -> None:
        """`xid_at_s`: seconds after the first step that one XID is reported; None: 90 s in the xid scenario,
        never in the others."""
        if scenario not in SCENARIOS:
            raise ValueError(f"unknown GPU scenario {scenario!r}; choose one of {', '.join(SCENARIOS)}")
        self.gpus = gpus
        self.scenario = scenario
        self._cap_w = power_cap_w if scenario in ("power-cap", "xid") else TDP_W
        self._scenario_cap_w = self._cap_w
        self._xid_at_s = xid_at_s if xid_at_s is not None else (90.0 if scenario == "xid" else None)
        self._xid_code = xid_code
        self._lock = threading.Lock()
        self._reading = IDLE
        self._busy_until = 0.0
        self._first_ts: float | None = None
        self._temp = 32.0

    def on_step(self, step: StepRecord) -> None:
        """The GPUs ran this step: their figures follow what it carried."""
        seconds = max(step.elapsed_ms / 1000, 1e-4)
        tokens = step.num_ctx_tokens + step.num_generation_tokens
        prefill_share = step.num_ctx_tokens / tokens if tokens else 0.0
        demand_w = IDLE_W + 260.0 + 350.0 * prefill_share + 2.0 * min(step.num_generation_requests, 60)
        power = min(demand_w, self._cap_w)
        # Past the cap, clocks fall roughly with the square root of the power they are denied.
        clock = BOOST_MHZ * (power / demand_w) ** 0.5
        reasons = SW_POWER_CAP if demand_w > self._cap_w else 0
        with self._lock:
            self._temp += (30.0 + power / 12.0 - self._temp) * min(1.0, seconds / 20.0)
            self._reading = GpuReading(
                sm_clock_mhz=round(clock),
                power_w=power,
                util_gpu_pct=100.0,
                util_mem_copy_pct=30.0 + 50.0 * (1 - prefill_share),
                dram_bw_util_pct=25.0 + 60.0 * (1 - prefill_share),
                tensor_active_pct=12.0 + 78.0 * prefill_share,
                sm_occupancy_pct=40.0 + 45.0 * prefill_share,
                nvlink_bytes_per_s=tokens * NVLINK_BYTES_PER_TOKEN / seconds if self.gpus > 1 else 0.0,
                pcie_bytes_per_s=2e6 + 4e3 * step.num_generation_requests / seconds,
                temp_gpu_c=round(self._temp, 1),
                reasons=reasons,
            )
            # A step is known only once it ends; the next one is most likely running meanwhile, and is as long.
            self._busy_until = step.ts + max(0.5, 2 * seconds)
            if self._first_ts is None:
                self._first_ts = step.ts - seconds

    def set_power_cap(self, watts: float | None) -> None:
        """Cap board power at `watts` from the next step on; None restores the scenario's own cap."""
        with self._lock:
            self._cap_w = self._scenario_cap_w if watts is None else watts

    def reading(self, now: float) -> GpuReading:
        """What the GPUs read at wall time `now`: the last step's figures, or idle once no step follows it."""
        with self._lock:
            return self._reading if now <= self._busy_until else IDLE

    def xid_due(self, now: float) -> tuple[int, int] | None:
        """(gpu index, XID code) once, when the xid scenario's moment has come."""
        with self._lock:
            if self._xid_at_s is None or self._first_ts is None or now < self._first_ts + self._xid_at_s:
                return None
            self._xid_at_s = None
            return self.gpus - 1, self._xid_code


def _uuid(index: int) -> str:
    return f"GPU-00000000-0000-4000-8000-{index:012d}"  # FakeNvml's own numbering, from the host's first GPU


class SimulatedGpus:
    """A FakeNvml whose GPUs read what a GpuModel says; `refresh(now)` before each sampling pass."""

    def __init__(self, model: GpuModel, engine_pid: int, first_index: int = 0) -> None:
        """`first_index`: where this engine's GPUs start among the host's (several engines share one host)."""
        self.model = model
        self.first_index = first_index
        self.nvml = FakeNvml([FakeGpuState(name="NVIDIA H200", uuid=_uuid(first_index + i),
                                           mem_clock_mhz=round(MEM_MHZ), mem_total_bytes=141 << 30,
                                           mem_used_bytes=126 << 30, processes={engine_pid: 124 << 30})
                              for i in range(model.gpus)])
        self._last: float | None = None

    def refresh(self, now: float) -> None:
        """Set every fake GPU to the model's reading at `now`, advancing energy and NVLink counters."""
        r = self.model.reading(now)
        elapsed = 0.0 if self._last is None else max(0.0, now - self._last)
        self._last = now
        for state in self.nvml.devices:
            state.advance(elapsed)  # energy over the interval, at the power set on the previous refresh
            state.sm_clock_mhz = round(r.sm_clock_mhz)
            state.power_mw = round(r.power_w * 1000)
            state.temp_gpu_c = round(r.temp_gpu_c)
            state.temp_mem_c = round(r.temp_gpu_c) + 6
            state.util_gpu_pct = round(r.util_gpu_pct)
            state.util_mem_pct = round(r.util_mem_copy_pct)
            state.dram_bw_util_pct = r.dram_bw_util_pct
            state.tensor_active_pct = r.tensor_active_pct
            state.sm_occupancy_pct = r.sm_occupancy_pct
            state.pcie_tx_kbs = state.pcie_rx_kbs = round(r.pcie_bytes_per_s / 1024)
            state.nvlink_tx_kib += round(r.nvlink_bytes_per_s * elapsed / 1024)
            state.nvlink_rx_kib += round(r.nvlink_bytes_per_s * elapsed / 1024)
            state.clock_event_reasons = r.reasons
        xid = self.model.xid_due(now)
        if xid is not None:
            self.nvml.inject_xid(*xid)


class SimulatedGpuSource:
    """The real GPU source over simulated GPUs: each poll first brings the fake GPUs up to date."""

    def __init__(self, gpus: SimulatedGpus, ctx: SourceContext) -> None:
        self._gpus = gpus
        self._ctx = ctx
        self.source = GpuSource(ctx, gpus.nvml)

    @property
    def name(self) -> str:
        return self.source.name

    def poll(self, emit: Emit) -> None:
        self._gpus.refresh(self._ctx.clock.time())
        self.source.poll(emit)

    def stats(self) -> Mapping[str, int]:
        return self.source.stats()


class VirtualGpuSampler:
    """Polls the simulated GPUs every interval of simulated time during a fast replay, as the runner would live."""

    def __init__(self, gpus: SimulatedGpus, ctx: SourceContext, engine: str, interval_s: float,
                 emit: Callable[[Iterable[Row]], object]) -> None:
        if not isinstance(ctx.clock, ManualClock):
            raise TypeError("a virtual sampler needs a ManualClock to set to simulated time")
        self._clock = ctx.clock
        self._source = SimulatedGpuSource(gpus, ctx)
        self._interval_s = interval_s
        self._emit = emit if not gpus.first_index else _renumbered(emit, gpus.first_index)
        self._next: float | None = None
        # The simulator runs in this process: its GPUs' process is ours, and it serves `engine`.
        ctx.engine_processes.found(engine, os.getpid())

    def until(self, ts: float) -> None:
        """Take every sample due up to simulated time `ts`."""
        if self._next is None:
            self._next = ts
        while self._next <= ts:
            self._clock.set(self._next)
            self._source.poll(self._emit)
            self._next += self._interval_s


def _renumbered(emit: Callable[[Iterable[Row]], object], first_index: int) -> Callable[[Iterable[Row]], object]:
    """`emit`, with GPU samples' indexes moved up by `first_index` (NVML numbers each fake host's GPUs from 0)."""

    def renumber(rows: Iterable[Row]) -> object:
        return emit([r._replace(gpu_index=r.gpu_index + first_index) if isinstance(r, GpuSample) else r
                     for r in rows])

    return renumber
