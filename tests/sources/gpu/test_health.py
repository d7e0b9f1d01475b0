"""The GPU source when GPUs die or hide: lost GPUs (RESET_REQUIRED, UNKNOWN, the event wait), rediscovery, GPM probe
retries, and the engine lookup through NVML's PIDs in either PID namespace."""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

import pynvml  # type: ignore[import-untyped]

from stepline.core.clock import ManualClock
from stepline.model.rows import Row
from stepline.sources.base import SourceContext
from stepline.sources.gpu import GpuSource
from stepline.sources.gpu_owners import FakePidView, ProcPidView
from stepline.sources.nvml import INIT_RETRY_S
from stepline.testing.fake_nvml import FakeGpuState, FakeNvml
from tests.sources.test_nvml import _events, _run, _samples

RESET_REQUIRED, UNKNOWN, GPU_IS_LOST = (pynvml.NVML_ERROR_RESET_REQUIRED, pynvml.NVML_ERROR_UNKNOWN,
                                        pynvml.NVML_ERROR_GPU_IS_LOST)


def _source(fake: FakeNvml, ctx: SourceContext | None = None, **kwargs: Any) -> tuple[GpuSource, ManualClock]:
    ctx = ctx or SourceContext("gpu-node-1", ManualClock())
    assert isinstance(ctx.clock, ManualClock)
    return GpuSource(ctx, fake, **kwargs), ctx.clock


def _device_calls(fake: FakeNvml, index: int) -> int:
    return sum(n for (_, i), n in fake.calls.items() if i == index)


def test_fake_codes_are_pynvml_codes() -> None:
    from stepline.testing import fake_nvml

    assert (fake_nvml.GPU_IS_LOST, fake_nvml.RESET_REQUIRED, fake_nvml.UNKNOWN) == (GPU_IS_LOST, RESET_REQUIRED,
                                                                                    UNKNOWN)


def test_reset_required_takes_the_gpu_out_of_rotation_with_one_critical_event() -> None:
    fake = FakeNvml(3)
    source, clock = _source(fake)
    _run(source, clock, 2)
    fake.remove(1, RESET_REQUIRED)  # what follows XID 79 (fallen off the bus) or XID 95
    errors = source.stats()["nvml_errors"]
    rows = _run(source, clock, 20)
    lost = _events(rows, "gpu_lost")
    assert len(lost) == 1 and lost[0].severity == "critical"
    assert lost[0].attributes == {"gpu": "1", "uuid": fake.state(1).uuid, "error": "RESET_REQUIRED"}
    assert "NVML_ERROR_RESET_REQUIRED" in lost[0].message
    assert [r.gpu_index for r in _samples(rows)] == [0, 2] * 20
    assert source.stats()["nvml_errors"] - errors <= 1  # not ~13 errors a poll
    calls = _device_calls(fake, 1)
    _run(source, clock, 20)
    assert _device_calls(fake, 1) == calls  # out of rotation: not asked again before the rediscovery


def test_unknown_error_after_xid_79_is_a_lost_gpu_and_the_xid_is_reported() -> None:
    fake = FakeNvml(2)
    source, clock = _source(fake)
    _run(source, clock, 2)
    fake.inject_xid(0, 79)
    rows = _run(source, clock, 1)
    fake.remove(0, UNKNOWN)
    rows += _run(source, clock, 5)
    assert [e.attributes["xid"] for e in _events(rows, "gpu_xid")] == ["79"]
    lost = _events(rows, "gpu_lost")
    assert [(e.attributes["gpu"], e.attributes["error"]) for e in lost] == [("0", "UNKNOWN")]
    assert [r.gpu_index for r in _samples(rows)] == [0, 1] + [1] * 5
    assert not any(math.isnan(r.power_w) for r in _samples(rows))


def test_a_lost_gpu_is_rediscovered_on_the_slow_schedule() -> None:
    fake = FakeNvml(2)
    source, clock = _source(fake)
    _run(source, clock, 1)
    fake.remove(1, RESET_REQUIRED)
    rows = _run(source, clock, 8)
    handles = fake.calls[("handle", 1)]
    clock.advance(INIT_RETRY_S)
    rows += _run(source, clock, 8)  # one rediscovery: still lost, and no second event
    assert fake.calls[("handle", 1)] == handles + 1
    assert len(_events(rows, "gpu_lost")) == 1 and source.stats()["gpus_lost"] == 1
    fake.state(1).removed = False  # the GPU was reset
    clock.advance(INIT_RETRY_S)
    back = _run(source, clock, 8)
    assert [r.gpu_index for r in _samples(back)][-2:] == [0, 1]
    fake.inject_xid(1, 48)
    assert [e.attributes["gpu"] for e in _events(_run(source, clock, 1), "gpu_xid")] == ["1"]
    fake.remove(1)
    assert len(_events(_run(source, clock, 2), "gpu_lost")) == 1  # lost again after it came back: reported again


