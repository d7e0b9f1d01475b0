"""A psutil double for the host source: settable readings, processes that exit, refusals on demand."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field

from stepline.sources.host import (
    AccessDenied,
    Connection,
    DiskCounters,
    MemoryInfo,
    NicCounters,
    ProcessGone,
    PsutilProcess,
    SwapMemory,
    VirtualMemory,
)


@dataclass
class FakeProcess:
    """One process; `exited` makes every call raise ProcessGone, `denied` refuses num_fds and cmdline."""

    pid: int
    args: list[str] = field(default_factory=list)
    cpu: float = 0.0
    rss: int = 0
    threads: int = 1
    fds: int = 0
    exited: bool = False
    denied: bool = False

    def _alive(self) -> None:
        if self.exited:
            raise ProcessGone(f"process {self.pid} exited")

    def cpu_percent(self) -> float:
        self._alive()
        return self.cpu

    def memory_info(self) -> MemoryInfo:
        self._alive()
        return MemoryInfo(self.rss)

    def num_threads(self) -> int:
        self._alive()
        return self.threads

    def num_fds(self) -> int:
        self._alive()
        if self.denied:
            raise AccessDenied(f"num_fds of process {self.pid}: access denied")
        return self.fds

    def cmdline(self) -> list[str]:
        self._alive()
        if self.denied:
            raise AccessDenied(f"cmdline of process {self.pid}: access denied")
        return list(self.args)


class FakePsutil:
    """Every reading is a plain attribute; `calls` counts the calls by name."""

    def __init__(self, cores: int = 2) -> None:
        self.cpu = 0.0
        self.per_core = [0.0] * cores
        self.load = (0.0, 0.0, 0.0)
        self.memory = VirtualMemory(total=0, available=0, used=0)
        self.swap = SwapMemory(used=0)
        self.nics: dict[str, NicCounters] = {}
        self.disk: DiskCounters | None = None
        self.processes: dict[int, FakeProcess] = {}
        self.parents: dict[int, int] = {}  # pid -> parent pid, for ancestors()
        self.connections: list[Connection] = []
        self.connections_denied = False
        self.calls: Counter[str] = Counter()

    def add_process(self, pid: int, args: Sequence[str] = (), *, cpu: float = 0.0, rss: int = 0, threads: int = 1,
                    fds: int = 0) -> FakeProcess:
        """A running process."""
        process = FakeProcess(pid, list(args), cpu, rss, threads, fds)
        self.processes[pid] = process
        return process

    def listen(self, port: int, pid: int | None, *, status: str = "LISTEN") -> None:
        """A TCP socket on port (LISTEN unless told); pid None is how Linux lists another user's socket."""
        self.connections.append(Connection(port, status, pid))

    def exit(self, pid: int) -> None:
        """The process exits: its calls raise ProcessGone, its sockets close, new lookups miss it."""
        self.processes.pop(pid).exited = True
        self.connections = [c for c in self.connections if c.pid != pid]

    def cpu_percent(self) -> float:
        self.calls["cpu_percent"] += 1
        return self.cpu

    def cpu_percent_per_core(self) -> list[float]:
        self.calls["cpu_percent_per_core"] += 1
        return list(self.per_core)

    def getloadavg(self) -> tuple[float, float, float]:
        self.calls["getloadavg"] += 1
        return self.load

    def virtual_memory(self) -> VirtualMemory:
        self.calls["virtual_memory"] += 1
        return self.memory

    def swap_memory(self) -> SwapMemory:
        self.calls["swap_memory"] += 1
        return self.swap

    def net_io_counters(self) -> Mapping[str, NicCounters]:
        self.calls["net_io_counters"] += 1
        return dict(self.nics)

    def disk_io_counters(self) -> DiskCounters | None:
        self.calls["disk_io_counters"] += 1
        return self.disk

    def net_connections(self) -> Sequence[Connection]:
        self.calls["net_connections"] += 1
        if self.connections_denied:
            raise AccessDenied("net_connections: access denied")
        return list(self.connections)

    def process(self, pid: int) -> PsutilProcess:
        self.calls["process"] += 1
        if pid not in self.processes:
            raise ProcessGone(f"no process {pid}")
        return self.processes[pid]

    def process_iter(self) -> Iterator[PsutilProcess]:
        self.calls["process_iter"] += 1
        yield from list(self.processes.values())

    def ancestors(self, pid: int) -> list[int]:
        chain, current = [], self.parents.get(pid)
        while current is not None and current not in chain:
            chain.append(current)
            current = self.parents.get(current)
        return chain
