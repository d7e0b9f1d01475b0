"""The registry of sources: each with a name, a default interval, a default on/off, and a builder."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from stepline.config.settings import Settings, SettingsError
from stepline.sources import gateway_metrics, vllm_metrics
from stepline.sources.base import Source, SourceContext
from stepline.sources.gpu.nvml import Nvml
from stepline.sources.gpu.owners import PodGpus
from stepline.sources.gpu.source import GpuSource
from stepline.sources.host import EngineTarget, HostSource, targets_from_engines
from stepline.sources.otlp import OtlpReceiver
from stepline.sources.plugin_receiver import PluginReceiver
from stepline.sources.podresources import PodResourcesSource


@dataclass(frozen=True)
class SourceSpec:
    """How to make the sources of one kind from the settings."""

    name: str
    help: str
    enabled_by_default: bool
    interval_s: Callable[[Settings], float]
    build: Callable[[Settings, SourceContext], list[Source]]
    roles: frozenset[str] = field(default=frozenset({"sidecar"}))  # the collector roles (Settings.role) it runs in


def _vllm_metrics(settings: Settings, ctx: SourceContext) -> list[Source]:
    return list(vllm_metrics.build(ctx, settings.engines, settings.scrape_timeout))


def _gateway_metrics(settings: Settings, ctx: SourceContext) -> list[Source]:
    return list(gateway_metrics.build(ctx, settings.gateways, settings.scrape_timeout, settings.gateway_token))


def _plugin(settings: Settings, ctx: SourceContext) -> list[Source]:
    return [PluginReceiver(ctx, settings.plugin_socket, token=settings.plugin_token)]


def _gpu(settings: Settings, ctx: SourceContext) -> list[Source]:
    if settings.role == "node":
        return list(node_gpu_sources(settings, ctx))
    return [GpuSource(ctx, configured_gpus=settings.engine_gpu_map())]


def node_gpu_sources(settings: Settings, ctx: SourceContext, nvml: Nvml | None = None) -> (
        tuple[GpuSource, PodResourcesSource]):
    """The node role's GPU source and the pod-resources refresher it reads: the kubelet says which pod holds which
    GPU (engine = pod name), the setting decides for GPUs no pod holds. The refresher keeps its own pace
    (retry_in_s), whatever interval it is scheduled at."""
    configured = settings.engine_gpu_map()
    pods = PodGpus()
    gpu = GpuSource(ctx, nvml, engine_of_gpu=lambda uuid: pods.engine(uuid) or configured.get(uuid, ""),
                    gpu_generation=pods.generation)
    return gpu, PodResourcesSource(ctx, pods, settings.pod_resources_socket)


def _host(settings: Settings, ctx: SourceContext) -> list[Source]:
    given = []
    for spec in settings.engine_processes:
        name, _, how = spec.partition("=")
        given.append(EngineTarget(name, cmdline=how.removeprefix("cmdline:")) if how.startswith("cmdline:")
                     else EngineTarget(name, pid=int(how)))
    named = {target.name for target in given}
    by_port = [t for t in targets_from_engines(settings.engines) if t.name not in named]
    return [HostSource(ctx, engines=given + by_port)]


def _otlp(settings: Settings, ctx: SourceContext) -> list[Source]:
    return [OtlpReceiver(ctx, settings.listen, settings.otlp_port, token=settings.otlp_token)]


REGISTRY: tuple[SourceSpec, ...] = (
    SourceSpec(
        "vllm_metrics",
        "scrape each --engine's /metrics into engine_samples",
        True,
        lambda s: s.scrape_interval_s,
        _vllm_metrics,
    ),
    SourceSpec(
        "gateway_metrics",
        "scrape each --gateway's /metrics (LiteLLM proxy, vllm-router) into gateway_samples",
        True,
        lambda s: s.scrape_interval_s,
        _gateway_metrics,
    ),
    SourceSpec(
        "plugin",
        "receive every engine step and finished request from the vLLM stat-logger plugin (Unix datagram socket)",
        True,
        lambda s: 0.001,  # each poll reads for a 0.2 s window itself: this is only the gap between reads
        _plugin,
    ),
    SourceSpec(
        "gpu",
        "sample every GPU's clocks, power, memory bandwidth, PCIe/NVLink and throttle reasons through NVML "
        "(no GPU or no NVML: up=0, the rest runs on)",
        True,
        lambda s: s.gpu_interval_s,
        _gpu,
        frozenset({"sidecar", "node"}),
    ),
    SourceSpec(
        "host",
        "sample the host (CPU, memory, network, disk) and each local engine's process with psutil",
        True,
        lambda s: s.host_interval_s,
        _host,
        frozenset({"sidecar", "node"}),
    ),
    SourceSpec(
        "otlp",
        "receive vLLM's llm_request spans over OTLP/HTTP into requests",
        True,
        lambda s: 0.5,
        _otlp,
    ),
)


def enabled(settings: Settings) -> list[SourceSpec]:
    """The specs the settings' role runs and leaves switched on; unknown names in disabled_sources are an error."""
    known = {spec.name for spec in REGISTRY}
    unknown = settings.disabled_sources - known
    if unknown:
        raise SettingsError(f"unknown source(s) {', '.join(sorted(unknown))}: known are {', '.join(sorted(known))}")
    return [s for s in REGISTRY
            if s.enabled_by_default and settings.role in s.roles and s.name not in settings.disabled_sources]
