"""Source: the host (CPU, memory, load, network, disk) and each local engine process, via psutil."""

from __future__ import annotations

import ipaddress
import math
import os
import socket
from collections.abc import Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol

from stepline.config.settings import split_named_url, url_host_port
from stepline.model.rows import Event, HostSample, Row, micros
from stepline.sources.base import Emit, SourceContext, SourceError

REDISCOVER_S = 10.0
# Row values when psutil has nothing to compare with yet (first poll, newly found process).
UNKNOWN = math.nan


class PsutilError(Exception):
    """A psutil call failed in a way the source handles."""


class ProcessGone(PsutilError):
    """The process exited (psutil.NoSuchProcess, ZombieProcess)."""


class AccessDenied(PsutilError):
    """The OS refused the reading (psutil.AccessDenied)."""


# The parts of psutil's results the source reads, copied into plain tuples the fake returns too.
class MemoryInfo(NamedTuple):
    rss: int


class VirtualMemory(NamedTuple):
    total: int
    available: int
    used: int


class SwapMemory(NamedTuple):
    used: int


class NicCounters(NamedTuple):
    bytes_sent: int = 0
    bytes_recv: int = 0
    errin: int = 0
    errout: int = 0
    dropin: int = 0
    dropout: int = 0


class DiskCounters(NamedTuple):
    read_bytes: int
    write_bytes: int


class Connection(NamedTuple):
    """A TCP socket: its local port, its status ("LISTEN", ...), its owner when the caller may know it."""

    port: int
    status: str
    pid: int | None


class PsutilProcess(Protocol):
    """The psutil.Process calls used; each raises ProcessGone or AccessDenied."""

    @property
    def pid(self) -> int: ...

    def cpu_percent(self) -> float:
        """Per cent of one core since the previous call on this object (interval=None); the first call primes."""

    def memory_info(self) -> MemoryInfo: ...

    def num_threads(self) -> int: ...

    def num_fds(self) -> int: ...

    def cmdline(self) -> list[str]: ...


class Psutil(Protocol):
    """The psutil calls the host source makes, and nothing else."""

    def cpu_percent(self) -> float:
        """psutil.cpu_percent(interval=None): all cores, since the previous call from this thread."""

    def cpu_percent_per_core(self) -> list[float]:
        """psutil.cpu_percent(interval=None, percpu=True)."""

    def getloadavg(self) -> tuple[float, float, float]: ...

    def virtual_memory(self) -> VirtualMemory: ...

    def swap_memory(self) -> SwapMemory: ...

    def net_io_counters(self) -> Mapping[str, NicCounters]:
        """psutil.net_io_counters(pernic=True)."""

    def disk_io_counters(self) -> DiskCounters | None:
        """psutil.disk_io_counters(); None where the kernel exposes no disks (some containers)."""

    def net_connections(self) -> Sequence[Connection]:
        """psutil.net_connections(kind="tcp"); raises AccessDenied where listing needs privileges (macOS)."""

    def process(self, pid: int) -> PsutilProcess:
        """psutil.Process(pid); raises ProcessGone."""

    def process_iter(self) -> Iterator[PsutilProcess]: ...

    def ancestors(self, pid: int) -> list[int]:
        """The pids of a process's parent, grandparent, ...; empty when it is gone or unreadable."""


class _RealProcess:
    """A psutil.Process whose errors are mapped to ProcessGone and AccessDenied."""

    def __init__(self, psutil: Any, process: Any) -> None:
        self._psutil = psutil
        self._process = process
        self.pid: int = process.pid

    def _call(self, method: str) -> Any:
        try:
            return getattr(self._process, method)()
        except self._psutil.NoSuchProcess as exc:  # ZombieProcess too: a zombie runs nothing
            raise ProcessGone(f"process {self.pid} exited") from exc
        except self._psutil.AccessDenied as exc:
            raise AccessDenied(f"{method} of process {self.pid}: access denied") from exc

    def cpu_percent(self) -> float:
        return float(self._call("cpu_percent"))

    def memory_info(self) -> MemoryInfo:
        return MemoryInfo(self._call("memory_info").rss)

    def num_threads(self) -> int:
        return int(self._call("num_threads"))

    def num_fds(self) -> int:
        return int(self._call("num_fds"))

    def cmdline(self) -> list[str]:
        return list(self._call("cmdline"))


