"""Every finding's SQL reproduces its figures: run on the store, its named columns equal the evidence's figures."""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from stepline.diagnosis.detectors import diagnose
from stepline.diagnosis.findings import Finding, Window
from stepline.drills.scenarios import SCENARIO_NAMES, make_scenario, run_scenario
from stepline.store.reader import open_reader
from stepline.store.store import Store


@pytest.fixture(scope="module")
def diagnosed(chdb_dir: Path) -> Iterator[list[tuple[str, Store, Finding]]]:
    """Every scenario replayed into a database of its own and diagnosed: (scenario, its store, a finding)."""
    out: list[tuple[str, Store, Finding]] = []
    stores: list[Store] = []
    for name in SCENARIO_NAMES:
        url = f"chdb://{chdb_dir}?database=sql_{name}"
        _engine, window = run_scenario(make_scenario(name), url)
        reader = open_reader(url)
        try:
            findings = diagnose(reader.client, Window(window.start, window.end, window.engine))
        finally:
            reader.close()
        store = Store.open(url)
        stores.append(store)
        out += [(name, store, f) for f in findings if f.sql]
    yield out
    for store in stores:
        store.client.command(f"DROP DATABASE IF EXISTS `{store.database}`")
        store.close()


def _same(shown: Any, computed: Any) -> bool:
    if isinstance(shown, int | float) and isinstance(computed, int | float):
        computed = float(computed)
        if math.isnan(computed):
            return shown is None
        # Evidence rounds (to 0.1, 0.001 or whole numbers): equal within that rounding, or 0.5%.
        tolerance = max(0.5 if isinstance(shown, int) else 0.051, 0.005 * abs(computed))
        return bool(abs(float(shown) - computed) <= tolerance)
    return str(shown) == str(computed)


def test_every_finding_sql_runs_and_agrees_with_its_evidence(diagnosed: list[tuple[str, Store, Finding]]) -> None:
    assert {f.kind for _, _, f in diagnosed} >= {"prefill_interference", "head_of_line_blocking",
                                                 "prefix_cache_collapse", "wedged_engine", "gpu_throttling",
                                                 "config_not_in_effect"}
    compared = 0
    for name, store, f in diagnosed:
        result = store.query(f.sql)
        assert result.result_rows, (name, f.kind, f.sql)
        # The finding's own row: the SQL is bound to its engine and window, so a one-row answer is the figures.
        if len(result.result_rows) != 1:
            continue
        row = dict(zip(result.column_names, result.result_rows[0], strict=True))
        for key in set(row) & set(f.evidence):
            assert _same(f.evidence[key], row[key]), (name, f.kind, key, f.evidence[key], row[key])
            compared += 1
    assert compared >= 8
