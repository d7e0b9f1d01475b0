"""A fake /proc for the GPU source's process attribution: which processes this namespace sees, since when, with
which environment, and how a mounted host /proc maps host pids (`sources.gpu.owners.PidView`)."""

from __future__ import annotations

from collections.abc import Mapping


class FakePidView:
    """A PidView for tests: `started` pid -> start time of the processes visible here; `local` host pid -> this
    namespace's pid, as a mounted host /proc would tell (empty: none mounted)."""

    def __init__(self, started: dict[int, int] | None = None, local: dict[int, int] | None = None,
                 environs: dict[int, dict[str, str]] | None = None) -> None:
        self.started = dict(started or {})
        self.local = dict(local or {})
        self.environs = dict(environs or {})
        self.reads = 0
        self.environ_reads = 0

    def start_time(self, pid: int) -> int | None:
        self.reads += 1
        return self.started.get(pid)

    def local_pid(self, host_pid: int) -> int | None:
        return self.local.get(host_pid)

    def environ(self, pid: int) -> Mapping[str, str] | None:
        self.environ_reads += 1
        return self.environs.get(pid)
