"""One real engine for the real-engine files: one vLLM CPU engine and one collector run every load both files
check, in turn, then stop; each file reads its part (the engine's counters are read around each part, so each
checks its own requests against vLLM's own count of them, and the whole life against the whole store).

Starting the engine is the costliest thing the suite does; the sweep in test_real_vllm_replay.py launches engines
of its own, after this one has stopped, on the same port.
"""

from __future__ import annotations

import pytest

from tests.realvllm import harness


@pytest.fixture(scope="package")
def life(tmp_path_factory: pytest.TempPathFactory) -> harness.Life:
    return harness.live(harness.setup_or_skip(tmp_path_factory, "realvllm"))
