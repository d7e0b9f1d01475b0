"""The flock probe: a store another process holds is locked; one this process holds, or none, is not."""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from stepline.store.locking import embedded_store_locked


@contextmanager
def held_elsewhere(store_dir: Path) -> Iterator[None]:
    """The embedded store at `store_dir` opened by another process for as long as the block runs."""
    holder = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(f"""
            import sys, clickhouse_connect
            c = clickhouse_connect.get_client(dsn="chdb://{store_dir}")
            print("open", flush=True)
            sys.stdin.readline()
        """)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "open"
        yield
    finally:
        assert holder.stdin is not None
        holder.stdin.close()
        holder.wait(30)


def test_a_store_another_process_holds_is_locked_until_it_lets_go(tmp_path: Path) -> None:
    with held_elsewhere(tmp_path):
        assert embedded_store_locked(str(tmp_path))
    assert not embedded_store_locked(str(tmp_path))


def test_a_store_this_process_holds_is_not_locked_to_it(chdb_dir: Path) -> None:
    # The session's anchor client runs chdb_dir's engine in this process: its flock stops a second one here too,
    # yet chDB lets this process open the store again, so the probe must not call it held.
    fd = os.open(chdb_dir / "status", os.O_RDONLY)
    try:
        with pytest.raises(BlockingIOError):
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    finally:
        os.close(fd)
    assert not embedded_store_locked(str(chdb_dir))


def test_a_directory_without_a_running_store_is_not_locked(tmp_path: Path) -> None:
    assert not embedded_store_locked(str(tmp_path))
    assert not embedded_store_locked(str(tmp_path / "absent"))
    (tmp_path / "status").write_text("left by a ClickHouse that stopped")
    assert not embedded_store_locked(str(tmp_path))
