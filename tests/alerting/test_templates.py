"""Alert text placeholders rendered as annotation templates: Prometheus's run by promtool on real series, and
Grafana's naming the condition's and the auxiliary queries' values."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from stepline.alerting.config import AlertConfig
from stepline.alerting.templates import GRAFANA_AUX, LABELS, grafana, grafana_aux_refs, prometheus

PROMTOOL = shutil.which("promtool")
TEXT = ("Engine [engine] ([gpu]): [value] waiting for [value_duration] ([value_ratio]); state [state], no progress "
        "for [age] of [budget], [waiting] waiting, [running] running; top finding: [finding]; [not_a_placeholder]")
SEL = 'job="stepline"'


def _series(name: str, value: float, **labels: str) -> dict[str, str]:
    matchers = ",".join(f'{k}="{v}"' for k, v in {"job": "stepline", **labels}.items())
    return {"series": f"{name}{{{matchers}}}", "values": f"{value:g} {value:g}"}


@pytest.mark.skipif(PROMTOOL is None, reason="promtool not installed (apt-get install prometheus)")
def test_prometheus_templates_render_labels_values_and_the_watchdog_context(tmp_path: Path) -> None:
    """e1 has the watchdog's series; e2 has none of its own (a state under another job must not be read)."""
    cfg = AlertConfig(selector=SEL)
    rules = {"groups": [{"name": "t", "rules": [{
        "alert": "Waiting", "expr": f"stepline_engine_waiting_requests{{{SEL}}} > 0",
        "annotations": {"description": prometheus(cfg, TEXT)}}]}]}
    (tmp_path / "rules.yml").write_text(yaml.safe_dump(rules))
    series = [
        _series("stepline_engine_waiting_requests", 12, engine="e1", gpu="0"),
        _series("stepline_engine_running_requests", 3, engine="e1"),
        _series("stepline_engine_state", 1, engine="e1", state="wedged"),
        _series("stepline_engine_state", 0, engine="e1", state="progressing"),
        _series("stepline_engine_progress_age_seconds", 95, engine="e1"),
        _series("stepline_engine_progress_budget_seconds", 30, engine="e1"),
        _series("stepline_engine_top_finding_info", 1, engine="e1", kind="wedged_engine", severity="critical",
                title="12 waiting"),
        _series("stepline_engine_waiting_requests", 2, engine="e2", gpu="1"),
        {"series": 'stepline_engine_state{job="other",engine="e2",state="wedged"}', "values": "1 1"},
    ]
    expected = {
        "e1": "Engine e1 (0): 12 waiting for 12s (1200%); state wedged, no progress for 1m 35s of 30s, 12 waiting, "
              "3 running; top finding: critical wedged_engine: 12 waiting; [not_a_placeholder]",
        "e2": "Engine e2 (1): 2 waiting for 2s (200%); state unknown, no progress for ? of ?, 2 waiting, ? running; "
              "top finding: none yet; [not_a_placeholder]",
    }
    alerts = [{"exp_labels": {"job": "stepline", "engine": engine, "gpu": gpu},
               "exp_annotations": {"description": text}} for (engine, text), gpu in zip(expected.items(), "01",
                                                                                          strict=True)]
    unit = {"rule_files": ["rules.yml"], "evaluation_interval": "1m", "tests": [{
        "interval": "1m", "input_series": series,
        "alert_rule_test": [{"eval_time": "1m", "alertname": "Waiting", "exp_alerts": alerts}]}]}
    (tmp_path / "test.yml").write_text(yaml.safe_dump(unit))
    assert PROMTOOL is not None
    done = subprocess.run([PROMTOOL, "test", "rules", "test.yml"], cwd=tmp_path, capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr


def test_prometheus_queries_carry_the_configured_selector() -> None:
    text = prometheus(AlertConfig(selector='cluster="a"'), "[budget]")
    assert "`stepline_engine_progress_budget_seconds{cluster=\"a\", engine=\"%s\"}`" in text
    assert "$labels.engine | query" in text
    unselected = prometheus(AlertConfig(selector=""), "[state]")
    assert "`stepline_engine_state{engine=\"%s\"} == 1`" in unselected


def test_grafana_templates_read_the_condition_and_the_auxiliary_queries() -> None:
    assert grafana("[engine] [value]") == "{{ $labels.engine }} {{ with $values.A }}{{ humanize .Value }}" \
                                          "{{ else }}?{{ end }}"
    assert grafana("[state]") == "{{ with $values.STATE }}{{ .Labels.state }}{{ else }}unknown{{ end }}"
    assert grafana("[finding]").endswith("{{ else }}none yet{{ end }}")
    assert grafana("[[value]] [nothing]").startswith("[{{ with $values.A }}")
    assert grafana("[nothing]") == "[nothing]"


def test_grafana_needs_the_auxiliary_queries_its_texts_name_in_a_fixed_order() -> None:
    assert grafana_aux_refs("[engine] [value]") == []
    assert grafana_aux_refs("[finding] [age]", "[state] [budget] [age]") == ["STATE", "BUDGET", "AGE", "FINDING"]
    every = grafana_aux_refs("[state] [budget] [age] [waiting] [running] [finding] [gpus]")
    assert every == list(GRAFANA_AUX)
    assert all("{sel}" in GRAFANA_AUX[ref] for ref in every)


@pytest.mark.parametrize("label", LABELS)
def test_every_label_placeholder_is_the_alerts_label(label: str) -> None:
    assert prometheus(AlertConfig(), f"[{label}]") == grafana(f"[{label}]") == f"{{{{ $labels.{label} }}}}"
