"""How a running collector is found: what it announces about itself, in two files of one format.

The runtime file, `collector-<pid>.json` in `runtime_dir()`, is how the CLI finds the collector from any directory:
its pid and that process's start time (so a reused pid is not taken for it), the store it writes (never with a
password), its read-only query endpoint (embedded stores only), its /metrics, and its events endpoint with the token
made for it at start (the file is the user's alone: mode 0600). A reader ignores, says so, and removes a file whose
process is gone (a collector killed with -9).

The file beside an embedded store, `<store>/stepline-collector.json`, is how a reader that finds the store held (see
`locking`) learns by whom and where to query it instead: whoever can read the store directory finds it, whatever
their runtime directory (another user, a container sharing the volume). It holds no secret, only the pid, the query
endpoint, whether it asks for a password, and the /metrics.

A collector writes both when it starts (atomically: a reader never sees half a file) and removes them when it stops
cleanly.

`runtime_dir()`: $XDG_RUNTIME_DIR/stepline (per user, gone at logout), else $XDG_CACHE_HOME/stepline, else
~/.cache/stepline.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from stepline.store.url import DEFAULT_DATABASE, DEFAULT_STORE_DIR, StoreUrl

log = logging.getLogger(__name__)

RUNTIME_DIR_HELP = "$XDG_RUNTIME_DIR/stepline, else ~/.cache/stepline"
BESIDE_STORE_FILE = "stepline-collector.json"


@dataclass(frozen=True)
class RunningCollector:
    """What a collector announces about itself.

    Its runtime file holds every field but `password_required`; the file beside its store holds `pid`, `query_url`,
    `metrics_url` and `password_required`. A field the file read does not hold is at its default.
    """

    pid: int
    started: str = ""  # the process's start time in clock ticks since boot (/proc/PID/stat), "" where unknown
    started_at: float = 0.0  # wall clock, to pick the newest of several
    store: str = ""  # the store URL without its password
    query_url: str = ""  # "" for a server store: the CLI reads the server itself
    metrics_url: str = ""
    events_url: str = ""  # where the CLI hands events (matrix runs) to the collector, "" when it takes none
    events_token: str = field(default="", repr=False)  # that endpoint's token: only in the owner-only runtime file
    password_required: bool = False  # the query endpoint asks for $STEPLINE_QUERY_PASSWORD


@dataclass(frozen=True)
class _Format:
    """One of the two files: the fields it holds (in the order written), those it cannot do without, its mode."""

    fields: tuple[str, ...]
    required: tuple[str, ...]
    mode: int


_RUNTIME_FILE = _Format(("pid", "started", "started_at", "store", "query_url", "metrics_url", "events_url",
                         "events_token"), ("pid", "store"), 0o600)
# Readable by whoever may read the store (0o666 less the umask, as open() makes files): it holds no secret.
_BESIDE_STORE = _Format(("pid", "query_url", "metrics_url", "password_required"), ("pid", "query_url"), 0o666)
_PARSE: dict[str, Callable[[Any], Any]] = {
    "pid": int, "started": str, "started_at": float, "store": str, "query_url": str, "metrics_url": str,
    "events_url": str, "events_token": str, "password_required": bool,
}


def _write(path: Path, info: RunningCollector, fmt: _Format) -> None:
    """Write `info` as `fmt` says, atomically: a reader never sees half of it."""
    tmp = path.with_name(f".{path.name}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, fmt.mode)
    with os.fdopen(fd, "w", encoding="utf-8") as fh:
        json.dump({name: getattr(info, name) for name in fmt.fields}, fh)
    os.replace(tmp, path)


def _read(path: Path, fmt: _Format) -> RunningCollector:
    """The announcement in `path`; raises OSError, ValueError, KeyError or TypeError where it is gone or unreadable."""
    raw = json.loads(path.read_text(encoding="utf-8"))
    return RunningCollector(**{name: _PARSE[name](raw[name]) for name in fmt.fields
                               if name in fmt.required or name in raw})


@dataclass(frozen=True)
class LocatedStore:
    """The store the CLI reads, and how it was chosen (for one line on stderr)."""

    url: str
    source: str
    collector: RunningCollector | None = None
    runtime_file: Path | None = None
    searched: Path | None = None  # the runtime directory that named no running collector, when it came to that


def runtime_dir(environ: Mapping[str, str] | None = None) -> Path:
    """Where runtime files live (see the module docstring)."""
    env = os.environ if environ is None else environ
    if env.get("XDG_RUNTIME_DIR"):
        return Path(env["XDG_RUNTIME_DIR"]) / "stepline"
    cache = env.get("XDG_CACHE_HOME") or os.path.join(env.get("HOME") or os.path.expanduser("~"), ".cache")
    return Path(cache) / "stepline"


def store_without_password(url: StoreUrl) -> str:
    """The store URL as a runtime file may hold it: everything the CLI needs to reach it but the password."""
    if url.embedded:
        return f"chdb://{url.path}" + (f"?database={url.database}" if url.database != DEFAULT_DATABASE else "")
    return url.redacted()


def announce(store: str, query_url: str, metrics_url: str, directory: Path | None = None, *, events_url: str = "",
             events_token: str = "") -> Path:
    """Write this process's runtime file; returns its path."""
    folder = directory or runtime_dir()
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    pid = os.getpid()
    info = RunningCollector(pid, process_started(pid), time.time(), store, query_url, metrics_url, events_url,
                            events_token)
    path = folder / f"collector-{pid}.json"
    _write(path, info, _RUNTIME_FILE)
    return path


