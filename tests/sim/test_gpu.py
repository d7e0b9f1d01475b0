"""The simulated GPUs: figures follow the step mix, a power cap shows as lower clocks, an XID once."""

from __future__ import annotations

import os
import time

import pytest

from stepline.core.clock import ManualClock
from stepline.model.rows import Event, GpuSample, Row
from stepline.sim.gpu import BOOST_MHZ, GPU_IDLE, SW_POWER_CAP, GpuModel, SimulatedGpus, SimulatedGpuSource
from stepline.sim.records import StepRecord
from stepline.sources.base import SourceContext

T0 = time.time() - 100


def _step(ts: float, prefill: int, decodes: int, elapsed_ms: float) -> StepRecord:
    return StepRecord(ts, 1, elapsed_ms, 1 if prefill else 0, prefill, decodes, decodes, decodes + 1, 0, 0.5, 0, 0,
                      0, 0, 0, 0, 0, decodes, (), (), ())


def test_prefill_is_compute_bound_and_hits_the_power_cap() -> None:
    model = GpuModel(scenario="power-cap", power_cap_w=520)
    model.on_step(_step(T0, 8192, 4, 300))
    prefill = model.reading(T0)
    assert prefill.power_w == 520 and prefill.reasons == SW_POWER_CAP and prefill.sm_clock_mhz < BOOST_MHZ
    assert prefill.tensor_active_pct > 80 and prefill.nvlink_bytes_per_s > 1e9
    model.on_step(_step(T0 + 1, 0, 32, 18))
    decode = model.reading(T0 + 1)
    assert decode.reasons == 0 and decode.sm_clock_mhz == BOOST_MHZ and decode.power_w < 520
    assert decode.dram_bw_util_pct > 80 > decode.tensor_active_pct
    assert model.reading(T0 + 2).reasons == GPU_IDLE  # nothing ran for a second
    assert GpuModel(scenario="normal").xid_due(T0) is None
    with pytest.raises(ValueError, match="unknown GPU scenario"):
        GpuModel(scenario="melting")


def test_the_real_gpu_source_samples_the_simulated_gpus() -> None:
    clock = ManualClock(T0)
    ctx = SourceContext("h", clock)
    ctx.engine_processes.found("sim-a", os.getpid())
    gpus = SimulatedGpus(GpuModel(scenario="xid", xid_at_s=1.0), engine_pid=os.getpid())
    source = SimulatedGpuSource(gpus, ctx)
    rows: list[Row] = []
    for i in range(30):
        clock.set(T0 + i * 0.1)
        gpus.model.on_step(_step(T0 + i * 0.1, 8192 if i < 20 else 0, 16, 100))
        source.poll(rows.extend)
    samples = [r for r in rows if isinstance(r, GpuSample)]
    assert len(samples) == 60 and {s.engine for s in samples} == {"sim-a"}
    assert {s.gpu_index for s in samples} == {0, 1}
    first, last = samples[0].energy_mj, samples[-1].energy_mj
    assert first is not None and last is not None and last > first
    hot = [s for s in samples if "sw_power_cap" in s.clock_event_flags]
    assert hot and all(s.power_w == 520 for s in hot)
    assert any(s.nvlink_tx_bytes_per_s > 1e9 for s in samples)
    xids = [r for r in rows if isinstance(r, Event) and r.kind == "gpu_xid"]
    assert len(xids) == 1 and xids[0].attributes["xid"] == "94"


def test_a_long_step_keeps_the_gpus_busy_until_the_next_one_ends() -> None:
    model = GpuModel(scenario="normal")
    model.on_step(_step(T0, 8192, 0, 1900))  # a 1.9 s chunk step; the next one is running meanwhile
    assert model.reading(T0 + 1.8).reasons != GPU_IDLE
    assert model.reading(T0 + 4.0).reasons == GPU_IDLE
