"""Which engine uses a GPU: the process ids NVML reports, resolved to engines once per process, in either PID
namespace.

Whether nvmlDeviceGetComputeRunningProcesses reports host PIDs or the caller's namespace PIDs depends on the driver
(older drivers: host PIDs; newer ones translate to the caller's namespace). The engine PIDs stepline knows are the
collector's own namespace's (psutil, the settings), so a PID NVML reports is tried as it is, then translated from the
host's namespace through the NSpid line of a host /proc where one is mounted (`host_proc`, e.g. /host/proc).
Where NVML's PIDs are not visible from here at all (a sidecar in its own PID namespace on an older driver, no host
/proc), what survives namespaces is the GPU's UUID (`EngineGpus`): the GPUs each engine process's environment names
(NVIDIA_VISIBLE_DEVICES, CUDA_VISIBLE_DEVICES), then the explicit setting (STEPLINE_ENGINE_GPUS).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import NamedTuple, Protocol

LOOKUPS_PER_POLL = 4  # PIDs resolved (each a walk up its parents) per poll at most; the rest wait for the next polls
MAX_CACHED_PIDS = 4096


class PidView(Protocol):
    """What this collector can see of a process id NVML reported."""

    def start_time(self, pid: int) -> int | None:
        """The process's start time (clock ticks since boot), or None when no such pid is visible here."""

    def local_pid(self, host_pid: int) -> int | None:
        """This namespace's pid for a host pid, where a host /proc shows its NSpid; None otherwise."""

    def environ(self, pid: int) -> Mapping[str, str] | None:
        """The environment the process started with, or None when it is not visible or not readable here."""


class ProcPidView:
    """PidView over /proc, and over a host /proc when one is mounted (`host_proc`)."""

    def __init__(self, proc: str = "/proc", host_proc: str | None = None) -> None:
        self._proc = proc
        self._host_proc = host_proc

    def start_time(self, pid: int) -> int | None:
        return _start_time(self._proc, pid)

    def environ(self, pid: int) -> Mapping[str, str] | None:
        # Readable by the process's user (ptrace read access): a sidecar running as another user gets None.
        try:
            with open(f"{self._proc}/{pid}/environ", "rb") as f:
                raw = f.read()
        except OSError:
            return None
        pairs = (item.decode("utf-8", "replace").partition("=") for item in raw.split(b"\0") if item)
        return {name: value for name, sep, value in pairs if sep}

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
    visible: bool  # here, or through a host /proc


class EngineLookup:
    """Engine names for GPUs from their processes; each PID is resolved once and its answer ("nothing" included) kept
    until the PID's start time or the set of engine processes changes.

    Start times are read only when a GPU's set of PIDs changes: a PID reused between two polls while the set stays
    the same is the one case this misses, and CUDA takes longer than a poll to open a context.
    """

    def __init__(self, engine_of_pid: Callable[[int], str], view: PidView, *,
                 generation: Callable[[], int] = lambda: 0, engine_of_gpu: Callable[[str], str] = lambda uuid: "",
                 engine_of_hidden_gpu: Callable[[str], str] = lambda uuid: "",
                 gpu_generation: Callable[[], int] = lambda: 0,
                 per_poll: int = LOOKUPS_PER_POLL, max_pids: int = MAX_CACHED_PIDS) -> None:
        self._engine_of_pid = engine_of_pid
        self._view = view
        self._generation = generation
        self._engine_of_gpu = engine_of_gpu
        self._engine_of_hidden_gpu = engine_of_hidden_gpu
        self._gpu_generation = gpu_generation  # changes when engine_of_gpu's answers do (the pod-resources map)
        self._per_poll = per_poll
        self._max_pids = max_pids
        self._budget = per_poll
        self._pids: dict[int, _Resolved] = {}
        # GPU index -> (its pids, generation, GPU map generation, engine)
        self._gpus: dict[int, tuple[frozenset[int], int, int, str]] = {}
        self.lookups = 0  # PIDs resolved so far, for tests and benchmarks

    def new_poll(self) -> None:
        """Start a poll: a fresh budget of PID resolutions."""
        self._budget = self._per_poll

    def engine(self, gpu_index: int, gpu_uuid: str, pids: Collection[int]) -> str | None:
        """The engine using this GPU, "" for none, None while some of its PIDs wait for this poll's budget."""
        key, generation, gpu_generation = frozenset(pids), self._generation(), self._gpu_generation()
        known = self._gpus.get(gpu_index)
        if known is not None and known[:3] == (key, generation, gpu_generation):
            return known[3]  # the same processes as before: no /proc read, no lookup
        engine = ""
        for pid in sorted(key):
            found = self._pid(pid, generation)
            if found is None:
                return None
            if found:
                engine = found
                break
        else:
            # Environments say which GPUs an engine may use, not which it does: they decide only for a GPU whose
            # processes are not all visible here (an idle GPU, or one whose visible processes are no engine's, is not
            # an engine's by its environment). The explicit setting (engine_of_gpu) decides last, for every GPU.
            hidden = any((r := self._pids.get(pid)) is None or not r.visible for pid in key)
            engine = (self._engine_of_hidden_gpu(gpu_uuid) if hidden else "") or self._engine_of_gpu(gpu_uuid)
        self._gpus[gpu_index] = (key, generation, gpu_generation, engine)
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
        visible = started is not None
        if not engine:
            local = self._view.local_pid(pid)  # a host pid (older drivers) seen from a nested namespace
            visible = visible or local is not None
            if local is not None and local != pid:
                engine = self._engine_of_pid(local)
        self._pids.pop(pid, None)
        if len(self._pids) >= self._max_pids:
            del self._pids[next(iter(self._pids))]  # the oldest answer goes first
        self._pids[pid] = _Resolved(started, generation, engine, visible)
        return engine


