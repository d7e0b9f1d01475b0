"""`stepline prometheus-config`: the collector's default address, or those given; a bad address in one line."""

from __future__ import annotations

import pytest
import yaml

from stepline.cli import prometheus_config
from stepline.cli.main import main
from stepline.config.settings import Settings


def test_by_default_the_collector_where_it_listens_by_default(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["prometheus-config"]) == 0
    config = yaml.safe_load(capsys.readouterr().out)
    assert config["scrape_configs"][0]["static_configs"][0]["targets"] == [
        f"{Settings.listen}:{Settings.metrics_port}"]
    assert config["rule_files"] == ["alerts/prometheus-rules.yaml"]


def test_collectors_rules_and_alertmanager_as_given(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["prometheus-config", "--target", "gpu-0:9465", "--target", "[fd00::1]:9465", "--rules",
                 "/etc/prometheus/stepline.yaml", "--alertmanager", ""]) == 0
    config = yaml.safe_load(capsys.readouterr().out)
    assert config["scrape_configs"][0]["static_configs"][0]["targets"] == ["gpu-0:9465", "[fd00::1]:9465"]
    assert config["rule_files"] == ["/etc/prometheus/stepline.yaml"] and "alerting" not in config


@pytest.mark.parametrize("address", ["http://gpu-0:9465", "gpu-0", "gpu-0:metrics", "gpu-0:70000"])
def test_an_address_that_is_no_host_port_is_one_line(address: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["prometheus-config", "--target", address]) == 2
    out = capsys.readouterr()
    assert out.out == ""
    assert out.err == f"stepline: {address!r} is no HOST:PORT (Prometheus scrapes http://HOST:PORT/metrics)\n"


def test_the_help_says_how_to_use_it() -> None:
    assert "stepline prometheus-config > prometheus.yml" in prometheus_config.DESCRIPTION
