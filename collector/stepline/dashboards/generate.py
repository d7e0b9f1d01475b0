"""Render every dashboard to JSON: sorted keys, two-space indent, fixed uids, so the files diff cleanly."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

from grafana_foundation_sdk.builders import dashboard as db
from grafana_foundation_sdk.cog.encoder import JSONEncoder

from stepline.alerting.config import AlertConfig
from stepline.dashboards import collector, engine, fleet, gateway, gpu, requests, slo, usage

DASHBOARDS: dict[str, Callable[[AlertConfig], db.Dashboard]] = {
    "fleet-overview.json": fleet.dashboard,
    "engine-timeline.json": engine.dashboard,
    "requests.json": requests.dashboard,
    "gpu.json": gpu.dashboard,
    "gateway-lanes.json": gateway.dashboard,
    "collector-health.json": collector.dashboard,
    "slo.json": slo.dashboard,
    "usage.json": usage.dashboard,
}


def render(make: Callable[[AlertConfig], db.Dashboard], config: AlertConfig) -> str:
    """One dashboard's JSON text, with panel ids and grid positions assigned."""
    model = json.loads(json.dumps(make(config).build(), cls=JSONEncoder))
    _layout(model["panels"])
    return json.dumps(model, sort_keys=True, indent=2) + "\n"


def _layout(panels: list[dict[str, object]]) -> None:
    """Number panels and flow them left to right, top to bottom, on Grafana's 24-column grid."""
    x = y = row_h = 0
    for number, panel in enumerate(panels, start=1):
        pos = panel["gridPos"]
        assert isinstance(pos, dict)
        w, h = int(pos.get("w", 12)), int(pos.get("h", 8))
        if x + w > 24:
            x, y, row_h = 0, y + row_h, 0
        panel["id"] = number
        panel["gridPos"] = {"h": h, "w": w, "x": x, "y": y}
        x, row_h = x + w, max(row_h, h)


def build(out_dir: Path | str, config: AlertConfig | None = None) -> list[Path]:
    """Write every dashboard into `out_dir`; returns the files written."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for name, make in DASHBOARDS.items():
        path = out / name
        path.write_text(render(make, config or AlertConfig()), encoding="utf-8")
        written.append(path)
    return written
