"""Whether another process holds an embedded store: probed before chDB tries to open it."""

from __future__ import annotations

import fcntl
import os


def embedded_store_locked(store_dir: str) -> bool:
    """Whether another process has the embedded ClickHouse at `store_dir` open.

    ClickHouse holds an exclusive flock on `status` for as long as its engine runs (StatusFile in
    ClickHouse's src/Common/StatusFile.cpp); probing it tells "busy" apart from every other failure before chDB
    prints its own noise.
    """
    status = os.path.join(store_dir, "status")
    if _open_in_this_process(status):
        return False  # chDB shares its engine within a process: this process may open it again
    try:
        fd = os.open(status, os.O_RDONLY)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    else:
        fcntl.flock(fd, fcntl.LOCK_UN)
        return False
    finally:
        os.close(fd)


def _open_in_this_process(path: str) -> bool:
    real = os.path.realpath(path)
    try:
        fds = os.listdir("/proc/self/fd")
    except OSError:
        return False
    for fd in fds:
        try:
            if os.readlink(f"/proc/self/fd/{fd}") == real:
                return True
        except OSError:
            continue
    return False
