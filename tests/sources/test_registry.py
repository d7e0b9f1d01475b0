"""The registry of sources: each named, on by default or not, in the roles it runs in, built from the settings."""

from __future__ import annotations

import time

import pytest

from stepline.config.settings import Settings, SettingsError
from stepline.core.clock import ManualClock
from stepline.sources.base import SourceContext
from stepline.sources.host import EngineTarget, HostSource
from stepline.sources.otlp import OtlpReceiver
from stepline.sources.plugin_receiver import PluginReceiver
from stepline.sources.registry import REGISTRY, enabled


def test_every_source_has_a_unique_name_a_help_line_and_a_role() -> None:
    names = [spec.name for spec in REGISTRY]
    assert names == ["vllm_metrics", "gateway_metrics", "plugin", "gpu", "host", "otlp"]
    for spec in REGISTRY:
        assert spec.help and "\n" not in spec.help and spec.roles <= {"sidecar", "node"}, spec.name
        assert spec.interval_s(Settings()) > 0, spec.name


def test_the_role_and_the_switches_decide_what_runs() -> None:
    assert [s.name for s in enabled(Settings())] == [spec.name for spec in REGISTRY]
    assert [s.name for s in enabled(Settings(disabled_sources=frozenset({"gpu", "otlp"})))] == [
        "vllm_metrics", "gateway_metrics", "plugin", "host"]
    assert [s.name for s in enabled(Settings(role="node"))] == ["gpu", "host"]


def test_an_unknown_source_switched_off_is_refused_naming_the_known_ones() -> None:
    with pytest.raises(SettingsError, match="unknown source\\(s\\) nvme: known are gateway_metrics, gpu, host"):
        enabled(Settings(disabled_sources=frozenset({"nvme"})))


def test_the_receivers_are_built_on_the_settings_socket_and_port() -> None:
    settings = Settings(plugin_socket="/run/stepline-test/p.sock", otlp_port=14318)
    specs = {spec.name: spec for spec in REGISTRY}
    ctx = SourceContext("h", ManualClock())
    (plugin,) = specs["plugin"].build(settings, ctx)
    (otlp,) = specs["otlp"].build(settings, ctx)
    assert isinstance(plugin, PluginReceiver) and plugin.socket_path == "/run/stepline-test/p.sock"
    assert isinstance(otlp, OtlpReceiver)


def test_the_collector_builds_targets_from_engines_and_given_processes() -> None:
    settings = Settings.from_env({}, engines=("http://127.0.0.1:8000", "b=http://127.0.0.1:9000"),
                                 engine_processes=("b=cmdline:vllm serve --port 9000", "c=4242"))
    (spec,) = [s for s in REGISTRY if s.name == "host"]
    (source,) = spec.build(settings, SourceContext("h", ManualClock(time.time())))
    assert isinstance(source, HostSource)
    assert source.targets == [EngineTarget("b", cmdline="vllm serve --port 9000"), EngineTarget("c", pid=4242),
                              EngineTarget("127.0.0.1:8000", port=8000)]

