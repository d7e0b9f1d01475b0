"""Grafana provisioning for the collector's query endpoint: the datasources (the password left to Grafana's
environment), the dashboards provider, and the dashboards copied or generated."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from stepline.dashboards.provisioning import (
    CLICKHOUSE_UID,
    PASSWORD_REF,
    PROMETHEUS_UID,
    ProvisioningError,
    clickhouse_datasource,
    prometheus_datasource,
    write_provisioning,
)


def test_the_clickhouse_datasource_points_at_the_endpoint_with_the_password_from_grafanas_environment() -> None:
    source = clickhouse_datasource("https://reader@ch.example:9443/timeline")
    assert (source["uid"], source["type"], source["secureJsonData"]) == (
        CLICKHOUSE_UID, "grafana-clickhouse-datasource", {"password": PASSWORD_REF})
    assert source["jsonData"] == {"protocol": "http", "host": "ch.example", "port": 9443, "secure": True,
                                  "username": "reader", "defaultDatabase": "timeline"}
    plain = clickhouse_datasource("http://127.0.0.1")
    assert plain["jsonData"]["port"] == 8123 and plain["jsonData"]["defaultDatabase"] == "stepline"  # type: ignore[index]


@pytest.mark.parametrize(("url", "message"), [
    ("127.0.0.1:8124", "must be http\\(s\\)://host:port"),
    ("http://u:secret@h:8124", "carries a password: set STEPLINE_QUERY_PASSWORD"),
    ("http://h:port", "invalid port"),
])
def test_an_unusable_query_url_is_refused_without_its_password(url: str, message: str) -> None:
    with pytest.raises(ProvisioningError, match=message) as refused:
        clickhouse_datasource(url)
    assert "secret" not in str(refused.value)


def test_copied_dashboards_get_a_provider_and_both_datasources(tmp_path: Path) -> None:
    given = tmp_path / "given"
    given.mkdir()
    (given / "steps.json").write_text(json.dumps({"title": "Steps"}))
    written = write_provisioning(tmp_path / "out", dashboards_dir=given, prometheus_url="http://prom:9090")
    out = (tmp_path / "out").resolve()
    assert written == [out / "provisioning/datasources/stepline.yaml", out / "dashboards/steps.json",
                       out / "provisioning/dashboards/stepline.yaml"]
    datasources = yaml.safe_load(written[0].read_text())["datasources"]
    assert [d["uid"] for d in datasources] == [CLICKHOUSE_UID, PROMETHEUS_UID]
    (provider,) = yaml.safe_load(written[2].read_text())["providers"]
    assert provider["options"]["path"] == str(out / "dashboards") and provider["folder"] == "stepline"
    with pytest.raises(ProvisioningError, match="Prometheus URL"):
        prometheus_datasource("prom:9090")


def test_a_folder_without_dashboards_gives_the_datasources_only(tmp_path: Path) -> None:
    written = write_provisioning(tmp_path / "out", dashboards_dir=tmp_path)
    assert [p.name for p in written] == ["stepline.yaml"] and not (tmp_path / "out" / "dashboards").exists()
