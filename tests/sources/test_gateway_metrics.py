"""A gateway's /metrics into gateway_samples: the real vllm-router (tests/gateway/install.sh) in front of a simulated
engine, each series tied to the backend it is about; and what a wrong or dead endpoint gives."""

from __future__ import annotations

import json
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from stepline.core.clock import ManualClock
from stepline.model.rows import Event, GatewaySample, Row
from stepline.sim.config import EngineConfig
from stepline.sim.vllm_server import SimServer, idle_workload, serve
from stepline.sources.base import SourceContext, SourceError
from stepline.sources.gateway_metrics import GatewayMetricsSource, build
from stepline.testing.alertstack import free_port
from tests.gateway.proxy import VENV
from tests.gateway.test_litellm import MODEL

CTX = SourceContext("h1", ManualClock(1_800_000_000.0))


@pytest.fixture(scope="module")
def engine() -> Iterator[SimServer]:
    server = serve(idle_workload(600), EngineConfig(model=MODEL), port=0, speed=20.0)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def router(engine: SimServer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str]]:
    binary = VENV / "bin" / "vllm-router"
    if not binary.exists():
        pytest.fail(f"no vllm-router at {binary}: run tests/gateway/install.sh (CI does)")
    port, metrics = free_port(), free_port()
    log_path = Path(tmp_path_factory.mktemp("router")) / "router.log"
    with log_path.open("w") as log:
        process = subprocess.Popen([str(binary), "--worker-urls", engine.url, "--host", "127.0.0.1", "--port",
                                    str(port), "--prometheus-host", "127.0.0.1", "--prometheus-port", str(metrics),
                                    "--policy", "round_robin"], stdout=log, stderr=subprocess.STDOUT)
        try:
            url = f"http://127.0.0.1:{port}"
            deadline = time.monotonic() + 60
            while True:
                try:
                    _complete(url, "warm up")
                    break
                except OSError as exc:
                    if process.poll() is not None or time.monotonic() > deadline:
                        raise AssertionError(f"vllm-router did not start: {log_path.read_text()[-2000:]}") from exc
                    time.sleep(0.3)
            yield url, f"http://127.0.0.1:{metrics}"
        finally:
            process.terminate()
            process.wait(10)


def _complete(url: str, prompt: str) -> dict[str, Any]:
    body = json.dumps({"model": MODEL, "prompt": prompt, "max_tokens": 4}).encode()
    request = urllib.request.Request(f"{url}/v1/completions", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=30) as response:
        return dict(json.loads(response.read()))


def _scrape(source: GatewayMetricsSource) -> list[Row]:
    rows: list[Row] = []
    source.poll(rows.extend)
    return rows


def test_vllm_routers_series_are_stored_per_backend(router: tuple[str, str], engine: SimServer) -> None:
    url, metrics = router
    [source] = build(CTX, (f"edge={metrics}",), 3.0)
    first = _scrape(source)
    assert [e.kind for e in first if isinstance(e, Event)] == ["gateway_up"]
    for i in range(5):
        _complete(url, f"hello {i}")
    samples = [r for r in _scrape(source) if isinstance(r, GatewaySample)]
    names = {s.metric for s in samples}
    assert {"vllm_router_processed_requests_total", "vllm_router_worker_health"} <= names, names
    backend = engine.url.removeprefix("http://")
    [processed] = [s for s in samples if s.metric == "vllm_router_processed_requests_total" and s.engine == backend]
    assert processed.gateway == "edge" and processed.kind == "counter"
    assert processed.delta == 5 and processed.value >= 6  # five since the first scrape, and the warm-up before


def test_an_endpoint_that_is_no_gateway_says_so_in_one_line(engine: SimServer) -> None:
    source = GatewayMetricsSource(engine.url, CTX, gateway="wrong")  # an engine's /metrics: vllm:, no gateway
    rows: list[Row] = []
    with pytest.raises(SourceError, match=r"^gateway wrong at .*: no litellm_ or vllm_router_ metrics among \d+ "
                                          r"families: is this a LiteLLM proxy's or vllm-router's /metrics\?$"):
        source.poll(rows.extend)
    [down] = [r for r in rows if isinstance(r, Event)]
    assert (down.kind, down.engine, down.attributes["gateway"]) == ("gateway_down", "", "wrong")


def test_a_dead_gateway_is_down_once() -> None:
    source = GatewayMetricsSource(f"http://127.0.0.1:{free_port()}", CTX, gateway="gone")
    events: list[Row] = []
    for _ in range(2):
        with pytest.raises(SourceError, match=r"^gateway gone unreachable at "):
            source.poll(events.extend)
    assert [e.kind for e in events if isinstance(e, Event)] == ["gateway_down"]
