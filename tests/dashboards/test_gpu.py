"""The GPU dashboard: per-GPU clocks, power, heat and interconnect, with throttle reasons and XIDs, read from NVML's
samples in the store."""

from __future__ import annotations

from stepline.dashboards import gpu
from stepline.store.store import Store
from tests.dashboards.conftest import GOLDEN, STEPS, answer, context, panel_sql, panels, problems, rendered

MODEL = rendered(gpu.dashboard)
ONE_GPU = "h/gpu0"


def test_the_uid_is_stable() -> None:
    assert gpu.UID == MODEL["uid"] == "stepline-gpu"
    assert f'"uid": "{gpu.UID}"' in (GOLDEN / "gpu.json").read_text()


def test_it_has_every_gpu_panel_and_a_gpu_variable() -> None:
    assert list(panels(MODEL)) == [
        "Clocks", "Power", "Energy used in range", "Temperatures", "Utilisation", "DRAM bandwidth", "Memory used",
        "PCIe and NVLink", "Clock-event (throttle) reasons", "HBM row remapping", "XID errors"]
    assert [v["name"] for v in MODEL["templating"]["list"]] == ["datasource", "prometheus", "host", "engine", "gpu"]


def test_every_query_reads_schema_tables_and_runs_at_every_interval(timeline: Store) -> None:
    assert not problems(timeline, MODEL)


def test_clocks_and_power_per_gpu_at_rows_and_minutes(timeline: Store) -> None:
    for interval_ms in (1000, 60_000):
        clocks = answer(timeline, panel_sql(MODEL, "Clocks"), context(interval_ms))
        assert clocks and {(r["gpu"], r["sm"], r["mem"]) for r in clocks} == {(ONE_GPU, 1900.0, 2600.0)}
    power = answer(timeline, panel_sql(MODEL, "Power"), context(1000))
    assert len(power) == STEPS and {r["power_avg_1s"] for r in power} == {400.0}


def test_throttle_reasons_count_the_samples_that_carry_them(timeline: Store) -> None:
    reasons = answer(timeline, panel_sql(MODEL, "Clock-event (throttle) reasons"), context(1000))
    assert {r["series"] for r in reasons} == {f"{ONE_GPU} hw_slowdown"}
    assert sum(r["samples"] for r in reasons) == STEPS - 90  # throttled from 90 s on


def test_xid_errors_name_the_gpu_and_the_xid(timeline: Store) -> None:
    [xid] = answer(timeline, panel_sql(MODEL, "XID errors"), context(1000))
    assert (xid["gpu"], xid["xid"], xid["severity"], xid["message"]) == ("0", "79", "critical", "XID 79 on GPU 0")
    assert answer(timeline, panel_sql(MODEL, "XID errors"), context(1000, gpu=["0"]))
    assert not answer(timeline, panel_sql(MODEL, "XID errors"), context(1000, gpu=["1"]))


def test_the_gpu_variable_narrows_the_per_gpu_panels(timeline: Store) -> None:
    assert answer(timeline, panel_sql(MODEL, "Temperatures"), context(1000, gpu=["0"]))
    assert not answer(timeline, panel_sql(MODEL, "Temperatures"), context(1000, gpu=["1"]))
    assert not answer(timeline, panel_sql(MODEL, "Temperatures"), context(60_000, gpu=["1"]))