def test_a_gpu_whose_discovery_failed_transiently_is_tried_again() -> None:
    fake = FakeNvml(2)
    fake.state(1).failing.add("name")
    source, clock = _source(fake)
    rows = _run(source, clock, 8)
    assert {r.gpu_index for r in _samples(rows)} == {0} and not _events(rows, "gpu_lost")
    fake.state(1).failing.clear()
    clock.advance(INIT_RETRY_S)
    rows = _run(source, clock, 8)
    assert [r.gpu_index for r in _samples(rows)][-2:] == [0, 1]
    assert fake.calls[("init", -1)] == 1  # without restarting NVML


def test_a_failed_gpm_probe_is_asked_again_then_given_up_counted() -> None:
    fake = FakeNvml([FakeGpuState(dram_bw_util_pct=61.5), FakeGpuState(dram_bw_util_pct=12.0)])
    for state in fake.devices:
        state.failing.add("gpm_supported")
    source, clock = _source(fake)
    rows = _run(source, clock, 8)
    assert not _events(rows, "gpu_reading_unsupported") and fake.calls[("gpm_sample", 0)] == 0
    fake.state(0).failing.clear()
    for _ in range(2):
        clock.advance(INIT_RETRY_S)
        rows += _run(source, clock, 24)
    assert fake.calls[("gpm_supported", 0)] == 2 and fake.calls[("gpm_supported", 1)] == 3
    assert _samples(rows, 0)[-1].dram_bw_util_pct == 61.5
    gave_up = _events(rows, "gpu_reading_unsupported")
    assert [(e.attributes["gpu"], e.attributes["reading"]) for e in gave_up] == [("1", "gpm")]
    assert "failed 3 times" in gave_up[0].message
    clock.advance(INIT_RETRY_S)
    _run(source, clock, 8)
    assert fake.calls[("gpm_supported", 1)] == 3 and fake.calls[("gpm_sample", 1)] == 0
    assert all(math.isnan(r.dram_bw_util_pct) for r in _samples(rows, 1))


def test_gpu_is_lost_from_the_event_wait_does_not_stop_other_gpus_xids() -> None:
    fake = FakeNvml(3)
    source, clock = _source(fake)
    _run(source, clock, 2)
    fake.remove(1)  # the event wait now answers GPU_IS_LOST while GPU 1 is in the event set
    rows = _run(source, clock, 3)
    assert [e.attributes["gpu"] for e in _events(rows, "gpu_lost")] == ["1"]
    fake.inject_xid(2, 43)
    rows = _run(source, clock, 2)
    xids = _events(rows, "gpu_xid")
    assert [(e.attributes["gpu"], e.attributes["xid"]) for e in xids] == [("2", "43")]
    assert xids[0].severity == "critical"


def test_the_event_set_is_rebuilt_when_only_the_wait_knows_a_gpu_is_lost() -> None:
    fake = FakeNvml(2)
    fake.state(1).unsupported |= {"clock_mhz", "power_mw", "energy_mj", "temperature_c", "utilization", "memory",
                                  "pcie_throughput_kbs", "pcie_replay_counter", "field_values",
                                  "clock_event_reasons", "processes"}
    fake.state(1).gpm = False
    source, clock = _source(fake)
    _run(source, clock, 2)  # GPU 1 answers nothing but is registered for XIDs
    fake.remove(1)
    _run(source, clock, 1)
    fake.inject_xid(0, 13)
    rows = _run(source, clock, 20)
    assert [e.attributes["gpu"] for e in _events(rows, "gpu_lost")] in (["1"], [])
    assert [e.attributes["xid"] for e in _events(rows, "gpu_xid")] == ["13"]
    assert fake.calls[("clear_xid_events", -1)] == 1  # once, not once a poll


def test_unmatched_pids_are_looked_up_once_not_every_poll() -> None:
    fake = FakeNvml(2)
    fake.state(0).processes = {100: 1, 101: 1}
    fake.state(1).processes = {200: 1}
    asked: list[int] = []

    def engine_of(pid: int) -> str:
        asked.append(pid)
        return ""

    view = FakePidView({100: 7, 101: 7, 200: 7})
    source, clock = _source(fake, engine_of_pid=engine_of, pid_view=view)
    rows = _run(source, clock, 50)
    assert sorted(asked) == [100, 101, 200]
    assert all(r.engine == "" for r in _samples(rows))
    assert view.reads == 3  # the same processes: no /proc read either
    fake.state(0).processes = {100: 1}  # pid 101 exited ...
    _run(source, clock, 8)  # processes are read once a second
    fake.state(0).processes = {100: 1, 101: 1}
    _run(source, clock, 8)  # processes are read once a second
    assert sorted(asked) == [100, 101, 200]  # a set that changed reads start times, and they tell the same processes
    fake.state(0).processes = {100: 1}
    _run(source, clock, 8)  # processes are read once a second
    view.started[101] = 8  # ... and its number was reused by another process
    fake.state(0).processes = {100: 1, 101: 1}
    _run(source, clock, 8)  # processes are read once a second
    assert sorted(asked) == [100, 101, 101, 200]


