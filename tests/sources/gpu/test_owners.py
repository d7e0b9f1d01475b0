"""Which engine uses a GPU: NVML's PIDs resolved once each, in either PID namespace (a host /proc's NSpid), and
where they are not visible (a sidecar in its own PID namespace, older drivers report host PIDs), the GPUs each engine
process's environment names (a fake /proc), then STEPLINE_ENGINE_GPUS."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from stepline.app.collector import Collector
from stepline.config.settings import Settings, SettingsError
from stepline.core.clock import ManualClock
from stepline.model.rows import GpuSample, Row
from stepline.sources.base import SourceContext
from stepline.sources.gpu.owners import Device, ProcPidView, used_gpus
from stepline.sources.gpu.source import GpuSource
from stepline.sources.registry import REGISTRY
from stepline.testing.fake_nvml import FakeNvml
from stepline.testing.fake_procfs import FakePidView
from tests.sources.gpu.test_source import _run, _samples

GIB = 1 << 30
HOST_PIDS = (48012, 48013, 48014, 48015)  # what an older driver reports: host pids, not visible in the sidecar


def _source(fake: FakeNvml, ctx: SourceContext | None = None, **kwargs: Any) -> tuple[GpuSource, ManualClock]:
    ctx = ctx or SourceContext("gpu-node-1", ManualClock())
    assert isinstance(ctx.clock, ManualClock)
    return GpuSource(ctx, fake, **kwargs), ctx.clock



class FakeProc:
    """A /proc directory: each process's stat (its start time) and environ."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def add(self, pid: int, environ: dict[str, str] | None, started: int = 1000) -> None:
        d = self.root / str(pid)
        d.mkdir(parents=True, exist_ok=True)
        (d / "stat").write_text(f"{pid} (python3) S 1 " + " ".join(["0"] * 17) + f" {started} 0 0\n")
        if environ is None:
            (d / "environ").unlink(missing_ok=True)
        else:
            (d / "environ").write_bytes(b"".join(f"{k}={v}".encode() + b"\0" for k, v in environ.items()))


def _nvml(gpus: int, used: dict[int, list[int]]) -> FakeNvml:
    """GPUs whose processes are host pids the sidecar cannot see."""
    fake = FakeNvml(gpus)
    for index, state in enumerate(fake.devices):
        state.uuid = f"GPU-{index}f3c{index}e2a-77d1-4c3b-9e0a-5d1c2b3a4f{index:02d}"
    for index, pids in used.items():
        fake.state(index).processes = {pid: 70 * GIB for pid in pids}
    return fake


def _uuid(fake: FakeNvml, index: int) -> str:
    return fake.state(index).uuid


def _engines(fake: FakeNvml, proc: Path, engines: dict[str, int], polls: int = 1, **kwargs: Any) -> list[str]:
    """Each GPU's engine in the last of `polls` polls, for engine processes (name -> pid in the sidecar's namespace)."""
    clock = ManualClock()
    ctx = SourceContext("h", clock)
    for name, pid in engines.items():
        ctx.engine_processes.found(name, pid)
    kwargs.setdefault("own_environ", {})
    source = GpuSource(ctx, fake, pid_view=ProcPidView(str(proc)), **kwargs)
    rows: list[Row] = []
    for _ in range(polls):
        source.poll(rows.extend)
        clock.advance(0.125)
    last = [r for r in rows if isinstance(r, GpuSample)][-len(fake.devices):]
    return [r.engine for r in last]


def test_engines_are_tied_to_the_gpu_uuids_their_environment_names(tmp_path: Path) -> None:
    fake = _nvml(3, {0: [48012], 1: [48013], 2: [48014]})
    proc = FakeProc(tmp_path)
    proc.add(12, {"PATH": "/usr/bin", "NVIDIA_VISIBLE_DEVICES": _uuid(fake, 0)})
    proc.add(13, {"NVIDIA_VISIBLE_DEVICES": "all", "CUDA_VISIBLE_DEVICES": f"{_uuid(fake, 1)[:12]},junk,2"})
    # 48014 uses GPU 2, but no engine environment names it: no engine, never a guessed one.
    assert _engines(fake, tmp_path, {"vllm-0": 12, "vllm-1": 13}) == ["vllm-0", "vllm-1", ""]


