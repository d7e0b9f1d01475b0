"""stepline on a ClickHouse cluster: every read on Distributed tables, retries, and the schema's one owner.

The clusters live in one chDB process of their own (tests/store/cluster_run.py: its docstring says how and what that
cannot show): `one_shard` must answer every read exactly as a single-node store holding the same rows does;
`two_shards` holds every row twice (both shards read the one set of local tables), so its reads must plan and run
across shards and its sums be exactly twice the single node's.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from stepline.model import schema
from tests.store.cluster_run import CLUSTERS, SINGLE, reads

ROOT = Path(__file__).resolve().parents[2]
DASHBOARDS = ROOT / "dashboards"
ONE, TWO = CLUSTERS["one_shard"], CLUSTERS["two_shards"]
READS = sorted(reads(DASHBOARDS))


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("cluster") / "results.json"
    done = subprocess.run([sys.executable, "-m", "tests.store.cluster_run", str(out), str(DASHBOARDS)],
                          capture_output=True, text=True, timeout=900, cwd=ROOT)
    if not out.exists():
        pytest.fail(f"the cluster run wrote nothing (exit {done.returncode}): {done.stderr[-3000:]}")
    found: dict[str, Any] = json.loads(out.read_text())
    return found


def test_every_read_of_stepline_is_covered() -> None:
    kinds = {name.split(" ", 1)[0] for name in READS}
    assert kinds == {"dashboard", "detector", "cli", "gateway", "store"}
    assert sum(name.startswith("dashboard ") for name in READS) >= 60
    assert {"cli timeline", "cli requests", "cli report", "cli whatif", "cli doctor", "cli diagnose"} <= set(READS)


def test_the_data_fills_every_table(results: dict[str, Any]) -> None:
    counts = {table: figures["count()"] for table, figures in results["additive"][SINGLE].items()}
    assert set(counts) == {t.name for t in schema.TABLES}
    assert all(counts.values()), counts


@pytest.mark.parametrize("name", READS)
def test_a_read_on_one_shard_equals_the_single_node(results: dict[str, Any], name: str) -> None:
    single, one = results["reads"][name][SINGLE], results["reads"][name][ONE]
    assert "error" not in single, single["error"]
    assert "error" not in one, one["error"]
    assert one["value"] == single["value"]


@pytest.mark.parametrize("name", READS)
def test_a_read_plans_and_runs_across_two_shards(results: dict[str, Any], name: str) -> None:
    single, two = results["reads"][name][SINGLE], results["reads"][name][TWO]
    assert "error" not in two, two["error"]
    # diagnose exits 1 when it finds something: as the single node does
    if isinstance(single["value"], dict) and "exit" in single["value"]:
        assert two["value"]["exit"] == single["value"]["exit"], two["value"]


def test_some_reads_found_something(results: dict[str, Any]) -> None:
    # Equal answers prove little if they are all empty: the gateway story's findings and rows are there.
    values = {name: per[SINGLE]["value"] for name, per in results["reads"].items()}
    assert {f["kind"] for f in values["detector lane_leak"]} == {"lane_leak"}
    assert sum(bool(v) for name, v in values.items() if name.startswith("dashboard ")) >= 50
    assert values["store requests_of"] and values["store recent_requests"]


@pytest.mark.parametrize("table", [t.name for t in schema.TABLES])
def test_what_adds_up_is_twice_the_single_node_on_two_shards(results: dict[str, Any], table: str) -> None:
    single, one, two = (results["additive"][db][table] for db in (SINGLE, ONE, TWO))
    assert one == single
    assert two["count()"] == 2 * single["count()"]
    for figure, value in single.items():  # float sums: the harness keeps 9 digits, summed in any order
        if value is None:
            assert two[figure] is None, figure
        else:
            assert two[figure] == pytest.approx(2 * value, rel=2e-8), figure


@pytest.mark.parametrize("database", [ONE, TWO])
def test_a_segment_retried_after_its_acknowledgement_was_lost_is_stored_once(results: dict[str, Any],
                                                                           database: str) -> None:
    found = results["retries"][database]
    first, again, new = found["tokens"]
    assert first == again != new  # the retry carried its segment's token, the next segment its own
    assert found["settings"]["distributed_foreground_insert"] == 1 and found["settings"]["async_insert"] == 1
    assert found["after_new_segment"] == 2 * found["after_retry"]  # the retry added nothing; new rows do
    if database == ONE:
        assert found["after_retry"] == found["rows"]
    # On two shards both halves of one insert reach the one local table with the same token, so the engine takes
    # the second half for a retry of the first: only the one-shard count is the whole segment.


def test_the_schema_has_one_owner(results: dict[str, Any]) -> None:
    job = results["schema job"]
    assert "has no stepline tables: run `stepline schema --cluster one_shard --apply URL` first" in job[
        "before the job"]
    assert job["tables a collector left"] == []
    assert job["job exit"]["exit"] == 0
    assert job["after the job"] == "ok"
    expected = {t.name for t in schema.TABLES} | {schema.local_name(t.name) for t in schema.TABLES}
    assert set(job["tables after the job"]) == expected | {"schema_version", "timeline"}
    assert f"older than this stepline's {schema.SCHEMA_VERSION}: run `stepline schema --cluster one_shard " \
           "--apply URL` with this stepline first" in job["older schema"]
    assert f"newer than this stepline's {schema.SCHEMA_VERSION}: upgrade stepline" in job["newer schema"]
    assert job["job on newer"]["exit"] != 0 and "newer than this stepline's" in job["job on newer"]["stderr"]
    assert job["job on older"]["exit"] == 0 and job["after migrating"] == "ok"
    assert job["events columns"] == ["events", "events_local"]
    assert "steps_per_minute" in job["steps_local projections"]
