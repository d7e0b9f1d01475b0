"""docs/compatibility.md, LICENSE and CHANGELOG.md against the files they speak for: every version the table gives is
the one the install scripts, deploy files and pyproject.toml pin, and the license is the one pyproject names."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TABLE = (ROOT / "docs" / "compatibility.md").read_text(encoding="utf-8")


def _pinned(path: str, pattern: str) -> str:
    match = re.search(pattern, (ROOT / path).read_text(encoding="utf-8"), re.M)
    assert match is not None, f"{path} no longer pins {pattern}"
    return match.group(1)


def _row(component: str) -> str:
    row = next((line for line in TABLE.splitlines() if line.startswith(f"| {component} |")), None)
    assert row is not None, f"docs/compatibility.md has no row for {component}"
    return row


def test_every_version_in_the_table_is_the_one_pinned() -> None:
    assert _pinned("tests/realvllm/install.sh", r"^version=(\S+)") in _row("vLLM")
    assert _pinned("deploy/vllm/Dockerfile", r"^FROM vllm/vllm-openai:(\S+)") in _row("vLLM")
    assert _pinned("tests/gateway/install.sh", r"^litellm=(\S+)") in _row("LiteLLM proxy")
    assert _pinned("tests/gateway/install.sh", r"^router=(\S+)") in _row("vllm-router")
    assert _pinned("pyproject.toml", r'"chdb==([^"]+)"') in _row("ClickHouse, embedded")
    assert _pinned("pyproject.toml", r'"clickhouse-connect\[chdb\]==([^"]+)"') in _row("ClickHouse, embedded")
    assert _pinned("pyproject.toml", r'requires-python = "([^"]+)"') in _row("Python")
    compose = "deploy/docker-compose.yml"
    assert _pinned(compose, r"image: clickhouse/clickhouse-server:(\S+)") in _row("ClickHouse server")
    assert _pinned(compose, r"image: grafana/grafana:(\S+)") in _row("Grafana")
    assert _pinned(compose, r"grafana-clickhouse-datasource@(\S+)") in _row("Grafana ClickHouse plugin")
    assert _pinned(compose, r"image: prom/prometheus:(\S+)") in _row("Prometheus")
    assert _pinned(compose, r"image: prom/alertmanager:(\S+)") in _row("Alertmanager")
    assert _pinned("tests/clients/node/package.json", r'"@clickhouse/client": "([^"]+)"') in _row(
        "SQL clients of the query endpoint")


def test_the_engine_side_cost_is_the_measured_one() -> None:
    results = (ROOT / "benchmarks" / "RESULTS.md").read_text(encoding="utf-8")
    row = next(line for line in results.splitlines() if line.startswith("| plugin `record()`"))
    ratio = re.search(r"\| (\d\.\d+x), p99", row)
    assert ratio is not None and f"`record()` takes {ratio.group(1)} of vLLM's own logger" in TABLE
    assert f"costs {ratio.group(1)} of vLLM's own logger" in (ROOT / "README.md").read_text(encoding="utf-8")


def test_the_license_is_the_apache_license_pyproject_names_and_the_readme_links_the_pages() -> None:
    assert 'license = { text = "Apache-2.0" }' in (ROOT / "pyproject.toml").read_text(encoding="utf-8")
    text = (ROOT / "LICENSE").read_text(encoding="utf-8")
    assert "Apache License" in text and "Version 2.0, January 2004" in text and "END OF TERMS AND CONDITIONS" in text
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert "(docs/compatibility.md)" in readme and "(CHANGELOG.md)" in readme
