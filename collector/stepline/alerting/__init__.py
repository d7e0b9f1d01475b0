"""Alert rules for stepline, generated from one config: Prometheus, Alertmanager and Grafana-managed."""

from stepline.alerting.build import build
from stepline.alerting.config import AlertConfig, Slo

__all__ = ["AlertConfig", "Slo", "build"]