def test_at_most_a_few_lookups_a_poll() -> None:
    fake = FakeNvml(8)
    for i, state in enumerate(fake.devices):
        state.processes = {1000 + 10 * i + k: 1 for k in range(3)}
    asked: list[int] = []

    def engine_of(pid: int) -> str:
        asked.append(pid)
        return "engine-a" if pid == 1072 else ""

    source, clock = _source(fake, engine_of_pid=engine_of, pid_view=FakePidView())
    per_poll = []
    rows: list[Row] = []
    for _ in range(8):
        before = len(asked)
        rows += _run(source, clock, 1)
        per_poll.append(len(asked) - before)
    assert max(per_poll) <= 4 and sum(per_poll) == 24
    assert _samples(rows, 7)[-1].engine == "engine-a"


def test_a_cached_nothing_is_forgotten_when_an_engine_process_is_found() -> None:
    fake = FakeNvml(1)
    fake.state(0).processes = {5: 1}
    clock = ManualClock()
    ctx = SourceContext("h", clock)
    ctx.engine_processes.found("other", 77)
    source = GpuSource(ctx, fake, pid_view=FakePidView({5: 1}))
    assert _samples(_run(source, clock, 3))[-1].engine == ""
    ctx.engine_processes.found("vllm-0", 5)
    assert _samples(_run(source, clock, 1))[-1].engine == "vllm-0"


def test_host_pids_of_an_older_driver_are_mapped_to_the_sidecars_namespace() -> None:
    fake = FakeNvml(2)
    fake.state(0).processes = {12: 70 << 30}  # what the sidecar sees: pid 12 in its namespace ...
    fake.state(1).processes = {13: 70 << 30}
    fake.host_pids = {12: 48012, 13: 48013}  # ... reported by an older driver as host pids
    ctx = SourceContext("h", ManualClock())
    ctx.engine_processes.found("vllm-0", 12)
    ctx.engine_processes.found("vllm-1", 13)
    row = _samples(_run(*_source(fake, ctx), 1))
    assert [r.engine for r in row] == ["", ""]  # without a way through the namespaces: nothing, never a wrong engine
    assert row[0].processes == {48012: 70 << 30}
    # A host /proc mounted: NSpid maps host pids to the sidecar's.
    view = FakePidView({12: 1, 13: 1}, local={48012: 12, 48013: 13})
    rows = _run(*_source(fake, ctx, pid_view=view), 1)
    assert [r.engine for r in _samples(rows)] == ["vllm-0", "vllm-1"]
    # Not visible at all: the GPU-UUID hook (issue 16) decides.
    by_uuid = {fake.state(1).uuid: "vllm-1"}
    rows = _run(*_source(fake, ctx, pid_view=FakePidView(), engine_of_gpu=lambda uuid: by_uuid.get(uuid, "")), 1)
    assert [r.engine for r in _samples(rows)] == ["", "vllm-1"]


def test_newer_drivers_namespace_pids_match_directly() -> None:
    fake = FakeNvml(1)
    fake.state(0).processes = {12: 1}
    ctx = SourceContext("h", ManualClock())
    ctx.engine_processes.found("vllm-0", 12)
    assert _samples(_run(*_source(fake, ctx, pid_view=FakePidView({12: 1})), 1))[0].engine == "vllm-0"


def test_proc_pid_view_reads_start_times_and_nspid(tmp_path: Path) -> None:
    me = os.getpid()
    view = ProcPidView()
    started = view.start_time(me)
    assert isinstance(started, int) and started >= 0
    assert view.start_time(2**22 + 12345) is None  # above pid_max: never visible
    host = tmp_path / "host-proc"
    for host_pid, start in ((48012, started), (48013, started + 1)):
        (host / str(host_pid)).mkdir(parents=True)
        (host / str(host_pid) / "stat").write_text(
            f"{host_pid} (vllm (engine) x) S 1 " + " ".join(["0"] * 17) + f" {start} 0 0\n")
        (host / str(host_pid) / "status").write_text(f"Name:\tpython\nNSpid:\t{host_pid}\t{me}\nPPid:\t1\n")
    mapped = ProcPidView(host_proc=str(host))
    assert mapped.local_pid(48012) == me
    assert mapped.local_pid(48013) is None  # the pid number here belongs to another process
    assert mapped.local_pid(48014) is None and view.local_pid(48012) is None
