"""Shared fixtures: one embedded ClickHouse per test session, a fresh database per test."""

from __future__ import annotations

import os
import shutil
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path

import clickhouse_connect
import pytest
from clickhouse_connect.driver.client import Client
from hypothesis import settings

from stepline.sim.vllm_server import SimServer, serve
from stepline.sim.workloads import make_workload
from stepline.store.chdb import open_client
from stepline.store.store import Store
from stepline.testing.storeserver import StoreServer

# A copy of the exposition captured from vLLM 0.33.0 (shared/fixtures in the design repo).
# Property tests explore new inputs on every local run; in CI they replay a fixed set, so that a landing
# is judged on the code, not on the luck of the draw (what local runs find is fixed before it lands).
settings.register_profile("ci", derandomize=True, database=None)
if os.environ.get("CI"):
    settings.load_profile("ci")

FIXTURES = Path(__file__).resolve().parent / "fixtures"
VLLM_METRICS_FIXTURE = FIXTURES / "vllm-0.33.0-metrics.txt"


# The suite runs on pytest-xdist workers (`-n auto --dist loadgroup` in pyproject.toml): much of its time is
# waiting on processes, sockets and real clocks. A test module is one unit of work, so its module-scoped fixtures
# (a demo store, a replayed timeline) are built once, by one worker; the real-vLLM files are one unit between them,
# so that two engines never compete for the same two cores, and go first, being the longest.
# loadgroup is loadscope with the xdist_group mark as the scope, and --no-loadscope-reorder keeps the units in the
# order given (pytest-xdist 3.8.0's CHANGELOG.rst, #1083; src/xdist/scheduler/loadgroup.py and loadscope.py).
REAL_ENGINE = Path(__file__).resolve().parent / "realvllm"


def _unit(item: pytest.Item) -> str:
    """The unit of work `item` belongs to: its module, or (a module marked `unit_per(param)`, whose module fixtures
    build per value of `param`) its module and that value."""
    path = item.path
    if path.is_relative_to(REAL_ENGINE):
        return "realvllm"
    unit = str(path.relative_to(REAL_ENGINE.parent.parent))
    per = item.get_closest_marker("unit_per")
    params = getattr(item, "callspec", None)
    if per is not None and params is not None and per.args[0] in params.params:
        unit += f"[{per.args[0]}={params.params[per.args[0]]}]"
    return unit


def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    """`-n auto`: a worker per core this process may run on (xdist's own count can be physical cores only), and one
    more. Much of the suite waits on engines, sockets and real clocks, and the real-vLLM unit alone keeps one worker
    busy for about 400 s: on 2 cores, 2 workers took 640-710 s on a quiet machine (2026-12-04), 3 workers 556 s.
    Tests that time a real clock read what they waited, not an exact figure, so a busier machine stretches them
    without failing them."""
    return len(os.sched_getaffinity(0)) + 1


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        item.add_marker(pytest.mark.xdist_group(_unit(item)))
    items.sort(key=lambda item: _unit(item) != "realvllm")  # stable: the rest keep their order


@pytest.fixture(autouse=True)
def runtime_dir(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Where the collectors a test starts announce themselves: the test's own, never the user's, and never
    another test's (a collector another test left behind must not be found, or named, by this one's CLI)."""
    path = tmp_path_factory.mktemp("run")
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(path))
    return path


@pytest.fixture(scope="session", autouse=True)
def session_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """The working directory of the session's module and session fixtures: empty, never the one pytest was started
    in (where the README's `stepline demo` left ./stepline-data, the store the CLI reads when given none)."""
    path = tmp_path_factory.mktemp("cwd")
    started_in = Path.cwd()
    os.chdir(path)
    yield path
    os.chdir(started_in)


@pytest.fixture(autouse=True)
def working_dir(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The working directory a test runs in: its own and empty, and no $STEPLINE_STORE from the shell, so that what
    the CLI finds by default is what the test put there (tests/test_conftest.py)."""
    path = tmp_path_factory.mktemp("cwd")
    monkeypatch.chdir(path)
    monkeypatch.delenv("STEPLINE_STORE", raising=False)
    return path


@pytest.fixture(scope="session")
def chdb_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """The session's embedded store directory.

    chDB hosts one engine path per process, and starting it costs about half a second: one
    anchor client keeps it up for the whole session, and tests isolate themselves by database.
    """
    path = tmp_path_factory.mktemp("chdb")
    anchor = open_client(str(path))  # as the collector opens it: the engine starts with the query profile
    yield path
    anchor.close()


@pytest.fixture
def store_url(chdb_dir: Path) -> str:
    """A store URL with a database of its own."""
    return f"chdb://{chdb_dir}?database=t_{uuid.uuid4().hex[:12]}"


@pytest.fixture
def store(store_url: str) -> Iterator[Store]:
    """An open store with the schema created."""
    s = Store.open(store_url)
    s.ensure_schema(30)
    yield s
    s.client.command(f"DROP DATABASE IF EXISTS `{s.database}`")
    s.close()


@pytest.fixture
def store_server(chdb_dir: Path) -> Iterator[StoreServer]:
    """A writable ClickHouse HTTP endpoint over the session's embedded engine: a "remote" store to stop and start."""
    server = StoreServer(str(chdb_dir))
    server.start()
    yield server
    server.close()


@pytest.fixture
def chdb_client(chdb_dir: Path) -> Iterator[Client]:
    """A raw clickhouse-connect client on the session's embedded engine."""
    client = clickhouse_connect.get_client(dsn=f"chdb://{chdb_dir}")
    yield client
    client.close()


@pytest.fixture
def sock_dir() -> Iterator[str]:
    """A short directory for Unix sockets: AF_UNIX paths stop at 108 bytes, pytest's tmp_path can be longer."""
    path = tempfile.mkdtemp(prefix="stepline-")
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def steady_engine() -> Iterator[SimServer]:
    """A simulated vLLM engine serving steady chat, five times faster than real time, on a free port."""
    server = serve(make_workload("steady", duration_s=20), port=0, speed=5.0, repeat=True)
    yield server
    server.stop()
