"""Grafana dashboards generated from code: the timeline in ClickHouse, the collector's health in Prometheus."""

from stepline.dashboards.generate import DASHBOARDS, build

__all__ = ["DASHBOARDS", "build"]
