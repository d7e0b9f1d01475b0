"""The host source: exact rows from a fake psutil, process discovery and loss, and one pass over the real psutil."""

from __future__ import annotations

import math
import os
import socket
import time
from collections.abc import Sequence

import pytest

from stepline.core.clock import ManualClock
from stepline.model import schema
from stepline.model.rows import Event, HostSample, Row, micros
from stepline.sources.base import SourceContext, SourceError
from stepline.sources.host import (
    AccessDenied,
    DiskCounters,
    EngineTarget,
    HostSource,
    NicCounters,
    RealPsutil,
    SwapMemory,
    VirtualMemory,
    engine_name_and_port,
    targets_from_engines,
)
from stepline.sources.vllm_metrics import build as build_vllm_sources
from stepline.store.store import Store
from stepline.testing.fake_psutil import FakePsutil

GIB = 1 << 30


def _fake() -> FakePsutil:
    ps = FakePsutil(cores=2)
    ps.cpu, ps.per_core, ps.load = 37.5, [25.0, 50.0], (1.25, 1.0, 0.5)
    ps.memory = VirtualMemory(total=64 * GIB, available=40 * GIB, used=20 * GIB)
    ps.swap = SwapMemory(used=GIB)
    ps.nics = {"lo": NicCounters(bytes_sent=100, bytes_recv=100),
               "eth0": NicCounters(bytes_sent=5000, bytes_recv=9000, errin=1, errout=2, dropin=3, dropout=4)}
    ps.disk = DiskCounters(read_bytes=123_456, write_bytes=654_321)
    return ps


def _source(ps: FakePsutil, *targets: EngineTarget, clock: ManualClock | None = None) -> HostSource:
    return HostSource(SourceContext("gpu-node-1", clock or ManualClock()), engines=targets, ps=ps)


def _poll(source: HostSource) -> list[Row]:
    rows: list[Row] = []
    source.poll(rows.extend)
    return rows


def _samples(rows: Sequence[Row], scope: str) -> list[HostSample]:
    return [r for r in rows if isinstance(r, HostSample) and r.scope == scope]


def _events(rows: Sequence[Row]) -> list[tuple[str, str, dict[str, str]]]:
    return [(r.engine, r.kind, r.attributes) for r in rows if isinstance(r, Event)]


def test_host_row_has_exact_values_and_the_first_poll_reports_cpu_unknown() -> None:
    ps, clock = _fake(), ManualClock(1_700_000_000.0)
    source = _source(ps, clock=clock)
    first = _samples(_poll(source), "host")
    assert len(first) == 1
    assert math.isnan(first[0].cpu_pct) and len(first[0].cpu_per_core_pct) == 2
    assert all(math.isnan(v) for v in first[0].cpu_per_core_pct)
    clock.advance(1.0)
    (row,) = _poll(source)
    assert row == HostSample(
        ts=micros(1_700_000_001.0), host="gpu-node-1", engine="", scope="host", pid=0,
        cpu_pct=37.5, cpu_per_core_pct=[25.0, 50.0], load1=1.25,
        mem_used_bytes=20 * GIB, mem_available_bytes=40 * GIB, mem_total_bytes=64 * GIB, swap_used_bytes=GIB,
        rss_bytes=0, threads=0, open_files=0,
        net_rx_bytes={"lo": 100, "eth0": 9000}, net_tx_bytes={"lo": 100, "eth0": 5000},
        net_errors={"lo": 0, "eth0": 10},
        disk_read_bytes=123_456, disk_write_bytes=654_321,
    )
    assert source.name == "host"
    assert source.stats() == {"samples": 2, "processes_found": 0, "processes_lost": 0, "access_denied": 0}


def test_no_disks_read_as_zero() -> None:
    ps = _fake()
    ps.disk = None
    (row,) = _samples(_poll(_source(ps)), "host")
    assert (row.disk_read_bytes, row.disk_write_bytes) == (0, 0)


