"""The objectives: declared once, validated at construction, each SLI judging a request's report as the SLO says."""

from __future__ import annotations

import math

import pytest

from stepline.config.objectives import DEFAULT_OBJECTIVES, Objective, judge_request
from stepline.model.rows import UNKNOWN_FINISH_REASON, Request


def _request(ttft: float = 0.5, tpot: float = 0.05, reason: str = "stop") -> Request:
    return Request(0, "h", "e1", 0, "m", "r", "plugin", reason, 0, 0.0, 0.0, 0.0, 0.0, 1.0, ttft, tpot, 10, 0, 10, 10,
                   0)


def test_the_defaults_are_99_percent_over_30_days_per_model_and_per_lane_at_the_gateway() -> None:
    assert {(o.name, o.target, o.window_days, o.scope) for o in DEFAULT_OBJECTIVES} == {
        ("ttft", 0.99, 30, "model"), ("tpot", 0.99, 30, "model"), ("availability", 0.99, 30, "model"),
        ("gateway_availability", 0.99, 30, "lane")}
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
    ({"name": "x", "sli": "ttft", "scope": "tenant"}, "scope 'tenant'"),
    ({"name": "x", "sli": "gateway_availability"}, "no model"),
])
def test_a_bad_objective_is_refused_naming_the_problem(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Objective(**kwargs)  # type: ignore[arg-type]