class Device(NamedTuple):
    """A GPU as this collector's NVML sees it."""

    uuid: str
    name: str


NVIDIA_VISIBLE = "NVIDIA_VISIBLE_DEVICES"  # the container runtime's: which host GPUs a container gets
CUDA_VISIBLE = "CUDA_VISIBLE_DEVICES"  # CUDA's: which of the GPUs the process can see it uses
_GPU_VARIABLES = (NVIDIA_VISIBLE, CUDA_VISIBLE, "CUDA_DEVICE_ORDER")
_NO_DEVICE_SET = ("none", "void")  # none: no GPU from the runtime; void: the runtime left it to others (CDI)


def _is_uuid(entry: str) -> bool:
    return entry.startswith("GPU-") and len(entry) > 4


def _container_gpus(nvidia: str | None, own_nvidia: str | None, devices: Sequence[Device] | None) -> (
        tuple[frozenset[str], list[Device] | None] | None):
    """The GPUs a process's container sees, from its NVIDIA_VISIBLE_DEVICES beside ours, and in NVML's (PCI bus) order
    where that is known; None when its environment cannot tell."""
    entries = [e.strip() for e in (nvidia or "").split(",") if e.strip()]
    if entries and all(map(_is_uuid, entries)):  # UUIDs name the same GPUs in every namespace
        named = [d for d in devices if d.uuid in entries] if devices is not None else None
        return frozenset(entries), named
    if devices is None:  # indices need every GPU we see, in order
        return None
    # Indices are renumbered inside a container (its GPUs are 0..n-1 there), so they are trusted only when the process
    # sees the same device set as we do: the same NVIDIA_VISIBLE_DEVICES ("all", or the same list; unset on both: no
    # container runtime between us, as on bare metal or in one container), or ours "all" and its a list of host
    # indices, which are NVML's indices on the host, and ours too when we see every host GPU.
    if nvidia == own_nvidia and (nvidia or "").strip().lower() not in _NO_DEVICE_SET:
        seen = list(devices)
    elif (own_nvidia or "").strip().lower() == "all" and entries and all(e.isdigit() for e in entries):
        if any(int(e) >= len(devices) for e in entries):
            return None
        seen = [devices[int(e)] for e in entries]
    else:
        return None
    return frozenset(d.uuid for d in seen), seen


