"""AlertConfig: the one object every selector, threshold and duration of the alert rules is read from, its selector
joined into each metric's matchers and its runbook links."""

from __future__ import annotations

import re
from dataclasses import fields, replace

from stepline.alerting.config import AlertConfig
from stepline.config.slo import Slo


def test_the_selector_comes_first_in_every_metrics_matchers() -> None:
    cfg = AlertConfig()
    assert cfg.sel() == '{job="stepline"}'
    assert cfg.sel('engine="e1"', "", 'reason=~"refused|gone"') == (
        '{job="stepline", engine="e1", reason=~"refused|gone"}')
    assert replace(cfg, selector="").sel('engine="e1"') == '{engine="e1"}'


def test_runbook_links_point_at_the_alerts_lower_cased_section() -> None:
    assert AlertConfig().runbook("EngineWedgedWithQueue").endswith("/alerts/runbook.md#enginewedgedwithqueue")
    mine = replace(AlertConfig(), runbook_url="https://wiki.example/runbooks/{anchor}")
    assert mine.runbook("EngineGone") == "https://wiki.example/runbooks/enginegone"


def test_every_duration_is_one_prometheus_reads_and_the_slo_is_the_shared_one() -> None:
    cfg = AlertConfig()
    durations = {f.name: getattr(cfg, f.name) for f in fields(cfg)
                 if f.name.endswith(("_for", "_window", "_lookback", "_interval", "_since"))}
    assert len(durations) > 20
    for name, value in durations.items():
        assert re.fullmatch(r"\d+[smhd]", value), (name, value)
    assert cfg.slo == Slo() and 0 < cfg.kv_usage_warning_ratio < cfg.kv_usage_critical_ratio < 1
