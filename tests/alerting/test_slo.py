"""The SLO burn-rate rules under promtool: a fast burn pages within its window, a slower one pages over six hours,
a slow one tickets and never pages, a blip does neither (the Google SRE workbook's multi-window burn rates)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from stepline.alerting.config import AlertConfig
from stepline.alerting.definitions import alerts
from stepline.alerting.slo import ALERT, BURN_WINDOWS, WINDOWS, recording_rules
from stepline.config.objectives import Objective
from stepline.config.slo import Slo
from tests.alerting.test_build import ALERTS, PROMTOOL, SEL, needs_promtool

CFG = AlertConfig()
TTFT = Objective("ttft", "ttft")
STEP_MIN = 2  # minutes between samples: a 5m window still holds two
EVALUATION_MIN = 8  # rules evaluated every 8 minutes: four days of them in seconds; checks fall on evaluations
PER_STEP = 120  # requests between samples (1/s)
HISTORY = 3 * 24 * 60 // STEP_MIN  # three healthy days first: every window starts full
LABELS = 'objective="ttft",engine="e1",model="m"'
# A tenant's objective (a default: each tenant's requests answered by the gateway), as the collector labels it.
TENANT_LABELS = 'objective="tenant_availability",engine="e1",model="",lane="fast",tenant="search"'
_MINUTES = {"m": 1, "h": 60, "d": 1440}


def _samples(window: str) -> int:
    return int(window[:-1]) * _MINUTES[window[-1]] // STEP_MIN


def counters(bad: list[float]) -> tuple[list[float], list[float]]:
    """Cumulative good and total after HISTORY healthy steps, then one step per entry of `bad` (its bad share)."""
    shares = [0.0] * HISTORY + bad
    good, total = [0.0], [0.0]
    for share in shares:
        total.append(total[-1] + PER_STEP)
        good.append(good[-1] + PER_STEP * (1 - share))
    return good, total


def error_ratio(good: list[float], total: list[float], at: int, window: str) -> float:
    """The error ratio of the samples in [at - window, at] (Prometheus 2's range selector holds both ends): what
    `rate` gives when both counters are sampled alike."""
    first = max(0, at - _samples(window))
    return 1 - (good[at] - good[first]) / (total[at] - total[first])


def burning(good: list[float], total: list[float], at: int, budget: float) -> list[tuple[str, str, float]]:
    """(severity, long window, its error ratio) of every window pair over its factor: the rules' intent, by hand."""
    return [(w.severity, w.long, error_ratio(good, total, at, w.long)) for w in BURN_WINDOWS
            if min(error_ratio(good, total, at, w.long), error_ratio(good, total, at, w.short)) > w.factor * budget]


def _text(severity: str, field: str, **values: str) -> str:
    a = next(a for a in alerts(CFG) if a.name == ALERT and a.severity == severity)
    return re.sub(r"\[([a-z_]+)\]", lambda m: values[m.group(1)], getattr(a, field))


def exp_alert(severity: str, window: str, ratio: float, objective: str = "ttft",
              scope: tuple[str, str] = ("model", "m")) -> dict[str, object]:
    values = {"objective": objective, "scope": scope[1], "long_window": window, "value_ratio": f"{ratio * 100:.4g}%"}
    return {"exp_labels": {"objective": objective, scope[0]: scope[1], "long_window": window, "severity": severity},
            "exp_annotations": {"summary": _text(severity, "summary", **values),
                                "description": _text(severity, "description", **values),
                                "runbook_url": CFG.runbook(ALERT)}}


def scenario(name: str, bad: list[float], checks: list[tuple[int, list[tuple[str, str]]]], *,
             labels: str = LABELS, objective: Objective = TTFT,
             scope: tuple[str, str] = ("model", "m")) -> dict[str, object]:
    """`checks`: (steps after the history, the (severity, long window) alerts expected then)."""
    good, total = counters(bad)
    budget = objective.error_budget
    tests = []
    for after, expect in checks:
        at = HISTORY + after
        assert at * STEP_MIN % EVALUATION_MIN == 0, f"{name}: check {after} falls between evaluations"
        found = burning(good, total, at, budget)
        assert [(s, w) for s, w, _ in found] == expect, (name, after, found)  # the scenario says what it claims
        tests.append({"eval_time": f"{at * STEP_MIN}m", "alertname": ALERT,
                      "exp_alerts": [exp_alert(s, w, r, objective.name, scope) for s, w, r in found]})
    series = [{"series": f"stepline_slo_{kind}_total{{{SEL},{labels}}}", "values": " ".join(f"{v:g}" for v in vals)}
              for kind, vals in (("good_requests", good), ("requests", total))]
    return {"name": name, "interval": f"{STEP_MIN}m", "input_series": series, "alert_rule_test": tests}


def scenarios() -> list[dict[str, object]]:
    return [
        # Every request fails: 2% of the budget is gone within the hour, and the page says so (14.4x over 1h and 5m).
        scenario("a fast burn pages within its window", [1.0] * 8, [(4, []), (8, [("critical", "1h")])]),
        # One request in ten fails: never 14.4x, but 6x over six hours pages (5% of the budget) in under four.
        scenario("a 10x burn pages over six hours", [0.1] * 120, [(104, []), (112, [("critical", "6h")])]),
        # One in twenty fails: 10% of the budget in a day is a ticket (3x over 1d, and 1x over 3d with it), no page.
        scenario("a slow burn tickets and never pages", [0.05] * 460,
                 [(60, []), (420, []), (452, [("warning", "1d"), ("warning", "3d")])]),
        # One in fifty: under 3x, only the three-day pair tickets.
        scenario("a 2x burn tickets over three days", [0.02] * 1092, [(1068, []), (1092, [("warning", "3d")])]),
        # Six minutes of every request failing, then healthy again: neither.
        scenario("a blip does neither", [1.0] * 3 + [0.0] * 32, [(4, []), (8, []), (12, []), (32, [])]),
        # One tenant's every request refused at the gateway: its page names the tenant.
        scenario("a tenant's fast burn pages naming the tenant", [1.0] * 8, [(4, []), (8, [("critical", "1h")])],
                 labels=TENANT_LABELS, objective=Objective("tenant_availability", "gateway_availability",
                                                           scope="tenant"), scope=("tenant", "search")),
    ]


@needs_promtool
def test_burn_rate_rules_page_ticket_or_stay_quiet(tmp_path: Path) -> None:
    shutil.copy(ALERTS / "prometheus-rules.yaml", tmp_path / "rules.yaml")
    spec = {"rule_files": ["rules.yaml"], "evaluation_interval": f"{EVALUATION_MIN}m", "tests": scenarios()}
    (tmp_path / "tests.yaml").write_text(json.dumps(spec))  # JSON is YAML
    # Days of samples through 3-day windows: longer than the other rule tests' 30 s.
    proc = subprocess.run([str(PROMTOOL), "test", "rules", "tests.yaml"], capture_output=True, text=True, timeout=300,
                          cwd=tmp_path)
    assert proc.returncode == 0 and "SUCCESS" in proc.stdout, proc.stdout + proc.stderr


def test_the_workbook_windows() -> None:
    assert [(w.severity, w.factor, w.long, w.short) for w in BURN_WINDOWS] == [
        ("critical", 14.4, "1h", "5m"), ("critical", 6.0, "6h", "30m"),
        ("warning", 3.0, "1d", "2h"), ("warning", 1.0, "3d", "6h")]
    assert set(WINDOWS) == {w.long for w in BURN_WINDOWS} | {w.short for w in BURN_WINDOWS}


def test_recording_rules_follow_the_objectives() -> None:
    slo = Slo(objectives=(Objective("fast_ttft", "ttft", target=0.995, scope="lane"),
                          Objective("up", "availability", target=0.999),
                          Objective("team_first_byte", "gateway_first_byte", scope="tenant")))
    rules = recording_rules(AlertConfig(selector='job="edge"', slo=slo))
    budgets = {r["labels"]["objective"]: r["expr"] for r in rules if "labels" in r}  # type: ignore[index]
    assert budgets == {"fast_ttft": "vector(0.005)", "up": "vector(0.001)", "team_first_byte": "vector(0.01)"}
    [hour] = [r["expr"] for r in rules if r["record"] == "stepline_slo:error_ratio:rate1h"]
    assert "sum by (objective, lane)" in str(hour) and 'objective=~"fast_ttft"' in str(hour)
    assert "sum by (objective, model)" in str(hour) and 'objective=~"up"' in str(hour)
    assert "sum by (objective, tenant)" in str(hour) and 'objective=~"team_first_byte"' in str(hour)
    assert str(hour).count('job="edge"') == 6


@pytest.mark.parametrize("severity", ["critical", "warning"])
def test_the_alert_text_names_the_objective_its_scope_and_window(severity: str) -> None:
    a = next(a for a in alerts(CFG) if a.name == ALERT and a.severity == severity)
    for placeholder in ("[objective]", "[scope]", "[long_window]", "[value_ratio]"):
        assert placeholder in a.summary + a.description