def used_gpus(environ: Mapping[str, str], own_environ: Mapping[str, str], devices: Sequence[Device] | None) -> (
        frozenset[str]):
    """The GPUs (UUIDs, or UUID prefixes as CUDA accepts them) a process with this environment uses, as far as its
    environment tells; `devices`: every GPU we see in NVML's order, None while some GPU could not be read."""
    container = _container_gpus(environ.get(NVIDIA_VISIBLE), own_environ.get(NVIDIA_VISIBLE), devices)
    cuda = environ.get(CUDA_VISIBLE)
    if cuda is None:
        return container[0] if container is not None else frozenset()
    seen = container[1] if container is not None else None
    # CUDA numbers the GPUs it sees fastest first unless CUDA_DEVICE_ORDER=PCI_BUS_ID; among GPUs of one model (a
    # server's usual) that is NVML's PCI bus order in practice, though CUDA's documentation leaves it unspecified.
    pci_order = environ.get("CUDA_DEVICE_ORDER") == "PCI_BUS_ID"
    by_index = seen is not None and (pci_order or len({d.name for d in seen}) <= 1)
    used: set[str] = set()
    for entry in (e.strip() for e in cuda.split(",")):
        if _is_uuid(entry):  # CUDA takes a unique prefix of a UUID too
            matches = [d.uuid for d in devices if d.uuid.startswith(entry)] if devices is not None else [entry]
            used.update(matches if len(matches) == 1 else ())
        elif entry.startswith("MIG-"):
            continue  # a MIG instance's UUID, not its GPU's: not matched here
        elif entry.isdigit():
            if by_index and seen is not None and int(entry) < len(seen):
                used.add(seen[int(entry)].uuid)
        else:
            break  # CUDA ignores everything from the first invalid entry (-1 included) on
    return frozenset(used)


class EngineGpus:
    """GPU UUID -> engine where NVML's PIDs are not visible here: the GPUs each engine process's environment names
    (read once per process start), then the explicit setting; a GPU two engines' environments name goes to the setting.
    """

    def __init__(self, engines: Callable[[], Mapping[int, str]], view: PidView, *,
                 configured: Mapping[str, str] | None = None, own_environ: Mapping[str, str] | None = None) -> None:
        self._engines = engines  # pid -> engine, as the host source found them
        self._view = view
        self._configured = dict(configured or {})  # GPU UUID -> engine (STEPLINE_ENGINE_GPUS)
        own = os.environ if own_environ is None else own_environ
        self._own = {name: own[name] for name in _GPU_VARIABLES if name in own}
        self._environs: dict[int, tuple[int | None, dict[str, str] | None]] = {}  # pid -> (start, its GPU variables)
        self.environ_reads = 0

    def by_environ(self, uuid: str, devices: Sequence[Device] | None = None) -> str:
        """The one engine whose process environment names this GPU, or ""."""
        engines = self._engines()
        for pid in set(self._environs) - set(engines):
            del self._environs[pid]
        claims = set()
        for pid, engine in engines.items():
            environ = self._environ(pid)
            if environ is not None and uuid and any(uuid.startswith(gpu) for gpu in used_gpus(environ, self._own,
                                                                                               devices)):
                claims.add(engine)
        return claims.pop() if len(claims) == 1 else ""

    def configured(self, uuid: str) -> str:
        """The engine the setting gives this GPU, or ""."""
        return self._configured.get(uuid, "")

    def _environ(self, pid: int) -> dict[str, str] | None:
        started = self._view.start_time(pid)
        cached = self._environs.get(pid)
        if cached is not None and cached[0] == started:
            return cached[1]
        self.environ_reads += 1
        environ = self._view.environ(pid)  # None: not readable here, which says nothing (unlike a variable unset)
        found = None if environ is None else {name: environ[name] for name in _GPU_VARIABLES if name in environ}
        self._environs[pid] = (started, found)
        return found


class PodGpus:
    """GPU UUID -> engine from the kubelet's pod-resources API (the node role): the pod each GPU is allocated to,
    named by its pod name (the name the sidecar beside it gives its engine); replaced whole on every refresh."""

    def __init__(self) -> None:
        self._engines: dict[str, str] = {}
        self._lock = threading.Lock()
        self._generation = 0

    def replace(self, engines: Mapping[str, str]) -> None:
        with self._lock:
            if engines != self._engines:
                self._engines = dict(engines)
                self._generation += 1

    def generation(self) -> int:
        """A number that changes whenever the map does: engines cached before are stale."""
        with self._lock:
            return self._generation

    def engine(self, uuid: str) -> str:
        """The engine whose pod holds this GPU, or ""."""
        with self._lock:
            return self._engines.get(uuid, "")
