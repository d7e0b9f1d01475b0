"""Which GPUs are sampled when GPUs die or hide: lost GPUs (GPU_IS_LOST, RESET_REQUIRED, UNKNOWN, the event wait)
reported once and out of rotation, rediscovery on the slow schedule, and XIDs through an event set rebuilt without a
lost GPU."""

from __future__ import annotations

import math

import pynvml  # type: ignore[import-untyped]
import pytest

from stepline.core.clock import ManualClock
from stepline.sources.base import SourceError
from stepline.sources.gpu.events import GpuEvents
from stepline.sources.gpu.health import Rotation
from stepline.sources.gpu.nvml import INIT_RETRY_S
from stepline.sources.gpu.readings import GpuReader
from stepline.testing.fake_nvml import FakeNvml
from tests.sources.gpu.test_source import _events, _poll, _run, _samples, _source

RESET_REQUIRED, UNKNOWN, GPU_IS_LOST = (pynvml.NVML_ERROR_RESET_REQUIRED, pynvml.NVML_ERROR_UNKNOWN,
                                        pynvml.NVML_ERROR_GPU_IS_LOST)


def _device_calls(fake: FakeNvml, index: int) -> int:
    return sum(n for (_, i), n in fake.calls.items() if i == index)


def test_fake_codes_are_pynvml_codes() -> None:
    from stepline.testing import fake_nvml

    assert (fake_nvml.GPU_IS_LOST, fake_nvml.RESET_REQUIRED, fake_nvml.UNKNOWN) == (GPU_IS_LOST, RESET_REQUIRED,
                                                                                    UNKNOWN)


def _rotation(fake: FakeNvml) -> tuple[Rotation, GpuEvents, ManualClock]:
    clock = ManualClock()
    events = GpuEvents(clock, "h")
    reader = GpuReader(fake, events, clock, gpm_interval_s=1.0, slow_interval_s=1.0)
    fake.init()
    return Rotation(fake, events, reader, clock), events, clock


def test_discovery_leaves_out_lost_and_unreadable_gpus_and_tries_them_again() -> None:
    fake = FakeNvml(3)
    fake.remove(1, RESET_REQUIRED)
    fake.state(2).transient["handle"] = 1
    rotation, events, clock = _rotation(fake)
    gpus = rotation.discover()
    assert [gpu.index for gpu in gpus] == [0] and rotation.absent == {1, 2} and rotation.lost == {1}
    assert [(e.kind, e.attributes["gpu"]) for e in events.take()] == [("gpu_lost", "1")]
    assert (events.gpus_lost, events.nvml_errors) == (1, 1)
    now = clock.monotonic()
    assert rotation.next(gpus, False, now) == gpus  # not before INIT_RETRY_S
    fake.state(1).removed = False  # the GPU was reset
    again = rotation.next(gpus, False, now + INIT_RETRY_S)
    assert [gpu.index for gpu in again] == [0, 1, 2] and not rotation.absent
    assert rotation.lost == {1}  # until it answers a sample: lost again before that, it is not reported again
    rotation.answered(1)
    assert not rotation.lost and not events.take() and events.gpus_lost == 1


def test_a_gpu_that_disappears_is_reported_once_and_the_others_keep_coming() -> None:
    fake = FakeNvml(3)
    source, clock = _source(fake)
    _run(source, clock, 2)
    fake.remove(1)
    rows = _run(source, clock, 10)
    lost = _events(rows, "gpu_lost")
    assert len(lost) == 1 and lost[0].severity == "critical"
    assert lost[0].attributes == {"gpu": "1", "uuid": fake.state(1).uuid, "error": "GPU_IS_LOST"}
    assert lost[0].message.startswith(f"GPU 1 ({fake.state(1).uuid}) was lost: GPU is lost")
    assert [r.gpu_index for r in _samples(rows)] == [0, 2] * 10
    assert fake.calls[("field_values", 1)] == 3 and source.stats()["gpus_lost"] == 1  # the third found it lost
    fake.remove(0)
    fake.remove(2)
    with pytest.raises(SourceError, match=r"^no NVML: every GPU was lost$"):
        _poll(source)
    clock.advance(60.0)
    with pytest.raises(SourceError, match=r"^no NVML: every GPU was lost$"):
        _poll(source)  # re-discovered, still lost: no new gpu_lost events
    assert source.stats()["gpus_lost"] == 3


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


def test_xid_becomes_a_critical_event() -> None:
    fake = FakeNvml(2)
    fake.state(1).processes = {77: 1}
    source, _ = _source(fake, engine_of_pid=lambda pid: "vllm-b" if pid == 77 else "")
    _poll(source)
    fake.inject_xid(1, 79)
    fake.inject_xid(0, 4242)
    rows = _poll(source)
    xids = _events(rows, "gpu_xid")
    uuid = fake.state(1).uuid
    assert xids[0].message == f"GPU 1 ({uuid}) reported XID 79: GPU has fallen off the bus"
    assert (xids[0].severity, xids[0].engine, xids[0].source) == ("critical", "vllm-b", "gpu")
    assert xids[0].attributes == {"xid": "79", "gpu": "1", "uuid": uuid}
    assert xids[1].message.endswith("reported XID 4242: see NVIDIA's XID catalogue")
    assert source.stats()["xid_events"] == 2
    assert not _events(_poll(source), "gpu_xid")


def test_xid_of_a_gpu_that_cannot_register_is_not_reported() -> None:
    fake = FakeNvml(1)
    fake.state(0).unsupported.add("register_xid_events")
    source, _ = _source(fake)
    _poll(source)
    fake.inject_xid(0, 13)
    assert not _events(_poll(source), "gpu_xid")
    assert fake.calls[("wait_xid", -1)] == 0  # nothing registered: nothing to wait for


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
