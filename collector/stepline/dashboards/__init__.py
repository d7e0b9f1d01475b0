"""Grafana dashboards generated from code (`generate.DASHBOARDS`, `generate.build`): the timeline in ClickHouse, the
collector's health in Prometheus; and Grafana provisioning for the embedded store (`provisioning`)."""
