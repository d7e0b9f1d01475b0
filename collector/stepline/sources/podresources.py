"""The kubelet's pod-resources API (`v1.PodResourcesLister/List` on a Unix socket): which pod holds which GPU.

The node role's way to tie GPUs to engines, as NVIDIA's dcgm-exporter does from its DaemonSet: the kubelet lists every
pod's containers with the devices the device plugins allocated them; for `nvidia.com/gpu` the ids are GPU UUIDs.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from typing import Any, NamedTuple

import grpc

from stepline.sources.base import Emit, SourceContext, SourceError
from stepline.sources.gpu.owners import PodGpus
from stepline.sources.podresources_pb import LIST_METHOD, messages

log = logging.getLogger(__name__)

DEFAULT_SOCKET = "/var/lib/kubelet/pod-resources/kubelet.sock"
GPU_RESOURCE = "nvidia.com/gpu"
REFRESH_S = 10.0


class PodResourcesError(RuntimeError):
    """The pod-resources API could not be asked; the message is one line naming the socket."""


class ContainerDevices(NamedTuple):
    """One container's devices of one resource, as the kubelet allocated them."""

    namespace: str
    pod: str
    container: str
    resource: str
    device_ids: tuple[str, ...]


def list_pod_resources(socket_path: str, timeout_s: float = 5.0) -> list[ContainerDevices]:
    """Every container's devices on this node, from `v1.PodResourcesLister/List`; raises PodResourcesError."""
    if not os.path.exists(socket_path):
        raise PodResourcesError(f"pod-resources socket {socket_path} does not exist (mount the node's "
                                f"/var/lib/kubelet/pod-resources)")
    m = messages()
    try:
        with grpc.insecure_channel(f"unix://{socket_path}") as channel:
            call = channel.unary_unary(LIST_METHOD, request_serializer=_serialize,
                                       response_deserializer=m.response.FromString)
            response: Any = call(m.request(), timeout=timeout_s)
    except grpc.RpcError as exc:
        code, details = (exc.code(), exc.details()) if isinstance(exc, grpc.Call) else (None, str(exc))
        name = code.name if code is not None else "ERROR"
        raise PodResourcesError(f"pod-resources socket {socket_path}: {name}: "
                                f"{' '.join(str(details or '').split())[:200]}") from None
    return [ContainerDevices(pod.namespace, pod.name, container.name, devices.resource_name,
                             tuple(devices.device_ids))
            for pod in response.pod_resources for container in pod.containers for devices in container.devices]


def _serialize(message: Any) -> bytes:
    return bytes(message.SerializeToString())


def gpu_engines(containers: list[ContainerDevices]) -> dict[str, str]:
    """GPU UUID -> engine (its pod's name); a GPU listed for two pods goes to neither."""
    engines: dict[str, str] = {}
    shared: set[str] = set()
    for c in containers:
        if c.resource != GPU_RESOURCE:
            continue
        for uuid in c.device_ids:
            if engines.setdefault(uuid, c.pod) != c.pod:
                shared.add(uuid)
    return {uuid: pod for uuid, pod in engines.items() if uuid not in shared}


class PodResourcesSource:
    """Refreshes `pods` from the pod-resources API every REFRESH_S; writes no rows. Down (one line) while the socket
    is missing or refuses, keeping the last answer: the GPU source samples on either way."""

    def __init__(self, ctx: SourceContext, pods: PodGpus, socket_path: str = DEFAULT_SOCKET, *,
                 refresh_s: float = REFRESH_S) -> None:
        self._ctx = ctx
        self._pods = pods
        self._socket = socket_path
        self._refresh_s = refresh_s
        self._next_at: float | None = None
        self._refreshes = self._failures = 0
        self._gpus = 0

    @property
    def name(self) -> str:
        return "podresources"

    def retry_in_s(self) -> float:
        """Seconds until the next refresh: the runner polls this source at that pace, not the GPU source's."""
        if self._next_at is None:
            return 0.0
        return max(0.0, self._next_at - self._ctx.clock.monotonic())

    def stats(self) -> Mapping[str, int]:
        return {"refreshes": self._refreshes, "failures": self._failures, "gpus_attributed": self._gpus}

    def poll(self, emit: Emit) -> None:
        now = self._ctx.clock.monotonic()
        if self._next_at is not None and now < self._next_at:
            return
        self._next_at = now + self._refresh_s
        try:
            engines = gpu_engines(list_pod_resources(self._socket))
        except PodResourcesError as exc:
            self._failures += 1
            raise SourceError(str(exc)) from None
        self._refreshes += 1
        self._gpus = len(engines)
        self._pods.replace(engines)
