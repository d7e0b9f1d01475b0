"""The registry of sources: each with a name, a default interval, a default on/off, and a builder."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from stepline.settings import Settings, SettingsError
from stepline.sources import vllm_metrics
from stepline.sources.base import Source, SourceContext


@dataclass(frozen=True)
class SourceSpec:
    """How to make the sources of one kind from the settings."""

    name: str
    help: str
    enabled_by_default: bool
    interval_s: Callable[[Settings], float]
    build: Callable[[Settings, SourceContext], list[Source]]


def _vllm_metrics(settings: Settings, ctx: SourceContext) -> list[Source]:
    return list(vllm_metrics.build(ctx, settings.engines, settings.scrape_timeout))


REGISTRY: tuple[SourceSpec, ...] = (
    SourceSpec(
        "vllm_metrics",
        "scrape each --engine's /metrics into engine_samples",
        True,
        lambda s: s.scrape_interval_s,
        _vllm_metrics,
    ),
)


def enabled(settings: Settings) -> list[SourceSpec]:
    """The specs the settings leave switched on; unknown names in disabled_sources are an error."""
    known = {spec.name for spec in REGISTRY}
    unknown = settings.disabled_sources - known
    if unknown:
        raise SettingsError(f"unknown source(s) {', '.join(sorted(unknown))}: known are {', '.join(sorted(known))}")
    return [s for s in REGISTRY if s.enabled_by_default and s.name not in settings.disabled_sources]