def withdraw(path: Path) -> None:
    """Remove a runtime file this process wrote."""
    with contextlib.suppress(FileNotFoundError):
        path.unlink()


def running(directory: Path | None = None) -> tuple[list[tuple[Path, RunningCollector]], list[Path]]:
    """The live collectors' runtime files, newest first, and the stale ones (process gone, or unreadable)."""
    folder = directory or runtime_dir()
    alive: list[tuple[Path, RunningCollector]] = []
    stale: list[Path] = []
    try:
        paths = sorted(folder.glob("collector-*.json"))
    except OSError:
        return [], []
    for path in paths:
        try:
            info = _read(path, _RUNTIME_FILE)
        except FileNotFoundError:
            continue  # removed by its collector while we looked
        except (OSError, ValueError, KeyError, TypeError):
            stale.append(path)
            continue
        if is_alive(info.pid, info.started):
            alive.append((path, info))
        else:
            stale.append(path)
    alive.sort(key=lambda item: item[1].started_at, reverse=True)
    return alive, stale


def is_alive(pid: int, started: str) -> bool:
    """Whether `pid` runs and is the process that started at `started` (when both start times are known)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # another user's process: it exists
    now = process_started(pid)
    return not (started and now and started != now)


def process_started(pid: int) -> str:
    """The process's start time in clock ticks since boot, from /proc; "" where there is no /proc."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text(encoding="ascii", errors="replace")
    except OSError:
        return ""
    # The command name (field 2) is in parentheses and may hold spaces: count fields after the last ')'.
    fields = stat.rsplit(")", 1)[-1].split()
    return fields[19] if len(fields) > 19 else ""


def locate_store(explicit: str | None, environ: Mapping[str, str] | None = None, cwd: str | None = None,
                 directory: Path | None = None) -> LocatedStore:
    """The store the CLI reads: --store, else $STEPLINE_STORE, else ./stepline-data when it exists, else the store
    of the running collector (its runtime file), else ./stepline-data (whose absence the reader reports)."""
    env = os.environ if environ is None else environ
    if explicit:
        return LocatedStore(explicit, "--store")
    if env.get("STEPLINE_STORE"):
        return LocatedStore(env["STEPLINE_STORE"], "$STEPLINE_STORE")
    here = os.path.join(cwd or os.getcwd(), DEFAULT_STORE_DIR)
    default = f"chdb://{os.path.abspath(here)}"
    if os.path.isdir(here):
        return LocatedStore(default, f"./{DEFAULT_STORE_DIR}")
    alive, stale = running(directory)
    for path in stale:
        print(f"stepline: ignoring {path}: the collector it names is not running (removed)", file=sys.stderr)
        withdraw(path)
    if not alive:
        return LocatedStore(default, f"./{DEFAULT_STORE_DIR}", searched=directory or runtime_dir())
    path, info = alive[0]
    if len(alive) > 1:
        others = ", ".join(f"pid {c.pid} ({c.store})" for _, c in alive[1:])
        print(f"stepline: {len(alive)} collectors are running; reading the newest, pid {info.pid} ({info.store}); "
              f"the others: {others}; --store picks one", file=sys.stderr)
    return LocatedStore(info.store, f"the running collector's runtime file {path}", info, path)


def collector_for(store: str, directory: Path | None = None) -> RunningCollector | None:
    """The running collector that writes `store` (a URL without its password), if one announced itself."""
    alive, _ = running(directory)
    return next((info for _, info in alive if info.store == store), None)


def announce_beside_store(store_dir: str, query_url: str, metrics_url: str, password_required: bool) -> None:
    """Write this process's announcement beside the embedded store it holds."""
    info = RunningCollector(os.getpid(), query_url=query_url, metrics_url=metrics_url,
                            password_required=password_required)
    _write(Path(store_dir) / BESIDE_STORE_FILE, info, _BESIDE_STORE)


def read_beside_store(store_dir: str) -> RunningCollector | None:
    """The announcement of the collector holding `store_dir`, if one is there and readable."""
    try:
        return _read(Path(store_dir) / BESIDE_STORE_FILE, _BESIDE_STORE)
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError) as exc:
        log.warning("ignoring unreadable %s in %s: %s", BESIDE_STORE_FILE, store_dir, exc)
        return None


def withdraw_beside_store(store_dir: str) -> None:
    """Remove the announcement this process wrote beside its store."""
    withdraw(Path(store_dir) / BESIDE_STORE_FILE)
