"""What a collector announces (its runtime file, the file beside its store), and how the CLI picks the store to read:
--store, env, cwd, then the runtime file."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from stepline.store.discovery import (
    BESIDE_STORE_FILE,
    RunningCollector,
    announce,
    announce_beside_store,
    is_alive,
    locate_store,
    process_started,
    read_beside_store,
    running,
    runtime_dir,
    store_without_password,
    withdraw,
    withdraw_beside_store,
)
from stepline.store.url import parse_store_url


def test_the_runtime_directory_is_per_user() -> None:
    assert runtime_dir({"XDG_RUNTIME_DIR": "/run/user/1000", "HOME": "/home/u"}) == Path("/run/user/1000/stepline")
    assert runtime_dir({"HOME": "/home/u"}) == Path("/home/u/.cache/stepline")
    assert runtime_dir({"XDG_CACHE_HOME": "/c", "HOME": "/home/u"}) == Path("/c/stepline")


def test_a_store_url_is_announced_without_its_password() -> None:
    assert store_without_password(parse_store_url("chdb://./data?database=other")) == \
        f"chdb://{os.path.abspath('data')}?database=other"
    assert store_without_password(parse_store_url("chdb:///var/lib/s")) == "chdb:///var/lib/s"
    assert store_without_password(parse_store_url("https://ops:s3cret@ch:8443/tl")) == "https://ops@ch:8443/tl"


def test_announce_and_withdraw(tmp_path: Path) -> None:
    folder = tmp_path / "run" / "stepline"
    path = announce("chdb:///s", "http://127.0.0.1:8124", "http://127.0.0.1:9465/metrics", folder,
                    events_url="http://127.0.0.1:9466", events_token="t0ken")
    assert path == folder / f"collector-{os.getpid()}.json"
    assert stat.S_IMODE(folder.stat().st_mode) == 0o700 and stat.S_IMODE(path.stat().st_mode) == 0o600
    assert [p.name for p in folder.iterdir()] == [path.name]  # no temporary file left behind
    raw = json.loads(path.read_text())
    assert list(raw) == ["pid", "started", "started_at", "store", "query_url", "metrics_url", "events_url",
                         "events_token"]
    assert raw["pid"] == os.getpid() and raw["store"] == "chdb:///s" and raw["query_url"] == "http://127.0.0.1:8124"
    assert raw["metrics_url"] == "http://127.0.0.1:9465/metrics" and raw["started"] == process_started(os.getpid())
    alive, stale = running(folder)
    assert [p for p, _ in alive] == [path] and stale == []
    ((_, info),) = alive
    assert (info.events_url, info.events_token, info.password_required) == ("http://127.0.0.1:9466", "t0ken", False)
    assert "t0ken" not in repr(info)
    withdraw(path)
    withdraw(path)  # twice: no error
    assert running(folder) == ([], [])


def _dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def test_a_dead_or_reused_pid_is_not_a_running_collector() -> None:
    assert is_alive(os.getpid(), process_started(os.getpid()))
    assert not is_alive(_dead_pid(), "")
    assert not is_alive(os.getpid(), "1")  # this pid, but a process that started at another time


def _write(folder: Path, pid: int, store: str, started_at: float, started: str = "") -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"collector-{pid}.json"
    path.write_text(json.dumps({"pid": pid, "started": started, "started_at": started_at, "store": store,
                                "query_url": "http://127.0.0.1:1", "metrics_url": "http://127.0.0.1:2/metrics"}))
    return path


def test_the_store_to_read_explicit_then_env_then_cwd_then_the_running_collector(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    folder, cwd = tmp_path / "run", tmp_path / "elsewhere"
    cwd.mkdir()
    me = process_started(os.getpid())
    _write(folder, os.getpid(), "chdb:///a", 100.0, me)
    assert locate_store("chdb:///x", {"STEPLINE_STORE": "chdb:///y"}, str(cwd), folder).url == "chdb:///x"
    assert locate_store(None, {"STEPLINE_STORE": "chdb:///y"}, str(cwd), folder).url == "chdb:///y"
    found = locate_store(None, {}, str(cwd), folder)
    assert found.url == "chdb:///a" and found.collector is not None and found.runtime_file is not None
    (cwd / "stepline-data").mkdir()
    assert locate_store(None, {}, str(cwd), folder).url == f"chdb://{cwd}/stepline-data"
    (cwd / "stepline-data").rmdir()
    # A stale file is ignored, said so and removed; with two live ones the newest wins, and that is said too.
    dead = _write(folder, _dead_pid(), "chdb:///dead", 300.0)
    parent = _write(folder, os.getppid(), "chdb:///b", 200.0, process_started(os.getppid()))
    found = locate_store(None, {}, str(cwd), folder)
    assert found.url == "chdb:///b" and found.runtime_file == parent
    err = capsys.readouterr().err
    assert f"ignoring {dead}: the collector it names is not running" in err and not dead.exists()
    assert "2 collectors are running; reading the newest" in err and "chdb:///a" in err
    # Nobody: ./stepline-data, and the directory searched is kept for the error message.
    for path in folder.iterdir():
        path.unlink()
    nothing = locate_store(None, {}, str(cwd), folder)
    assert nothing.url == f"chdb://{cwd}/stepline-data" and nothing.searched == folder and nothing.collector is None


def test_the_announcement_beside_a_store_is_read_back_and_withdrawn(tmp_path: Path) -> None:
    announce_beside_store(str(tmp_path), "http://127.0.0.1:8124", "http://127.0.0.1:9465/metrics", True)
    path = tmp_path / BESIDE_STORE_FILE
    assert [p.name for p in tmp_path.iterdir()] == ["stepline-collector.json"]  # no temporary file left behind
    assert path.read_text() == (f'{{"pid": {os.getpid()}, "query_url": "http://127.0.0.1:8124", '
                                '"metrics_url": "http://127.0.0.1:9465/metrics", "password_required": true}')
    umask = os.umask(0)
    os.umask(umask)
    assert stat.S_IMODE(path.stat().st_mode) == 0o666 & ~umask  # no secret in it: whoever reads the store reads it
    assert read_beside_store(str(tmp_path)) == RunningCollector(
        os.getpid(), query_url="http://127.0.0.1:8124", metrics_url="http://127.0.0.1:9465/metrics",
        password_required=True)
    withdraw_beside_store(str(tmp_path))
    withdraw_beside_store(str(tmp_path))  # twice: no error
    assert read_beside_store(str(tmp_path)) is None
    assert read_beside_store(str(tmp_path / "absent")) is None


def test_an_unreadable_announcement_beside_a_store_is_ignored_and_said(tmp_path: Path,
                                                                        caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / BESIDE_STORE_FILE
    for text in ("{", '{"pid": 7}', '{"pid": "seven", "query_url": "http://127.0.0.1:1"}', "[7]"):
        path.write_text(text)
        caplog.clear()
        assert read_beside_store(str(tmp_path)) is None
        assert f"ignoring unreadable {BESIDE_STORE_FILE} in {tmp_path}: " in caplog.text, text
    # One written before the file said more: what it lacks is at its default.
    path.write_text('{"pid": 7, "query_url": "http://127.0.0.1:1"}')
    assert read_beside_store(str(tmp_path)) == RunningCollector(7, query_url="http://127.0.0.1:1")
