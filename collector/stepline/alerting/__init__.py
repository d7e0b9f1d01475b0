"""Alert rules for stepline, generated from one config (`config.AlertConfig`): Prometheus, Alertmanager and
Grafana-managed (`build.build`), and the receivers they reach (`receivers.Receiver`)."""