def test_process_found_by_pid() -> None:
    ps, clock = _fake(), ManualClock()
    ps.add_process(4242, ["python", "-m", "vllm.entrypoints.openai.api_server"], cpu=180.0, rss=3 * GIB,
                   threads=57, fds=120)
    source = _source(ps, EngineTarget("prod", pid=4242), clock=clock)
    rows = _poll(source)
    assert _events(rows) == [("prod", "engine_process_found", {"pid": "4242", "found_by": "pid"})]
    (fresh,) = _samples(rows, "process")
    assert math.isnan(fresh.cpu_pct)  # psutil compares with the previous call: there was none
    clock.advance(1.0)
    rows = _poll(source)
    assert _events(rows) == []
    assert _samples(rows, "process") == [HostSample(
        micros(clock.time()), "gpu-node-1", "prod", "process", 4242, 180.0, [], 0.0, 0, 0, 0, 0,
        3 * GIB, 57, 120, {}, {}, {}, 0, 0,
    )]
    assert source.stats()["processes_found"] == 1


def test_process_found_by_listening_port_ignores_other_sockets_on_that_port() -> None:
    ps = _fake()
    ps.add_process(10, ["client"])
    ps.add_process(20, ["vllm", "serve"])
    ps.add_process(21, ["vllm", "serve", "worker"])
    ps.listen(8000, 10, status="ESTABLISHED")  # a connection whose local port happens to be 8000
    ps.listen(9000, 10)
    ps.listen(8000, 21)  # SO_REUSEPORT: both listen; the lower pid is the parent
    ps.listen(8000, 20)
    rows = _poll(_source(ps, EngineTarget("127.0.0.1:8000", port=8000)))
    assert _events(rows) == [("127.0.0.1:8000", "engine_process_found", {"pid": "20", "found_by": "port"})]
    assert [r.pid for r in _samples(rows, "process")] == [20]


def test_process_found_by_cmdline_skips_unreadable_and_vanishing_processes() -> None:
    ps = _fake()
    ps.add_process(7, ["bash"])
    ps.add_process(8, ["vllm", "serve", "Qwen/Qwen3-8B"]).denied = True
    ps.add_process(9, ["vllm", "serve", "Qwen/Qwen3-8B"]).exited = True  # listed, then gone
    ps.add_process(31, ["/usr/bin/python3", "/usr/bin/vllm", "serve", "Qwen/Qwen3-8B", "--port", "8001"])
    ps.add_process(40, ["/usr/bin/python3", "/usr/bin/vllm", "serve", "Qwen/Qwen3-8B", "--port", "8002"])
    rows = _poll(_source(ps, EngineTarget("qwen", cmdline="vllm serve Qwen/Qwen3-8B")))
    assert _events(rows) == [("qwen", "engine_process_found", {"pid": "31", "found_by": "cmdline"})]


def test_pid_is_tried_before_port_and_port_before_cmdline() -> None:
    ps = _fake()
    ps.add_process(5, ["vllm", "serve"])
    ps.add_process(6, ["vllm", "serve"])
    ps.listen(8000, 6)
    rows = _poll(_source(ps, EngineTarget("a", pid=99, port=8000, cmdline="vllm serve")))
    assert _events(rows) == [("a", "engine_process_found", {"pid": "6", "found_by": "port"})]
    assert ps.calls["process_iter"] == 0  # the port answered: no scan of every process


def test_exited_process_is_lost_once_and_searched_for_again_only_after_the_interval() -> None:
    ps, clock = _fake(), ManualClock()
    ps.add_process(20, ["vllm", "serve"], rss=GIB)
    ps.listen(8000, 20)
    source = _source(ps, EngineTarget("e", port=8000), clock=clock)
    _poll(source)
    ps.exit(20)
    clock.advance(1.0)
    rows = _poll(source)
    assert _events(rows) == [("e", "engine_process_lost", {"pid": "20"})]
    assert _samples(rows, "process") == []
    searches = ps.calls["net_connections"]
    ps.add_process(25, ["vllm", "serve"], rss=2 * GIB)
    ps.listen(8000, 25)
    for _ in range(9):
        clock.advance(1.0)
        rows = _poll(source)
        assert _events(rows) == [] and _samples(rows, "process") == []
    assert ps.calls["net_connections"] == searches  # no search before the interval is up
    clock.advance(1.0)
    rows = _poll(source)
    assert _events(rows) == [("e", "engine_process_found", {"pid": "25", "found_by": "port"})]
    assert [(r.pid, r.rss_bytes) for r in _samples(rows, "process")] == [(25, 2 * GIB)]
    assert source.stats() == {"samples": 14, "processes_found": 2, "processes_lost": 1, "access_denied": 0}


