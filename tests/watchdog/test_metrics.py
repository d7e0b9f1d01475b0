"""The watchdog's metrics: declared on the registry given (no global one), each engine's figure keyed by its engine."""

from __future__ import annotations

from prometheus_client import CollectorRegistry
from prometheus_client.metrics import MetricWrapperBase

from stepline.watchdog.metrics import WatchdogMetrics


def test_two_collectors_count_apart() -> None:
    one, other = WatchdogMetrics(CollectorRegistry()), WatchdogMetrics(CollectorRegistry())
    one.preemptions.labels("e1").inc(3)
    one.slo.slo_requests.labels("ttft", "e1", "m", "", "").inc()
    assert one.registry.get_sample_value("stepline_engine_preemptions_total", {"engine": "e1"}) == 3
    assert other.registry.get_sample_value("stepline_engine_preemptions_total", {"engine": "e1"}) is None
    assert other.registry.get_sample_value("stepline_slo_requests_total", {
        "objective": "ttft", "engine": "e1", "model": "m", "lane": "", "tenant": ""}) is None


def test_every_engine_figure_is_keyed_by_its_engine_first() -> None:
    """The alert rules and the engine dashboard join the figures on `engine`."""
    metrics = WatchdogMetrics(CollectorRegistry())
    engine_figures = {m._name: m._labelnames for m in vars(metrics).values()
                      if isinstance(m, MetricWrapperBase) and m._name.startswith(("stepline_engine_", "stepline_gpu_"))}
    assert len(engine_figures) > 20
    keyed = {name for name, labels in engine_figures.items() if labels[:1] == ("engine",)}
    assert sorted(set(engine_figures) - keyed) == ["stepline_gpu_expected", "stepline_gpu_present"]  # per machine