def test_indices_count_only_where_the_engine_sees_the_gpus_we_see(tmp_path: Path) -> None:
    fake = _nvml(4, {1: [48012], 2: [48013], 3: [48014]})
    proc = FakeProc(tmp_path)
    proc.add(12, {"NVIDIA_VISIBLE_DEVICES": "all", "CUDA_VISIBLE_DEVICES": "1"})  # the same set as ours: index 1
    proc.add(13, {"NVIDIA_VISIBLE_DEVICES": "2,3", "CUDA_VISIBLE_DEVICES": "0"})  # host indices: its 0 is host 2
    assert _engines(fake, tmp_path, {"a": 12, "b": 13}, own_environ={"NVIDIA_VISIBLE_DEVICES": "all"}) == [
        "", "a", "b", ""]
    # Our container got another set than the engine's: its indices are renumbered and say nothing here.
    assert _engines(fake, tmp_path, {"a": 12, "b": 13}, own_environ={"NVIDIA_VISIBLE_DEVICES": "GPU-x"}) == [
        "", "", "", ""]


def test_cuda_indices_need_one_gpu_model_or_pci_bus_order(tmp_path: Path) -> None:
    fake = _nvml(2, {0: [48012], 1: [48013]})
    fake.state(1).name = "NVIDIA A100-SXM4-80GB"
    proc = FakeProc(tmp_path)
    proc.add(12, {"CUDA_VISIBLE_DEVICES": "0"})  # fastest first: which one is 0 is CUDA's guess
    assert _engines(fake, tmp_path, {"a": 12}) == ["", ""]
    proc.add(12, {"CUDA_VISIBLE_DEVICES": "0", "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}, started=2000)
    assert _engines(fake, tmp_path, {"a": 12}) == ["a", ""]


def test_the_environment_decides_only_for_gpus_whose_processes_are_hidden(tmp_path: Path) -> None:
    fake = _nvml(3, {0: [48012], 1: [77]})  # GPU 1: a visible process of no engine; GPU 2: no process at all
    proc = FakeProc(tmp_path)
    proc.add(12, {"NVIDIA_VISIBLE_DEVICES": "all"})
    proc.add(77, {})
    assert _engines(fake, tmp_path, {"a": 12}, own_environ={"NVIDIA_VISIBLE_DEVICES": "all"}) == ["a", "", ""]


def test_the_setting_decides_what_environments_cannot(tmp_path: Path) -> None:
    fake = _nvml(4, {0: [48012], 1: [48013], 2: [48014], 3: [48015]})
    proc = FakeProc(tmp_path)
    proc.add(12, {"NVIDIA_VISIBLE_DEVICES": "all"})  # two engines naming every GPU: ambiguous
    proc.add(13, {"NVIDIA_VISIBLE_DEVICES": "all"})
    proc.add(14, None)  # another user's process: its environ is unreadable
    settings = Settings.from_env({"STEPLINE_ENGINE_GPUS": f"b={_uuid(fake, 1)}; c={_uuid(fake, 2)},{_uuid(fake, 3)}"})
    configured = settings.engine_gpu_map()
    assert _engines(fake, tmp_path, {"a": 12, "b": 13, "c": 14}, configured_gpus=configured,
                    own_environ={"NVIDIA_VISIBLE_DEVICES": "all"}) == ["", "b", "c", "c"]
    # And the environment comes before the setting.
    proc.add(12, {"NVIDIA_VISIBLE_DEVICES": _uuid(fake, 1)}, started=2000)
    proc.add(13, {"NVIDIA_VISIBLE_DEVICES": "void"}, started=2000)
    assert _engines(fake, tmp_path, {"a": 12, "b": 13, "c": 14}, configured_gpus=configured) == ["", "a", "c", "c"]
    # Built from the settings by the source registry.
    (spec,) = [s for s in REGISTRY if s.name == "gpu"]
    (source,) = spec.build(settings, SourceContext("h", ManualClock()))
    assert isinstance(source, GpuSource)


def test_an_environment_is_read_once_per_process_start(tmp_path: Path) -> None:
    fake = _nvml(1, {0: [48012]})
    proc = FakeProc(tmp_path)
    proc.add(12, {"NVIDIA_VISIBLE_DEVICES": _uuid(fake, 0)})
    clock = ManualClock()
    ctx = SourceContext("h", clock)
    ctx.engine_processes.found("a", 12)
    source = GpuSource(ctx, fake, pid_view=ProcPidView(str(tmp_path)), own_environ={})
    rows: list[Row] = []
    for _ in range(30):
        source.poll(rows.extend)
        clock.advance(0.125)
    fake.state(0).processes = {48013: GIB}  # the GPU's processes change: the environment is not read again
    for _ in range(30):
        source.poll(rows.extend)
        clock.advance(0.125)
    (tmp_path / "12" / "environ").write_bytes(b"NVIDIA_VISIBLE_DEVICES=none\0")  # unread while pid 12 stays the same
    ctx.engine_processes.found("b", 99)  # the engine processes change: GPUs are asked again
    source.poll(rows.extend)
    assert [r.engine for r in rows if isinstance(r, GpuSample)][-1] == "a"
    ctx.engine_processes.lost(12)
    proc.add(12, {"NVIDIA_VISIBLE_DEVICES": _uuid(fake, 0)}, started=5000)  # a new process under the same pid
    ctx.engine_processes.found("c", 12)
    clock.advance(1.0)
    source.poll(rows.extend)
    assert [r.engine for r in rows if isinstance(r, GpuSample)][-1] == "c"


def test_used_gpus_follows_the_runtime_and_cuda() -> None:
    a, b = Device("GPU-aaaa-1", "H100"), Device("GPU-bbbb-2", "H100")
    both = [a, b]
    assert used_gpus({"NVIDIA_VISIBLE_DEVICES": "none"}, {}, both) == frozenset()
    assert used_gpus({"NVIDIA_VISIBLE_DEVICES": "void"}, {"NVIDIA_VISIBLE_DEVICES": "void"}, both) == frozenset()
    assert used_gpus({}, {}, both) == {a.uuid, b.uuid}  # no runtime between us: the same GPUs
    assert used_gpus({}, {}, None) == frozenset()  # a GPU we could not read: indices would not line up
    assert used_gpus({"CUDA_VISIBLE_DEVICES": "1,-1,0"}, {}, both) == {b.uuid}  # CUDA stops at -1
    assert used_gpus({"CUDA_VISIBLE_DEVICES": ""}, {}, both) == frozenset()
    assert used_gpus({"CUDA_VISIBLE_DEVICES": "MIG-1234,GPU-bbbb"}, {}, both) == {b.uuid}
    assert used_gpus({"CUDA_VISIBLE_DEVICES": "GPU-bbbb"}, {}, None) == {"GPU-bbbb"}
    assert used_gpus({"CUDA_VISIBLE_DEVICES": "GPU-"}, {}, both) == frozenset()  # no UUID
    assert used_gpus({"CUDA_VISIBLE_DEVICES": "GPU-a"}, {}, [a, Device("GPU-abcd", "H100")]) == frozenset()
    assert used_gpus({"NVIDIA_VISIBLE_DEVICES": "GPU-bbbb-2,GPU-aaaa-1", "CUDA_VISIBLE_DEVICES": "0"}, {},
                     both) == {a.uuid}  # the container's GPUs in NVML's order, whatever the list's
    assert used_gpus({"NVIDIA_VISIBLE_DEVICES": "0,7"}, {"NVIDIA_VISIBLE_DEVICES": "all"}, both) == frozenset()


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


@pytest.mark.parametrize(("value", "message"), [
    ("a=GPU-1;b", "STEPLINE_ENGINE_GPUS: engine GPUs 'b' must be NAME=GPU-uuid"),
    ("a=0,1", "engine GPUs 'a=0,1' must be NAME=GPU-uuid[,GPU-uuid...] (nvidia-smi -L)"),
    ("a=GPU-1;b=GPU-2,GPU-1", "engine GPUs: GPU-1 is given to both a and b"),
])
def test_engine_gpus_setting_is_validated_in_one_line(value: str, message: str) -> None:
    with pytest.raises(SettingsError) as caught:
        Settings.from_env({"STEPLINE_ENGINE_GPUS": value})
    assert message.split(": ", 1)[-1] in str(caught.value) and "\n" not in str(caught.value)


def test_expect_gpus_is_a_flag_exported_as_a_gauge(store_url: str, sock_dir: str, tmp_path: Path) -> None:
    assert Settings.from_env({"STEPLINE_EXPECT_GPUS": "1"}).expect_gpus
    assert not Settings.from_env({"STEPLINE_EXPECT_GPUS": "false"}).expect_gpus
    assert not Settings.from_env({}).expect_gpus
    with pytest.raises(SettingsError, match=r"^STEPLINE_EXPECT_GPUS='maybe' is not a valid boolean$"):
        Settings.from_env({"STEPLINE_EXPECT_GPUS": "maybe"})
    settings = Settings.from_env({"STEPLINE_EXPECT_GPUS": "yes"}, store=store_url, metrics_port=0, query_port=0,
                                 otlp_port=0, plugin_socket=f"{sock_dir}/p.sock",
                                 disabled_sources=frozenset(s.name for s in REGISTRY))
    collector = Collector(settings, runtime_dir=tmp_path / "run")
    collector.start()
    try:
        assert collector.metrics.registry.get_sample_value("stepline_gpu_expected") == 1.0
    finally:
        collector.stop()
