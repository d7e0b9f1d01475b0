"""Each atheris target, briefly (atheris is a test dependency where it has wheels: Linux x86-64)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("atheris")

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("target", ["metrics", "datagram", "otlp", "inflate", "sql"])
def test_target_runs_clean_for_a_few_seconds(target: str, tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "tests.fuzz.targets", target, "-max_total_time=3", "-runs=20000",
         f"-artifact_prefix={tmp_path}/", "-rss_limit_mb=2048", "-seed=1"],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
        env={**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "collector")])},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert not list(tmp_path.glob("crash-*")), result.stderr[-3000:]
