"""The bare-metal Prometheus configuration: the collector scraped under the job the rules select, promtool-valid."""

from __future__ import annotations

import dataclasses
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from stepline.alerting.build import build
from stepline.alerting.config import AlertConfig
from stepline.alerting.scrape import SCRAPE_INTERVAL, job_name, prometheus_config


def test_the_job_is_the_one_every_rule_selects(tmp_path: Path) -> None:
    config = yaml.safe_load(prometheus_config(["127.0.0.1:9465", "gpu-2:9465"], "rules.yaml", ["127.0.0.1:9093"]))
    (scrape,) = config["scrape_configs"]
    assert scrape == {"job_name": "stepline", "static_configs": [{"targets": ["127.0.0.1:9465", "gpu-2:9465"]}]}
    assert config["global"]["scrape_interval"] == SCRAPE_INTERVAL == "5s"
    assert config["rule_files"] == ["rules.yaml"]
    assert config["alerting"]["alertmanagers"][0]["static_configs"][0]["targets"] == ["127.0.0.1:9093"]
    build(str(tmp_path), AlertConfig())
    assert f'job="{scrape["job_name"]}"' in (tmp_path / "prometheus-rules.yaml").read_text(encoding="utf-8")
    assert "alerting" not in yaml.safe_load(prometheus_config(["h:9465"], "r.yaml", []))


def test_a_selector_of_another_job_names_that_job_and_one_of_no_job_is_refused() -> None:
    assert job_name(dataclasses.replace(AlertConfig(), selector='job="gpu-sidecars"')) == "gpu-sidecars"
    with pytest.raises(ValueError, match="names no single job"):
        job_name(dataclasses.replace(AlertConfig(), selector='namespace="stepline"'))
    with pytest.raises(ValueError, match="no collector to scrape"):
        prometheus_config([], "r.yaml", [])


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool not installed (apt-get install prometheus)")
def test_promtool_accepts_it_with_the_generated_rules(tmp_path: Path) -> None:
    build(str(tmp_path / "alerts"), AlertConfig())
    (tmp_path / "prometheus.yml").write_text(
        prometheus_config(["127.0.0.1:9465"], "alerts/prometheus-rules.yaml", ["127.0.0.1:9093"]), encoding="utf-8")
    done = subprocess.run(["promtool", "check", "config", str(tmp_path / "prometheus.yml")],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "SUCCESS" in done.stdout + done.stderr and "rules found" in done.stdout + done.stderr
