"""The node role: the kubelet's pod-resources API asked over gRPC (a fake kubelet on a Unix socket), and each GPU tied
to the pod that holds it."""

from __future__ import annotations

import socket
import tempfile
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
import pytest

from stepline.config.settings import Settings, SettingsError
from stepline.core.clock import ManualClock
from stepline.model.rows import GpuSample, Row
from stepline.sources.base import SourceContext, SourceError
from stepline.sources.gpu.source import GpuSource
from stepline.sources.podresources import (
    ContainerDevices,
    PodResourcesError,
    PodResourcesSource,
    list_pod_resources,
)
from stepline.sources.podresources_pb import SERVICE, messages
from stepline.sources.registry import enabled, node_gpu_sources
from stepline.testing.fake_nvml import FakeNvml

GPU = "nvidia.com/gpu"


def _pod(name: str, namespace: str, containers: dict[str, dict[str, list[str]]]) -> Any:
    m = messages()
    return m.pod(name=name, namespace=namespace, containers=[
        m.container(name=c, devices=[m.devices(resource_name=r, device_ids=ids) for r, ids in devices.items()])
        for c, devices in containers.items()])


@pytest.fixture
def sock_dir() -> Iterator[Path]:
    with tempfile.TemporaryDirectory(prefix="pr") as d:  # short: a Unix socket path holds 107 bytes
        yield Path(d)


@pytest.fixture
def kubelet(sock_dir: Path) -> Iterator[tuple[str, list[Any]]]:
    """A fake kubelet serving v1.PodResourcesLister/List; the test fills its list of pods."""
    m = messages()
    pods: list[Any] = []

    def list_(request: Any, context: grpc.ServicerContext) -> Any:
        return m.response(pod_resources=pods)

    handler = grpc.method_handlers_generic_handler(SERVICE, {"List": grpc.unary_unary_rpc_method_handler(
        list_, request_deserializer=m.request.FromString, response_serializer=lambda r: r.SerializeToString())})
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    server.add_generic_rpc_handlers((handler,))
    path = str(sock_dir / "kubelet.sock")
    server.add_insecure_port(f"unix://{path}")
    server.start()
    try:
        yield path, pods
    finally:
        server.stop(None)


def test_the_client_lists_every_container_and_its_devices(kubelet: tuple[str, list[Any]]) -> None:
    path, pods = kubelet
    pods += [_pod("vllm-0", "llm", {"vllm": {GPU: ["GPU-a", "GPU-b"]}, "stepline": {}}),
             _pod("web", "default", {"nginx": {}}),
             _pod("nic", "net", {"sriov": {"intel.com/sriov": ["0000:3b:02.0"]}})]
    assert list_pod_resources(path) == [
        ContainerDevices("llm", "vllm-0", "vllm", GPU, ("GPU-a", "GPU-b")),
        ContainerDevices("net", "nic", "sriov", "intel.com/sriov", ("0000:3b:02.0",))]


def test_a_missing_or_refusing_socket_is_one_line(sock_dir: Path) -> None:
    with pytest.raises(PodResourcesError, match=r"^pod-resources socket .*/absent.sock does not exist"):
        list_pod_resources(str(sock_dir / "absent.sock"))
    refusing = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    refusing.bind(str(sock_dir / "refuses.sock"))  # bound, never listening: connect() is refused
    try:
        with pytest.raises(PodResourcesError, match=r"refuses.sock: UNAVAILABLE") as caught:
            list_pod_resources(str(sock_dir / "refuses.sock"), timeout_s=5.0)
        assert "\n" not in str(caught.value)
    finally:
        refusing.close()


def _node_role(ctx: SourceContext, settings: Settings, nvml: FakeNvml | None = None) -> (
        tuple[GpuSource, PodResourcesSource]):
    specs = {spec.name: spec for spec in enabled(settings)}
    assert sorted(specs) == ["gpu", "host"]  # no plugin, OTLP or /metrics scraping on a node
    built = specs["gpu"].build(settings, ctx)
    assert [type(s) for s in built] == [GpuSource, PodResourcesSource]
    return node_gpu_sources(settings, ctx, nvml)  # the same, with a fake NVML


def test_the_node_role_ties_each_gpu_to_the_pod_the_kubelet_allocated_it(kubelet: tuple[str, list[Any]]) -> None:
    path, pods = kubelet
    fake = FakeNvml(3)
    uuids = [fake.state(i).uuid for i in range(3)]
    fake.state(0).processes = {48012: 1 << 30}  # a host pid this collector cannot see
    pods += [_pod("vllm-0", "llm", {"vllm": {GPU: [uuids[0]]}}), _pod("vllm-1", "llm", {"vllm": {GPU: [uuids[2]]}})]
    clock = ManualClock()
    ctx = SourceContext("node-1", clock)
    settings = Settings(role="node", pod_resources_socket=path, engine_gpus=(f"spare={uuids[1]}",))
    gpu, refresher = _node_role(ctx, settings, fake)

    rows: list[Row] = []
    refresher.poll(rows.extend)
    assert refresher.retry_in_s() == pytest.approx(10.0)
    gpu.poll(rows.extend)
    assert [r.engine for r in rows if isinstance(r, GpuSample)] == ["vllm-0", "spare", "vllm-1"]
    assert all(isinstance(r, GpuSample) for r in rows)  # the refresher writes no rows

    # vllm-1 goes, vllm-2 gets its GPU: seen at the next refresh, ten seconds on.
    pods[1] = _pod("vllm-2", "llm", {"vllm": {GPU: [uuids[2]]}})
    clock.advance(10.0)
    refresher.poll(rows.extend)
    rows.clear()
    gpu.poll(rows.extend)
    assert [r.engine for r in rows if isinstance(r, GpuSample)][-1] == "vllm-2"


def test_the_node_role_without_a_kubelet_socket_is_a_down_source_not_a_crash(sock_dir: Path) -> None:
    ctx = SourceContext("node-1", ManualClock())
    _, refresher = _node_role(ctx, Settings(role="node", pod_resources_socket=str(sock_dir / "kubelet.sock")))
    with pytest.raises(SourceError, match=r"^pod-resources socket .* does not exist"):
        refresher.poll(lambda rows: None)
    assert refresher.retry_in_s() == pytest.approx(10.0)
    assert refresher.stats()["failures"] == 1


def test_role_settings_are_checked_with_one_line() -> None:
    assert Settings.from_env({"STEPLINE_ROLE": "node"}).role == "node"
    with pytest.raises(SettingsError, match=r"^role 'daemon' must be one of sidecar, node$"):
        Settings.from_env({"STEPLINE_ROLE": "daemon"})
    with pytest.raises(SettingsError, match=r"^role node scrapes no engine: engine 'http://127.0.0.1:8000'"):
        Settings.from_env({"STEPLINE_ROLE": "node", "STEPLINE_ENGINES": "http://127.0.0.1:8000"})
    with pytest.raises(SettingsError, match=r"^role node needs a pod-resources socket"):
        Settings(role="node", pod_resources_socket="").validated()
    sidecar = {spec.name for spec in enabled(Settings(disabled_sources=frozenset({"gpu"})))}
    assert sidecar == {"vllm_metrics", "gateway_metrics", "plugin", "host", "otlp"}
