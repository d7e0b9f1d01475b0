"""`stepline usage`: who used the GPUs, from a store, as a table, CSV or JSON, with prices from flags or the
environment."""

from __future__ import annotations

import json
from datetime import UTC, datetime

import pytest

from stepline.cli import usage
from stepline.cli.main import main
from stepline.store.store import Store
from tests.analysis.test_usage import T0
from tests.analysis.test_usage_by import GPU, _store


def _window() -> list[str]:
    return ["--from", datetime.fromtimestamp(T0, UTC).isoformat(), "--to", datetime.fromtimestamp(T0 + 10,
                                                                                                  UTC).isoformat()]


def test_usage_by_team_as_json_with_a_price_from_the_environment(
        store: Store, store_url: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    _store(store)
    monkeypatch.setenv(usage.PRICES_ENV, f"{GPU}=3.6")
    assert main(["usage", "--store", store_url, "--by", "team", "--format", "json", *_window()]) == 0
    doc = json.loads(capsys.readouterr().out)
    rows = {row["team"]: row for row in doc["rows"]}
    assert list(rows) == ["alpha", "beta", "(idle)", "(unattributed)"]
    assert (rows["alpha"]["requests"], rows["beta"]["prompt_tokens"]) == (1, 200)
    assert rows["alpha"]["cost"] == pytest.approx(rows["alpha"]["gpu_seconds"] / 1000, rel=1e-3)
    assert doc["prices_per_gpu_hour"] == {GPU: 3.6}


def test_usage_as_a_table_says_how_to_get_a_cost(store: Store, store_url: str,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    _store(store)
    assert main(["usage", "--store", store_url, "--by", "lane", *_window()]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0].split()[:3] == ["lane", "requests", "tokens"]
    assert "(idle)" in out and "no cost: set a price per GPU-hour" in out


def test_a_bad_price_is_one_line(store_url: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["usage", "--store", store_url, "--gpu-price", "H100"]) == 2
    assert capsys.readouterr().err.strip().endswith("GPU price 'H100' must be MODEL=USD_PER_GPU_HOUR, e.g. "
                                                    "'NVIDIA H100 80GB HBM3=2.49'")
