"""FakePsutil: the host source's psutil, with settable readings, processes that exit and refusals on demand."""

from __future__ import annotations

import pytest

from stepline.sources.host import AccessDenied, Connection, ProcessGone, Psutil, VirtualMemory
from stepline.testing.fake_psutil import FakePsutil


def test_readings_are_what_was_set_and_every_call_is_counted() -> None:
    fake = FakePsutil(cores=4)
    psutil: Psutil = fake
    fake.cpu, fake.load = 37.5, (1.0, 0.5, 0.25)
    fake.memory = VirtualMemory(total=64 << 30, available=32 << 30, used=30 << 30)
    assert (psutil.cpu_percent(), psutil.getloadavg(), psutil.virtual_memory().available) == (
        37.5, (1.0, 0.5, 0.25), 32 << 30)
    assert psutil.cpu_percent_per_core() == [0.0] * 4 and psutil.disk_io_counters() is None
    assert fake.calls["cpu_percent"] == 1 and fake.calls["virtual_memory"] == 1


def test_a_process_that_exits_raises_gone_and_its_sockets_close() -> None:
    fake = FakePsutil()
    vllm = fake.add_process(100, ["vllm", "serve", "m"], cpu=250.0, rss=1 << 30)
    fake.listen(8000, 100)
    fake.listen(9000, None)  # another user's socket: Linux names no pid
    assert fake.process(100).cpu_percent() == 250.0 and fake.process(100).cmdline() == ["vllm", "serve", "m"]
    assert fake.net_connections() == [Connection(8000, "LISTEN", 100), Connection(9000, "LISTEN", None)]
    fake.exit(100)
    with pytest.raises(ProcessGone):
        vllm.memory_info()
    with pytest.raises(ProcessGone):
        fake.process(100)
    assert fake.net_connections() == [Connection(9000, "LISTEN", None)] and list(fake.process_iter()) == []


def test_refusals_are_access_denied() -> None:
    fake = FakePsutil()
    process = fake.add_process(7, ["secret"])
    process.denied = True
    with pytest.raises(AccessDenied):
        process.cmdline()
    assert process.num_threads() == 1  # only num_fds and cmdline are refused
    fake.connections_denied = True
    with pytest.raises(AccessDenied):
        fake.net_connections()


def test_ancestors_walk_the_parents_and_stop_at_a_loop() -> None:
    fake = FakePsutil()
    fake.parents = {300: 200, 200: 100, 100: 1, 1: 300}
    assert fake.ancestors(300) == [200, 100, 1, 300]  # round the loop once, then stop
    assert fake.ancestors(5) == []
