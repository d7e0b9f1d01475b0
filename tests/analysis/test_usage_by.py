"""`stepline usage`: each request's GPU time grouped by who sent it (the gateway's decision it joins), with tokens,
energy, cost at a price per GPU-hour, and idle and unattributed time as their own lines."""

from __future__ import annotations

import csv
import io
import json

import pytest

from stepline.analysis import usage_by
from stepline.model.rows import GatewayDecision, GpuSample, micros
from stepline.store.store import Store
from tests.analysis.test_usage import ENGINE, T0, _gpus, _timeline, window

PRICE = 3.6  # per GPU-hour: a GPU-second costs 0.001
GPU = "NVIDIA H200"  # what tests.analysis.test_usage's GPUs are named


def _decision(rid: str, at: float, team: str, key: str, lane: str = "fast") -> GatewayDecision:
    return GatewayDecision(micros(T0 + at), "gw", ENGINE, "edge", rid, 1, lane, [ENGINE], 400, 400, None, None, "",
                           "", None, 200, "", False, micros(T0 + at + 0.2), micros(T0 + at + 1), "", (), "tiny-lora",
                           key, team, "", "")


def _store(store: Store) -> None:
    """test_usage's timeline (long: 400 + 139 tokens, short: 200 + 40, one decoder nobody reported) on two GPUs,
    long sent by team alpha's key, short by team beta's."""
    _timeline(store)
    _gpus(store, counter=True)
    store.insert("gateway_decisions", [_decision("long", 0.85, "alpha", "alpha-key"),
                                       _decision("short", 5.85, "beta", "beta-key", lane="heavy")],
                 GatewayDecision._fields)


def test_groups_idle_and_unattributed_add_up_to_the_gpu_time(store: Store) -> None:
    _store(store)
    r = usage_by.report(store, window(0, 10), "team", {GPU: PRICE})
    by = {g.name: g for g in r.groups}
    assert sorted(by) == ["alpha", "beta"]
    assert (by["alpha"].requests, by["alpha"].tokens, by["beta"].requests, by["beta"].tokens) == (1, 539, 1, 240)
    [e] = r.engines
    # Two GPUs on the engine: every GPU-second of its life in the window is on one line.
    assert r.gpu_seconds == pytest.approx(2 * e.window_us / 1e6)
    assert sum(g.gpu_seconds for g in r.groups) == pytest.approx(2 * e.attributed_us / 1e6)
    assert r.idle.gpu_seconds == pytest.approx(2 * e.idle_us / 1e6)
    assert r.unattributed.gpu_seconds == pytest.approx(2 * e.unattributed_us / 1e6) and r.unattributed.gpu_seconds
    for g in (*r.groups, r.idle, r.unattributed):
        assert g.cost == pytest.approx(g.gpu_seconds * PRICE / 3600)
    assert by["alpha"].cost_per_million_tokens == pytest.approx((by["alpha"].cost or 0) / 539 * 1e6)
    energy = sum(g.energy_j or 0 for g in (*r.groups, r.idle, r.unattributed))
    assert energy == pytest.approx((e.energy_mj or 0) / 1000)
    assert r.idle_share() == pytest.approx(e.idle_us / e.window_us)


@pytest.mark.parametrize(("by", "names"), [("tenant", ["alpha", "beta"]), ("key", ["alpha-key", "beta-key"]),
                                           ("lane", ["fast", "heavy"]), ("adapter", ["tiny-lora"]),
                                           ("engine", [ENGINE]), ("model", ["m"]), ("end_user", ["(none)"])])
def test_each_dimension_names_its_groups(store: Store, by: str, names: list[str]) -> None:
    _store(store)
    assert sorted(g.name for g in usage_by.report(store, window(0, 10), by).groups) == names


def test_a_request_no_gateway_decision_joins_has_none_of_its_dimensions(store: Store) -> None:
    _timeline(store)
    r = usage_by.report(store, window(0, 10), "team")
    assert [(g.name, g.requests) for g in r.groups] == [("(none)", 2)]
    assert r.groups[0].cost is None and r.groups[0].energy_j is None  # no price, no GPU sampled


def test_csv_json_and_the_table_say_the_same(store: Store) -> None:
    _store(store)
    r = usage_by.report(store, window(0, 10), "team", {GPU: PRICE, "other": 1.0})
    lines = list(csv.DictReader(io.StringIO(usage_by.as_csv(r))))
    assert [line["team"] for line in lines] == [*(g.name for g in r.groups), "(idle)", "(unattributed)"]
    doc = json.loads(usage_by.as_json(r))
    assert [row["team"] for row in doc["rows"]] == [line["team"] for line in lines]
    assert doc["rows"][0]["gpu_seconds"] == float(lines[0]["gpu_seconds"])
    assert doc["gpu_models_without_a_price"] == []
    text = usage_by.render(r)
    assert "(idle)" in text and "idle: " in text and "no cost" not in text


def test_a_gpu_without_a_price_is_named_and_costs_nothing(store: Store) -> None:
    _store(store)
    store.insert("gpu_samples", [GpuSample(micros(T0 + 9.9), "h", ENGINE, 3, "GPU-3", "NVIDIA H100", 1980.0,
                                           3201.0, 100.0, None, 50.0, 56.0, 0.0, 0.0, 1, 2, 0.0, 0.0, 0, 0.0, 0.0, 0,
                                           [], 0.0, 0.0, 0.0, {})], GpuSample._fields)
    r = usage_by.report(store, window(0, 10), "team", {"NVIDIA H100": PRICE})
    assert r.unpriced_gpus == [GPU] and all(g.cost is None for g in r.groups)
    assert "no price for NVIDIA H200" in usage_by.render(r)
    assert "no cost: set a price" in usage_by.render(usage_by.report(store, window(0, 10), "team"))


@pytest.mark.parametrize("spec", ["H100", "H100=", "=2", "H100=-1", "H100=nan", "H100=two"])
def test_a_bad_price_is_named(spec: str) -> None:
    with pytest.raises(ValueError, match="must be MODEL=USD_PER_GPU_HOUR"):
        usage_by.parse_prices([spec])


def test_prices_are_read_per_gpu_model() -> None:
    assert usage_by.parse_prices(["NVIDIA H100 80GB HBM3=2.49", "NVIDIA A10G = 1"]) == {
        "NVIDIA H100 80GB HBM3": 2.49, "NVIDIA A10G": 1.0}


def test_a_window_that_begins_between_a_decision_and_its_request_still_knows_who_sent_it(store: Store) -> None:
    """alpha's decision is at 0.85 s, its request arrives at 0.9 s: a window (a rolled-up minute) that begins
    between them reads the decision all the same."""
    _store(store)
    assert sorted(g.name for g in usage_by.report(store, window(0.87, 10), "team").groups) == ["alpha", "beta"]
    # A request alive in the window that arrived long before it is still its sender's.
    assert [g.name for g in usage_by.report(store, window(3.0, 4.0), "team").groups] == ["alpha"]
