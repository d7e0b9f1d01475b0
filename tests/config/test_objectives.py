"""The objectives: declared once, validated at construction, each SLI judging a request's report as the SLO says."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from stepline.config.objectives import DEFAULT_OBJECTIVES, Objective, judge_decision, judge_request, load_objectives
from stepline.model.rows import UNKNOWN_FINISH_REASON, GatewayDecision, Request


def _request(ttft: float = 0.5, tpot: float = 0.05, reason: str = "stop") -> Request:
    return Request(0, "h", "e1", 0, "m", "r", "plugin", reason, 0, 0.0, 0.0, 0.0, 0.0, 1.0, ttft, tpot, 10, 0, 10, 10,
                   0)


def test_the_defaults_are_99_percent_over_30_days_per_model_and_per_lane_and_tenant_at_the_gateway() -> None:
    assert {(o.name, o.target, o.window_days, o.scope) for o in DEFAULT_OBJECTIVES} == {
        ("ttft", 0.99, 30, "model"), ("tpot", 0.99, 30, "model"), ("availability", 0.99, 30, "model"),
        ("gateway_availability", 0.99, 30, "lane"), ("tenant_availability", 0.99, 30, "tenant")}
    assert math.isclose(DEFAULT_OBJECTIVES[0].error_budget, 0.01)


@pytest.mark.parametrize(("sli", "report", "good"), [
    ("ttft", _request(ttft=0.5), True), ("ttft", _request(ttft=1.5), False), ("ttft", _request(ttft=math.nan), None),
    ("tpot", _request(tpot=0.1), True), ("tpot", _request(tpot=0.2), False), ("tpot", _request(tpot=math.nan), None),
    ("availability", _request(reason="length"), True), ("availability", _request(reason="error"), False),
    ("availability", _request(reason="abort"), False), ("availability", _request(reason=UNKNOWN_FINISH_REASON), None),
])
def test_each_sli_judges_what_the_report_tells(sli: str, report: Request, good: bool | None) -> None:
    assert judge_request(sli, 1.0 if sli == "ttft" else 0.1, report) is good  # type: ignore[arg-type]


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"name": "TTFT p99", "sli": "ttft"}, "lower-case"),
    ({"name": "x", "sli": "latency"}, "sli 'latency'"),
    ({"name": "x", "sli": "ttft", "target": 99.0}, "between 0 and 1"),
    ({"name": "x", "sli": "ttft", "scope": "team"}, "scope 'team'"),
    ({"name": "x", "sli": "ttft", "scope": "tenant"}, "only a gateway knows the tenant"),
    ({"name": "x", "sli": "gateway_availability"}, "no engine model"),
    ({"name": "x", "sli": "gateway_first_byte", "threshold_seconds": -1.0, "scope": "lane"}, "not positive"),
])
def test_a_bad_objective_is_refused_naming_the_problem(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Objective(**kwargs)  # type: ignore[arg-type]


def _decision(status: int, first_byte_us: int | None, disconnected: bool = False) -> GatewayDecision:
    return GatewayDecision(1_000_000, "h", "e1", "router", "r", 1, "fast", [], 10, 10, None, None, "", "", None,
                           status, "", disconnected, first_byte_us, 9_000_000, "", team="search")


@pytest.mark.parametrize(("decision", "good"), [
    (_decision(200, 1_900_000), True), (_decision(200, 2_100_000), False),  # 0.9 s and 1.1 s after deciding
    (_decision(502, None), False), (_decision(0, None, disconnected=True), None)])
def test_the_gateways_first_byte_is_judged_against_its_threshold(decision: GatewayDecision, good: bool | None) -> None:
    assert judge_decision("gateway_first_byte", 1.0, decision) is good
    assert decision.tenant == "search"


def test_objectives_are_read_from_a_toml_file(tmp_path: Path) -> None:
    path = tmp_path / "objectives.toml"
    path.write_text("""
[[objective]]
name = "search_first_byte"
sli = "gateway_first_byte"
scope = "tenant"
target = 0.995
threshold_seconds = 2

[[objective]]
name = "availability"
sli = "availability"
""")
    assert load_objectives(path) == (
        Objective("search_first_byte", "gateway_first_byte", target=0.995, scope="tenant", threshold_seconds=2),
        Objective("availability", "availability"))


@pytest.mark.parametrize(("text", "message"), [
    ("[[objective]]\nname = 'x'\n", "needs a name and an sli"),
    ("[[objective]]\nname = 'x'\nsli = 'ttft'\ntargt = 0.9\n", "unknown field 'targt'"),
    ("[[objective]]\nname = 'x'\nsli = 'ttft'\nscope = 'tenant'\n", "only a gateway knows the tenant"),
    ("[[objective]]\nname = 'x'\nsli = 'ttft'\n[[objective]]\nname = 'x'\nsli = 'tpot'\n", "repeat"),
    ("name = 'x'\n", "no \\[\\[objective\\]\\] tables"),
    ("[[objective]\n", "not TOML"),
])
def test_a_bad_objectives_file_is_refused_naming_the_file_and_the_problem(tmp_path: Path, text: str,
                                                                           message: str) -> None:
    path = tmp_path / "objectives.toml"
    path.write_text(text)
    with pytest.raises(ValueError, match=message) as caught:
        load_objectives(path)
    assert str(caught.value).startswith(f"objectives file {path}: ") and "\n" not in str(caught.value)