def test_missing_process_is_searched_for_every_interval_not_every_poll() -> None:
    ps, clock = _fake(), ManualClock()
    ps.add_process(3, ["vllm", "serve"])
    source = _source(ps, EngineTarget("e", port=8000, cmdline="not running"), clock=clock)
    for _ in range(25):
        assert _events(_poll(source)) == []
        clock.advance(1.0)
    assert ps.calls["net_connections"] == ps.calls["process_iter"] == 3  # at 0 s, 10 s and 20 s
    assert ps.calls["cpu_percent"] == 25


def test_access_denied_on_connections_falls_back_to_cmdline() -> None:
    ps = _fake()
    ps.add_process(20, ["vllm", "serve", "--port", "8000"])
    ps.listen(8000, 20)
    ps.connections_denied = True
    source = _source(ps, EngineTarget("e", port=8000, cmdline="--port 8000"))
    rows = _poll(source)
    assert _events(rows) == [("e", "engine_process_found", {"pid": "20", "found_by": "cmdline"})]
    assert source.stats()["access_denied"] == 1


def test_listener_without_pid_counts_as_denied_and_falls_back_to_cmdline() -> None:
    ps = _fake()
    ps.add_process(20, ["vllm", "serve"])
    ps.listen(8000, None)
    source = _source(ps, EngineTarget("e", port=8000, cmdline="vllm serve"))
    assert _events(_poll(source)) == [("e", "engine_process_found", {"pid": "20", "found_by": "cmdline"})]
    assert source.stats()["access_denied"] == 1


def test_unreadable_fds_read_as_zero_and_count_once() -> None:
    ps, clock = _fake(), ManualClock()
    ps.add_process(20, ["vllm"], rss=GIB, fds=50).denied = True
    source = _source(ps, EngineTarget("e", pid=20), clock=clock)
    for _ in range(3):
        rows = _poll(source)
        clock.advance(1.0)
    assert [(r.rss_bytes, r.open_files) for r in _samples(rows, "process")] == [(GIB, 0)]
    assert source.stats()["access_denied"] == 1


def test_failing_host_readings_raise_source_error_after_process_rows() -> None:
    class Broken(FakePsutil):
        def getloadavg(self) -> tuple[float, float, float]:
            raise OSError("no /proc/loadavg")

    ps = Broken()
    ps.add_process(20, ["vllm"])
    rows: list[Row] = []
    with pytest.raises(SourceError, match="host readings failed: OSError: no /proc/loadavg"):
        _source(ps, EngineTarget("e", pid=20)).poll(rows.extend)
    assert _samples(rows, "process") and not _samples(rows, "host")


def test_engine_names_follow_vllm_metrics() -> None:
    specs = ["http://127.0.0.1:8000", "prod=http://localhost:9000", "http://10.0.0.5:8000"]
    targets = targets_from_engines(specs, local_names=())
    assert targets == [EngineTarget("127.0.0.1:8000", port=8000), EngineTarget("prod", port=9000)]
    ctx = SourceContext("h", ManualClock())
    assert [engine_name_and_port(s)[0] for s in specs] == [s.engine for s in build_vllm_sources(ctx, tuple(specs), 1.0)]


def test_local_hosts_and_default_ports() -> None:
    specs = ["http://[::1]:8000", "https://0.0.0.0", "http://gpu-node-1/", "b=http://LOCALHOST:7000/metrics",
             "http://127.0.0.2:8000", "http://gpu-node-2:8000", "http://example.com"]
    assert targets_from_engines(specs, local_names=("GPU-node-1",)) == [
        EngineTarget("::1:8000", port=8000), EngineTarget("0.0.0.0:443", port=443),
        EngineTarget("gpu-node-1:80", port=80), EngineTarget("b", port=7000),
        EngineTarget("127.0.0.2:8000", port=8000),
    ]
    assert targets_from_engines([f"http://{socket.gethostname()}:8000"]) == [
        EngineTarget(f"{socket.gethostname().lower()}:8000", port=8000)]
    with pytest.raises(ValueError, match="must be http"):
        targets_from_engines(["localhost:8000"])


