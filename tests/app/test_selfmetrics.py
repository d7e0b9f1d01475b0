"""app.selfmetrics: the collector's metrics, each declared by its owner, exported exactly as before the split.

The alert rules and dashboards read these names, labels and help texts. tests/fixtures/selfmetrics-before-split.json
is what the one `SelfMetrics` class of `stepline.core.selfmetrics` declared until each subsystem declared its own
(read from its registry at main 3051088, in the order it registered them). A change to it is a change for every
user's rules: make it on purpose.
"""

from __future__ import annotations

import json
from pathlib import Path

from prometheus_client import CollectorRegistry

from stepline.app.selfmetrics import SelfMetrics

BEFORE = Path(__file__).parents[1] / "fixtures" / "selfmetrics-before-split.json"

Declared = tuple[str, str, tuple[str, ...], str]  # name without _total, type, label names, help


def _before() -> list[Declared]:
    return [(m["name"], m["type"], tuple(m["labels"]), m["help"]) for m in json.loads(BEFORE.read_text())]


def _exported(metrics: SelfMetrics) -> list[Declared]:
    labels = metrics.label_names()
    return [(f.name, f.type, labels[f.name], f.documentation) for f in metrics.registry.collect()]


def test_every_metric_keeps_its_name_type_labels_and_help() -> None:
    before = _before()
    assert len(before) == 50
    assert sorted(_exported(SelfMetrics())) == sorted(before)


def test_each_metric_is_declared_once_on_the_registry_it_is_given() -> None:
    registry = CollectorRegistry()
    metrics = SelfMetrics(registry)
    assert metrics.registry is registry
    names = [family.name for family in registry.collect()]
    assert len(names) == len(set(names)) == len(_before())
