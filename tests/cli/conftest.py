"""Fixtures of the command-line tests: a simulated engine to measure and replay against."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from stepline.sim.config import EngineConfig
from stepline.sim.vllm_server import SimServer, idle_workload, serve


@pytest.fixture
def engine() -> Iterator[SimServer]:
    """An idle simulated vLLM engine serving the model "test/model" in real time, on a free port."""
    handle = serve(idle_workload(), EngineConfig(model="test/model"), port=0, speed=1.0)
    yield handle
    handle.stop()