class RealPsutil:
    """The real psutil, imported when built, not when this module is."""

    def __init__(self) -> None:
        import psutil  # type: ignore[import-untyped]

        self._psutil: Any = psutil

    def cpu_percent(self) -> float:
        return float(self._psutil.cpu_percent(interval=None))

    def cpu_percent_per_core(self) -> list[float]:
        return [float(v) for v in self._psutil.cpu_percent(interval=None, percpu=True)]

    def getloadavg(self) -> tuple[float, float, float]:
        one, five, fifteen = self._psutil.getloadavg()
        return float(one), float(five), float(fifteen)

    def virtual_memory(self) -> VirtualMemory:
        memory = self._psutil.virtual_memory()
        return VirtualMemory(memory.total, memory.available, memory.used)

    def swap_memory(self) -> SwapMemory:
        return SwapMemory(self._psutil.swap_memory().used)

    def net_io_counters(self) -> Mapping[str, NicCounters]:
        return {nic: NicCounters(c.bytes_sent, c.bytes_recv, c.errin, c.errout, c.dropin, c.dropout)
                for nic, c in self._psutil.net_io_counters(pernic=True).items()}

    def disk_io_counters(self) -> DiskCounters | None:
        disks = self._psutil.disk_io_counters()
        return None if disks is None else DiskCounters(disks.read_bytes, disks.write_bytes)

    def net_connections(self) -> Sequence[Connection]:
        try:
            connections = self._psutil.net_connections(kind="tcp")
        except self._psutil.AccessDenied as exc:
            raise AccessDenied("net_connections: access denied") from exc
        # laddr is an (ip, port) pair for every TCP socket; only the port is used.
        return [Connection(c.laddr[1], c.status, c.pid) for c in connections if c.laddr]

    def process(self, pid: int) -> PsutilProcess:
        try:
            return _RealProcess(self._psutil, self._psutil.Process(pid))
        except self._psutil.NoSuchProcess as exc:
            raise ProcessGone(f"no process {pid}") from exc
        except self._psutil.AccessDenied as exc:
            raise AccessDenied(f"process {pid}: access denied") from exc

    def process_iter(self) -> Iterator[PsutilProcess]:
        for process in self._psutil.process_iter():
            yield _RealProcess(self._psutil, process)

    def ancestors(self, pid: int) -> list[int]:
        try:
            return [p.pid for p in self._psutil.Process(pid).parents()]
        except (self._psutil.NoSuchProcess, self._psutil.AccessDenied):
            return []


@dataclass(frozen=True)
class EngineTarget:
    """How to find one engine's process: by pid, else the TCP port it listens on, else a command-line substring."""

    name: str
    pid: int | None = None
    port: int | None = None
    cmdline: str | None = None


def engine_name_and_port(spec: str) -> tuple[str, int]:
    """The engine name VllmMetricsSource gives an `--engine` spec (`URL` or `NAME=URL`), and its port."""
    name, url = split_named_url(spec)
    hostname, port = url_host_port(url)
    return name or f"{hostname}:{port}", port


def is_local(hostname: str, local_names: Collection[str] = ()) -> bool:
    """Whether a URL's host is this machine: loopback, the unspecified address, localhost or one of local_names."""
    hostname = hostname.lower()
    if hostname == "localhost" or hostname in {n.lower() for n in local_names}:
        return True
    try:
        address = ipaddress.ip_address(hostname)
    except ValueError:
        return False
    return address.is_loopback or address.is_unspecified


