"""The fleet write model (benchmarks/write_model.py): its arithmetic on small inputs, and a short measurement."""

from __future__ import annotations

import math
from pathlib import Path
from types import ModuleType

import pytest

from stepline.model.schema import DEDUP_INSERTS, DEDUP_SECONDS
from stepline.store import batches
from stepline.store.store import ASYNC_MAX_BYTES, remote_insert_settings
from tests.benchmarks.script import load

EIGHT_ENGINES = {8: 100}  # every INSERT holds 8 sharding keys


@pytest.fixture(scope="module")
def wm() -> ModuleType:
    return load("write_model")


def table(wm: ModuleType, *, inserts: float = 1.0, rows: float = 360.0, size: float = 1.0,
          keys: dict[int, int] | None = None) -> object:
    return wm.TableLoad("steps", inserts, rows, size, EIGHT_ENGINES if keys is None else keys)


def test_eight_keys_reach_nearly_every_one_of_three_shards(wm: ModuleType) -> None:
    assert wm.shards_reached(8, 3) == pytest.approx(3 * (1 - (2 / 3) ** 8))  # 2.88
    assert wm.shards_reached(1, 3) == pytest.approx(1.0)
    assert wm.mean_shards_reached({1: 1, 8: 1}, 3) == pytest.approx((1 + 3 * (1 - (2 / 3) ** 8)) / 2)


def test_todays_parts_are_one_per_shard_a_sidecar_insert_reaches_and_grow_with_the_fleet(wm: ModuleType) -> None:
    one = wm.today(table(wm), 1_000, 3)
    assert one.parts_per_s == pytest.approx(1_000 * 1.0 * (1 - (2 / 3) ** 8))
    assert wm.today(table(wm), 2_000, 3).parts_per_s == pytest.approx(2 * one.parts_per_s)
    assert one.rows_per_part == pytest.approx(360 / (3 * (1 - (2 / 3) ** 8)))
    assert one.keeper_writes_per_s == pytest.approx(10 * one.parts_per_s)
    assert one.dedup_window_s == pytest.approx(DEDUP_INSERTS / one.parts_per_s)
    assert not one.within_guidance


def test_new_path_makes_one_part_per_busy_timeout_per_server_when_no_limit_binds(wm: ModuleType) -> None:
    for shards in (3, 5):
        servers = shards * 2
        busy_s = remote_insert_settings(servers, cluster=True)["async_insert_busy_timeout_max_ms"] / 1000
        outcome = wm.new(table(wm, inserts=0.2), 10_000, shards)
        assert outcome.bound == "busy timeout"
        assert outcome.parts_per_s == pytest.approx(servers / busy_s, rel=0.01)  # 6 / 6 s: one a second
        assert outcome.within_guidance
    # Few sidecars: the timer starts at a buffer's first INSERT, so a server flushes less often than every timeout.
    sparse = wm.new(table(wm, inserts=0.2), 8, 3)
    assert sparse.parts_per_s < 0.7


def test_new_path_past_its_buffer_size_makes_parts_by_the_data_whatever_the_shard_count(wm: ModuleType) -> None:
    big = table(wm, inserts=0.2, size=400.0)
    nodes = 40_000
    outcome = wm.new(big, nodes, 3)
    assert outcome.bound == f"{ASYNC_MAX_BYTES >> 20} MiB"
    assert outcome.parts_per_s == pytest.approx(nodes * 360 * 400 / ASYNC_MAX_BYTES, rel=0.01)
    assert wm.new(big, nodes, 6).parts_per_s == pytest.approx(outcome.parts_per_s, rel=0.01)
    assert wm.shards_needed(wm.new, [big], nodes) is None
    data, queries = wm.buffer_per_timeout([big], nodes, 3)
    assert data == pytest.approx(nodes * 360 * 400 / 6 * 6.0)
    assert queries == math.ceil(nodes * 0.2 / 6 * 6.0)


def test_new_path_keeper_writes_count_a_node_per_deduplication_token(wm: ModuleType) -> None:
    outcome = wm.new(table(wm, inserts=0.2, keys={1: 1}), 3_000, 3)
    tokens = 3_000 * 0.2 / 3  # one key an INSERT: each lands on one shard
    assert outcome.keeper_writes_per_s == pytest.approx(10 * outcome.parts_per_s + tokens)
    assert outcome.dedup_window_s == pytest.approx(DEDUP_INSERTS / tokens)
    assert wm.new(table(wm, inserts=0.0), 10, 3).dedup_window_s == DEDUP_SECONDS


def test_guidance_asks_for_1000_rows_a_part_only_where_the_row_rate_allows(wm: ModuleType) -> None:
    assert wm.Outcome(1.0, 999.0, 10.0, 60.0, "busy timeout").within_guidance  # too few rows to fill a part
    assert not wm.Outcome(2.0, 1_500.0, 10.0, 60.0, "busy timeout").within_guidance  # 750 rows a part
    assert not wm.Outcome(1.5, 100_000.0, 10.0, 60.0, "64 MiB").within_guidance  # more than one part a second


def test_shards_needed_is_the_fewest_that_bring_todays_parts_under_one_a_second(wm: ModuleType) -> None:
    loads = [table(wm)]
    needed = wm.shards_needed(wm.today, loads, 1_000)
    assert wm.today(loads[0], 1_000, needed).parts_per_s <= 1.0
    assert wm.today(loads[0], 1_000, needed - 1).parts_per_s > 1.0


def test_sharding_keys_reads_host_and_engine_of_the_writers_batches(wm: ModuleType) -> None:
    pools = wm.build_pools(wm.NodeShape(engines=2))
    steps = [*wm._label(pools.steps[:3], "node-0", "node-0:8000"), *wm._label(pools.steps[:2], "node-0", "b")]
    assert wm.sharding_keys(batches.encode("steps", steps)) == {(b"node-0", b"node-0:8000"), (b"node-0", b"b")}
    requests = wm._label(pools.requests[:2], "node-1", "e")  # its ts is SimpleAggregateFunction(min, DateTime64)
    assert wm.sharding_keys(batches.encode("requests", requests)) == {(b"node-1", b"e")}


def test_two_collectors_insert_each_table_once_a_flush_with_the_new_settings(wm: ModuleType, chdb_dir: Path) -> None:
    # The session's engine directory: one chDB engine per process, which the other tests of this worker share.
    server = wm.CountingServer(str(chdb_dir))
    server.start()
    try:
        setup = wm.Store.open(server.store_url(wm.DATABASE))
        setup.ensure_schema(30)
        setup.close()
        shape = wm.NodeShape()
        settings = remote_insert_settings(6, cluster=True)
        path = wm.WritePath("new, flushed every second", 1.0, settings)
        run = wm.measure(server, path, shape, wm.build_pools(shape), nodes=2, k8s_nodes=0, seconds=3.0,
                         warmup_s=1.0)
    finally:
        server.close()
    assert run.dropped == 0
    assert set(settings) | {"insert_deduplication_token"} <= run.settings_seen
    assert all(isinstance(answer, float) for answer in run.engine_answers.values()), run.engine_answers
    loads = {load.table: load for load in run.loads("node")}
    steps = loads["steps"]
    assert 0.6 <= steps.inserts_per_s <= 1.3, steps  # one INSERT a flush interval
    assert steps.rows_per_s / steps.inserts_per_s == pytest.approx(8 * 45, rel=0.3)
    assert steps.keys and set(steps.keys) == {8}
    assert 250 <= steps.bytes_per_row <= 500, steps
    assert {"engine_samples", "gpu_samples", "host_samples", "requests"} <= set(loads)
