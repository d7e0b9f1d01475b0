"""The GPU device check (benchmarks/device_check.py) over the fake NVML: every section runs and says what the GPUs
answered, the run section stores 10 Hz rows that follow the load, and without NVML it is one line and exit 0."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from types import ModuleType

import pytest

from stepline.sources.gpu.nvml import (
    FI_DEV_MEMORY_TEMP,
    GPM_SM_OCCUPANCY,
    FieldReading,
    Handle,
    NvmlError,
    RealNvml,
)
from stepline.store.store import Store
from stepline.testing.fake_nvml import FakeGpuState, FakeNvml
from tests.benchmarks.script import BENCHMARKS, load


def _script() -> ModuleType:
    return load("device_check")


class DriverClockFake(FakeNvml):
    """A fake whose field values move with wall time, as a driver's do: each read advances every GPU's counters and
    timestamps by the time since the last read."""

    def __init__(self, devices: Sequence[FakeGpuState]) -> None:
        super().__init__(devices)
        self._last = time.monotonic()
        self._lock = threading.Lock()

    def field_values(self, h: Handle, fields: Sequence[tuple[int, int]]) -> list[FieldReading]:
        with self._lock:
            now = time.monotonic()
            for state in self.devices:
                state.advance(now - self._last)
            self._last = now
        return super().field_values(h, fields)


class FakeLoad:
    """What a matmul load does to the fake GPUs: busy tensor cores, power up, 1 GiB/s host to device."""

    def __init__(self, fake: FakeNvml) -> None:
        self._fake = fake
        self.started_at = self.stopped_at = 0.0

    def describe(self) -> str:
        return "fake load"

    def start(self) -> None:
        self.started_at = time.monotonic()
        for state in self._fake.devices:
            state.tensor_active_pct, state.sm_util_pct, state.power_instant_mw = 80.0, 95.0, 650_000
            state.pcie_rx_kbs = 1 << 20

    def stop(self) -> None:
        self.stopped_at = time.monotonic()
        for state in self._fake.devices:
            state.tensor_active_pct, state.sm_util_pct, state.power_instant_mw = 0.0, 0.0, None
            state.pcie_rx_kbs = 0

    def copied_bytes(self) -> int:
        return round((self.stopped_at - self.started_at) * (1 << 30)) * len(self._fake.devices)


def _fake() -> DriverClockFake:
    hopper = FakeGpuState(name="NVIDIA H200", unsupported={"gpm_metric:3"})
    older = FakeGpuState(name="NVIDIA A100-SXM4-80GB", gpm=False,
                         unsupported={"remapped_rows", "memory", f"field:{FI_DEV_MEMORY_TEMP}"})
    return DriverClockFake([hopper, older])


def test_every_section_runs_on_the_fake(store_url: str, capsys: pytest.CaptureFixture[str]) -> None:
    script = _script()
    fake = _fake()
    load = FakeLoad(fake)
    assert script.run(fake, seconds=2.0, store_url=store_url, load=lambda: load) == 0
    out = capsys.readouterr().out
    for header in ("== 1. NVML call latency", "== 2. GPM metrics", "== 3. Field values", "== 4. GpuSource at 10 Hz",
                   "== PCIe byte counters"):
        assert header in out
    latency = out.split("== 1.")[1].split("== 2.")[0]
    for name, _ in script.device_calls(fake):
        assert f"\n{name} " in latency
    for name in ("init", "device_count", "driver_version", "handle", "gpm_metrics (5 metrics)", "register_xid_events",
                 "wait_xid(0)", "clear_xid_events"):
        assert f"\n{name} " in latency
    assert "GPU 1: NOT_SUPPORTED (3)" in latency  # remapped_rows on the older GPU, asked once
    assert "GPU 1: gpm_supported is false: no GPM" in out
    assert "GPU 0: one GPM sample passed twice: raises INVALID_ARGUMENT (2)" in out
    assert f"0    {GPM_SM_OCCUPANCY}       sm_occupancy     NOT_SUPPORTED (3)" in out
    assert "GPU 0: pcie_rx is a 64-bit value type" in out
    assert "fake load" in out
    assert "GPU 1 (GPU-00000000-0000-4000-8000-000000000001) does not support gpm" in out
    assert "GPU 0 pcie_rx: +" in out and "no wrap seen" in out

    store = Store.open(store_url)
    rows = store.query("SELECT gpu_index, count(), max(tensor_active_pct), max(power_instant_w), "
                       "max(pcie_rx_bytes_per_s), countIf(isNaN(tensor_active_pct)), "
                       "countIf(mem_used_bytes IS NULL AND mem_total_bytes IS NULL) FROM gpu_samples "
                       "GROUP BY gpu_index ORDER BY gpu_index").result_rows
    store.close()
    assert [r[0] for r in rows] == [0, 1]
    for gpu, n, tensor, power, pcie_rx, no_tensor, no_memory in rows:
        assert 14 <= n <= 22  # 10 Hz for 2 s
        assert power == 650.0
        assert pcie_rx > 0.5 * (1 << 30)
        if gpu == 0:
            assert tensor == 80.0 and no_memory == 0
        else:
            assert no_tensor == n  # no GPM: NaN throughout
            assert no_memory == n  # no memory reading: NULL, never an empty GPU


def test_without_nvml_one_line_and_exit_0(store_url: str, capsys: pytest.CaptureFixture[str]) -> None:
    script = _script()
    assert script.run(FakeNvml(missing=True), seconds=2.0, store_url=store_url, load=lambda: None) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 1 and lines[0].startswith("device check: no NVML here")


def _nvml_here() -> bool:
    try:
        RealNvml().init()
    except NvmlError:
        return False
    return True


def test_the_script_without_a_driver_prints_one_line() -> None:
    if _nvml_here():
        pytest.skip("this machine has NVML: the script would run the whole check")
    done = subprocess.run([sys.executable, str(BENCHMARKS / "device_check.py")], capture_output=True, text=True,
                          timeout=60, check=False)
    assert done.returncode == 0
    assert done.stdout.count("\n") == 1 and done.stdout.startswith("device check: no NVML here")