def targets_from_engines(engines: Sequence[str], *, local_names: Collection[str] | None = None
                         ) -> list[EngineTarget]:
    """Port targets for the `--engine` specs served from this machine; remote engines get none."""
    names = (socket.gethostname(),) if local_names is None else local_names
    targets = []
    for spec in engines:
        name, port = engine_name_and_port(spec)
        hostname, _ = url_host_port(split_named_url(spec)[1])
        if is_local(hostname, names):
            targets.append(EngineTarget(name, port=port))
    return targets


@dataclass
class _Tracked:
    target: EngineTarget
    process: PsutilProcess | None = None
    next_search: float = -math.inf
    fds_denied: bool = False


class HostSource:
    """One host row per poll, and one process row per engine process found.

    Host cpu_pct is of all cores (0-100), a process's cpu_pct of one core (can pass 100). Both are
    since the previous poll, so the first poll, and the first poll of a newly found process, report NaN.
    open_files is num_fds() (all descriptors, sockets included: one directory listing, where
    open_files() reads every fd's link). net_errors sums errin + errout + dropin + dropout.
    """

    def __init__(self, ctx: SourceContext, *, engines: Sequence[EngineTarget] = (), ps: Psutil | None = None,
                 rediscover_s: float = REDISCOVER_S) -> None:
        self._ctx = ctx
        self._ps: Psutil = ps if ps is not None else RealPsutil()
        self._tracked = [_Tracked(target) for target in engines]
        # vLLM's engine core runs in a child of the API server: a GPU's process maps to its engine through parents.
        ctx.engine_processes.ancestors = self._ps.ancestors
        self._rediscover_s = rediscover_s
        self._cpu_primed = False
        self._counts = {"samples": 0, "processes_found": 0, "processes_lost": 0, "access_denied": 0}

    @property
    def name(self) -> str:
        return "host"

    @property
    def targets(self) -> list[EngineTarget]:
        return [tracked.target for tracked in self._tracked]

    def stats(self) -> Mapping[str, int]:
        return dict(self._counts)

    def poll(self, emit: Emit) -> None:
        """Sample the host and every engine process; re-discover a missing process at most every rediscover_s."""
        ts, now = self._ctx.clock.time(), self._ctx.clock.monotonic()
        stamp = micros(ts)
        rows: list[Row] = []
        failure = None
        try:
            rows.append(self._host_row(stamp))
        except (OSError, PsutilError) as exc:
            failure = f"host readings failed: {type(exc).__name__}: {' '.join(str(exc).split())}"
        for tracked in self._tracked:
            rows.extend(self._process_rows(tracked, stamp, now))
        self._counts["samples"] += sum(isinstance(row, HostSample) for row in rows)
        if rows:
            emit(rows)
        if failure is not None:
            raise SourceError(failure)

    def _host_row(self, stamp: int) -> HostSample:
        ps = self._ps
        # psutil keeps the previous CPU times per calling thread; the runner polls a source from one thread.
        cpu, per_core = ps.cpu_percent(), ps.cpu_percent_per_core()
        if not self._cpu_primed:
            self._cpu_primed = True
            cpu, per_core = UNKNOWN, [UNKNOWN] * len(per_core)
        memory, nics, disk = ps.virtual_memory(), ps.net_io_counters(), ps.disk_io_counters()
        return HostSample(
            stamp, self._ctx.host, "", "host", 0, cpu, per_core, ps.getloadavg()[0],
            memory.used, memory.available, memory.total, ps.swap_memory().used, 0, 0, 0,
            {nic: c.bytes_recv for nic, c in nics.items()},
            {nic: c.bytes_sent for nic, c in nics.items()},
            {nic: c.errin + c.errout + c.dropin + c.dropout for nic, c in nics.items()},
            disk.read_bytes if disk is not None else 0,
            disk.write_bytes if disk is not None else 0,
        )

    def _process_rows(self, tracked: _Tracked, stamp: int, now: float) -> list[Row]:
        rows: list[Row] = []
        fresh = False
        if tracked.process is None:
            if now < tracked.next_search:
                return rows
            found = self._discover(tracked.target)
            if found is None:
                tracked.next_search = now + self._rediscover_s
                return rows
            tracked.process, via = found
            self._ctx.engine_processes.found(tracked.target.name, found[0].pid)
            tracked.fds_denied = False
            fresh = True
            self._counts["processes_found"] += 1
            rows.append(self._event(stamp, tracked.target.name, "engine_process_found", "info",
                                    f"engine {tracked.target.name} runs as process {found[0].pid} (found by {via})",
                                    {"pid": str(found[0].pid), "found_by": via}))
        process = tracked.process
        try:
            cpu = process.cpu_percent()
            rss = process.memory_info().rss
            threads = process.num_threads()
            fds = self._num_fds(tracked, process)
        except ProcessGone:
            tracked.process = None
            self._ctx.engine_processes.lost(process.pid)
            tracked.next_search = now + self._rediscover_s
            self._counts["processes_lost"] += 1
            rows.append(self._event(stamp, tracked.target.name, "engine_process_lost", "warning",
                                    f"engine {tracked.target.name} process {process.pid} exited",
                                    {"pid": str(process.pid)}))
            return rows
        except AccessDenied:
            self._counts["access_denied"] += 1
            return rows
        rows.append(HostSample(stamp, self._ctx.host, tracked.target.name, "process", process.pid,
                               UNKNOWN if fresh else cpu, [], 0.0, 0, 0, 0, 0, rss, threads, fds, {}, {}, {}, 0, 0))
        return rows

    def _num_fds(self, tracked: _Tracked, process: PsutilProcess) -> int:
        # Another user's /proc/PID/fd is unreadable; after one refusal stop asking (and counting).
        if tracked.fds_denied:
            return 0
        try:
            return process.num_fds()
        except AccessDenied:
            tracked.fds_denied = True
            self._counts["access_denied"] += 1
            return 0

    def _discover(self, target: EngineTarget) -> tuple[PsutilProcess, str] | None:
        if target.pid is not None and (process := self._open(target.pid)) is not None:
            return process, "pid"
        if target.port is not None and (pid := self._listening_pid(target.port)) is not None \
                and (process := self._open(pid)) is not None:
            return process, "port"
        if target.cmdline and (pid := self._cmdline_pid(target.cmdline)) is not None \
                and (process := self._open(pid)) is not None:
            return process, "cmdline"
        return None

    def _open(self, pid: int) -> PsutilProcess | None:
        try:
            process = self._ps.process(pid)
            process.cpu_percent()  # primes the per-object CPU baseline; this first value means nothing
        except ProcessGone:
            return None
        except AccessDenied:
            self._counts["access_denied"] += 1
            return None
        return process

    def _listening_pid(self, port: int) -> int | None:
        try:
            connections = self._ps.net_connections()
        except AccessDenied:
            self._counts["access_denied"] += 1
            return None
        listening = [c for c in connections if c.status == "LISTEN" and c.port == port]
        pids = [c.pid for c in listening if c.pid is not None]
        if listening and not pids:
            # Linux lists another user's sockets without their pid: a refusal in all but name.
            self._counts["access_denied"] += 1
        # Several pids share a port with SO_REUSEPORT or a forked server; the lowest is usually the parent.
        return min(pids, default=None)

    def _cmdline_pid(self, substring: str) -> int | None:
        own = os.getpid()  # the collector's own command line may name the engine
        pids = []
        for process in self._ps.process_iter():
            try:
                if process.pid != own and substring in " ".join(process.cmdline()):
                    pids.append(process.pid)
            except PsutilError:  # gone since listed, or a process we may not read
                continue
        return min(pids, default=None)

    def _event(self, stamp: int, engine: str, kind: str, severity: str, message: str,
               attributes: dict[str, str]) -> Event:
        return Event(stamp, self._ctx.host, engine, "host", kind, severity, message, attributes)
