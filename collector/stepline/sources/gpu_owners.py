"""Which engine uses a GPU: the process ids NVML reports, resolved to engines once per process, in either PID
namespace.

Whether nvmlDeviceGetComputeRunningProcesses reports host PIDs or the caller's namespace PIDs depends on the driver
(older drivers: host PIDs; newer ones translate to the caller's namespace). The engine PIDs stepline knows are the
collector's own namespace's (psutil, the settings), so a PID NVML reports is tried as it is, then translated from the
host's namespace through the NSpid line of a host /proc where one is mounted (`host_proc`, e.g. /host/proc).
Where NVML's PIDs are not visible from here at all (a sidecar in its own PID namespace on an older driver, no host
/proc), nothing ties them to an engine: what survives namespaces is the GPU's UUID, and tying GPUs to engines by UUID
(the kubelet's pod-resources API) belongs to the deployment issue (issue 16). `engine_of_gpu` is its hook.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from typing import NamedTuple, Protocol

LOOKUPS_PER_POLL = 4  # PIDs resolved (each a walk up its parents) per poll at most; the rest wait for the next polls
MAX_CACHED_PIDS = 4096


class PidView(Protocol):
    """What this collector can see of a process id NVML reported."""

    def start_time(self, pid: int) -> int | None:
        """The process's start time (clock ticks since boot), or None when no such pid is visible here."""

    def local_pid(self, host_pid: int) -> int | None:
        """This namespace's pid for a host pid, where a host /proc shows its NSpid; None otherwise."""


class ProcPidView:
    """PidView over /proc, and over a host /proc when one is mounted (`host_proc`)."""

    def __init__(self, proc: str = "/proc", host_proc: str | None = None) -> None:
        self._proc = proc
        self._host_proc = host_proc

    def start_time(self, pid: int) -> int | None:
        return _start_time(self._proc, pid)

    def local_pid(self, host_pid: int) -> int | None:
        if self._host_proc is None:
            return None
        started = _start_time(self._host_proc, host_pid)
        try:
            with open(f"{self._host_proc}/{host_pid}/status", encoding="ascii", errors="replace") as f:
                line = next((line for line in f if line.startswith("NSpid:")), "")
        except OSError:
            return None
        # NSpid: the pid in the host's namespace first, then in each nested one. Ours is the one whose process here
        # started when the host's did (a pid number alone may belong to another process in another namespace).
        for pid in (int(p) for p in reversed(line.split()[1:])):
            if started is not None and _start_time(self._proc, pid) == started:
                return pid
        return None


def _start_time(proc: str, pid: int) -> int | None:
    try:
        with open(f"{proc}/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    # Field 22 (starttime), counted after the command name, which may itself hold spaces and parentheses.
    fields = stat[stat.rfind(b")") + 2:].split()
    try:
        return int(fields[19])
    except (IndexError, ValueError):
        return None


class _Resolved(NamedTuple):
    started: int | None
    generation: int
    engine: str


class EngineLookup:
    """Engine names for GPUs from their processes; each PID is resolved once and its answer ("nothing" included) kept
    until the PID's start time or the set of engine processes changes.

    Start times are read only when a GPU's set of PIDs changes: a PID reused between two polls while the set stays
    the same is the one case this misses, and CUDA takes longer than a poll to open a context.
    """

    def __init__(self, engine_of_pid: Callable[[int], str], view: PidView, *,
                 generation: Callable[[], int] = lambda: 0, engine_of_gpu: Callable[[str], str] = lambda uuid: "",
                 per_poll: int = LOOKUPS_PER_POLL, max_pids: int = MAX_CACHED_PIDS) -> None:
        self._engine_of_pid = engine_of_pid
        self._view = view
        self._generation = generation
        self._engine_of_gpu = engine_of_gpu
        self._per_poll = per_poll
        self._max_pids = max_pids
        self._budget = per_poll
        self._pids: dict[int, _Resolved] = {}
        self._gpus: dict[int, tuple[frozenset[int], int, str]] = {}  # GPU index -> (its pids, generation, engine)
        self.lookups = 0  # PIDs resolved so far, for tests and benchmarks

    def new_poll(self) -> None:
        """Start a poll: a fresh budget of PID resolutions."""
        self._budget = self._per_poll

    def engine(self, gpu_index: int, gpu_uuid: str, pids: Collection[int]) -> str | None:
        """The engine using this GPU, "" for none, None while some of its PIDs wait for this poll's budget."""
        key, generation = frozenset(pids), self._generation()
        known = self._gpus.get(gpu_index)
        if known is not None and known[0] == key and known[1] == generation:
            return known[2]  # the same processes as before: no /proc read, no lookup
        engine = ""
        for pid in sorted(key):
            found = self._pid(pid, generation)
            if found is None:
                return None
            if found:
                engine = found
                break
        else:
            engine = self._engine_of_gpu(gpu_uuid)
        self._gpus[gpu_index] = (key, generation, engine)
        return engine

    def _pid(self, pid: int, generation: int) -> str | None:
        started = self._view.start_time(pid)
        cached = self._pids.get(pid)
        if cached is not None and cached.generation == generation and cached.started == started:
            return cached.engine
        if self._budget <= 0:
            return None
        self._budget -= 1
        self.lookups += 1
        # As reported first (newer drivers, or this collector in the host's namespace); a pid not visible here is
        # asked too, as it costs a failed parent walk: the engine pids given in the settings need not be visible.
        engine = self._engine_of_pid(pid)
        if not engine:
            local = self._view.local_pid(pid)  # a host pid (older drivers) seen from a nested namespace
            if local is not None and local != pid:
                engine = self._engine_of_pid(local)
        self._pids.pop(pid, None)
        if len(self._pids) >= self._max_pids:
            del self._pids[next(iter(self._pids))]  # the oldest answer goes first
        self._pids[pid] = _Resolved(started, generation, engine)
        return engine


class FakePidView:
    """A PidView for tests: `started` pid -> start time of the processes visible here; `local` host pid -> this
    namespace's pid, as a mounted host /proc would tell (empty: none mounted)."""

    def __init__(self, started: dict[int, int] | None = None, local: dict[int, int] | None = None) -> None:
        self.started = dict(started or {})
        self.local = dict(local or {})
        self.reads = 0

    def start_time(self, pid: int) -> int | None:
        self.reads += 1
        return self.started.get(pid)

    def local_pid(self, host_pid: int) -> int | None:
        return self.local.get(host_pid)