def test_fields_are_the_table_columns_and_rows_round_trip_through_the_store(store: Store) -> None:
    assert HostSample._fields == schema.TABLE_BY_NAME["host_samples"].column_names
    ps, clock = _fake(), ManualClock(time.time() - 60)  # rows older than the retention vanish on insert
    ps.add_process(20, ["vllm"], cpu=150.0, rss=GIB, threads=9, fds=33)
    source = _source(ps, EngineTarget("e", pid=20), clock=clock)
    _poll(source)  # NaN CPU on the first poll
    clock.advance(1.0)
    rows = _poll(source)
    samples = _samples(rows, "host") + _samples(rows, "process")
    store.insert("host_samples", samples, HostSample._fields)
    back = store.query("SELECT scope, pid, engine, cpu_pct, cpu_per_core_pct, load1, mem_total_bytes, rss_bytes, "
                       "threads, open_files, net_rx_bytes, net_errors, disk_write_bytes "
                       "FROM host_samples ORDER BY scope").result_rows
    assert [tuple(r) for r in back] == [
        ("host", 0, "", 37.5, [25.0, 50.0], 1.25, 64 * GIB, 0, 0, 0, {"lo": 100, "eth0": 9000},
         {"lo": 0, "eth0": 10}, 654_321),
        ("process", 20, "e", 150.0, [], 0.0, 0, GIB, 9, 33, {}, {}, 0),
    ]


# The real psutil on this machine.

def test_real_psutil_host_and_own_process() -> None:
    clock = ManualClock()
    source = HostSource(SourceContext("here", clock), engines=[EngineTarget("me", pid=os.getpid())], ps=RealPsutil())
    _poll(source)
    clock.advance(1.0)
    sum(i * i for i in range(200_000))  # some CPU for the process row to see
    rows = _poll(source)
    (host,) = _samples(rows, "host")
    assert host.mem_total_bytes > 0 and 0 < host.mem_available_bytes <= host.mem_total_bytes
    assert len(host.cpu_per_core_pct) == os.cpu_count()
    assert 0.0 <= host.cpu_pct <= 100.0 and host.load1 >= 0.0
    assert all(v >= 0 for v in host.net_rx_bytes.values())
    (me,) = _samples(rows, "process")
    assert (me.engine, me.pid) == ("me", os.getpid())
    assert me.rss_bytes > 0 and me.threads >= 1 and me.open_files > 0 and me.cpu_pct >= 0.0


def test_real_psutil_finds_a_listener_by_port() -> None:
    ps = RealPsutil()
    try:
        ps.net_connections()
    except AccessDenied:
        pytest.skip("listing TCP sockets needs privileges here")
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        (target,) = targets_from_engines([f"http://127.0.0.1:{port}"])
        rows = _poll(HostSource(SourceContext("here", ManualClock()), engines=[target], ps=ps))
    if os.geteuid() != 0 and not _samples(rows, "process"):
        pytest.skip("this user's sockets are listed without their pid")
    assert _events(rows) == [(target.name, "engine_process_found", {"pid": str(os.getpid()), "found_by": "port"})]
    assert [r.pid for r in _samples(rows, "process")] == [os.getpid()]


def test_found_engine_processes_are_shared_with_the_gpu_source() -> None:
    from stepline.testing.fake_psutil import FakePsutil

    ps = FakePsutil()
    ps.add_process(4242, ["vllm", "serve"])
    ctx = SourceContext("h", ManualClock(time.time()))
    source = HostSource(ctx, engines=[EngineTarget("prod-a", pid=4242)], ps=ps)
    source.poll(lambda rows: None)
    assert ctx.engine_processes.engine_of(4242) == "prod-a"
    ps.exit(4242)
    source.poll(lambda rows: None)
    assert ctx.engine_processes.engine_of(4242) == ""


def test_a_child_of_an_engine_process_belongs_to_that_engine() -> None:
    from stepline.testing.fake_psutil import FakePsutil

    ps = FakePsutil()
    ps.add_process(100, ["vllm", "serve"])
    ps.parents.update({4243: 100, 100: 1})  # the engine core (on the GPU) is a child of the API server
    ctx = SourceContext("h", ManualClock(time.time()))
    HostSource(ctx, engines=[EngineTarget("prod-a", pid=100)], ps=ps).poll(lambda rows: None)
    assert ctx.engine_processes.engine_of(4243) == "prod-a"
    assert ctx.engine_processes.engine_of(999) == ""


def test_real_ancestors_reach_this_process() -> None:
    import subprocess
    import sys

    from stepline.sources.host import RealPsutil

    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        assert os.getpid() in RealPsutil().ancestors(child.pid)
    finally:
        child.kill()
        child.wait()
