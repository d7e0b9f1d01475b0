"""GPUs tied to engines where NVML's PIDs are not visible (a sidecar in its own PID namespace, older drivers report
host PIDs): by the GPUs each engine process's environment names (a fake /proc), then by STEPLINE_ENGINE_GPUS."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from stepline.app.collector import Collector
from stepline.config.settings import Settings, SettingsError
from stepline.core.clock import ManualClock
from stepline.model.rows import GpuSample, Row
from stepline.sources.base import SourceContext
from stepline.sources.gpu import GpuSource
from stepline.sources.gpu_owners import Device, ProcPidView, used_gpus
from stepline.sources.registry import REGISTRY
from stepline.testing.fake_nvml import FakeNvml

GIB = 1 << 30
HOST_PIDS = (48012, 48013, 48014, 48015)  # what an older driver reports: host pids, not visible in the sidecar


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
