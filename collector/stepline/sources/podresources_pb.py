"""The kubelet pod-resources API's List messages (package v1), built with google.protobuf at first use.

Only what `v1.PodResourcesLister/List` needs, with kubelet's package, service, message names and field numbers, so the
bytes are kubelet's: fields left out (cpu_ids, memory, topology, dynamic_resources) are skipped as unknown fields on
decoding. Checked against kubelet's own proto (see the comment above `_MESSAGES`).
"""

from __future__ import annotations

from functools import cache
from typing import Any, NamedTuple

from google.protobuf import descriptor_pb2, descriptor_pool, message_factory  # type: ignore[import-untyped]

SERVICE = "v1.PodResourcesLister"
LIST_METHOD = f"/{SERVICE}/List"

_STRING = descriptor_pb2.FieldDescriptorProto.TYPE_STRING
_MESSAGE = descriptor_pb2.FieldDescriptorProto.TYPE_MESSAGE
_OPTIONAL = descriptor_pb2.FieldDescriptorProto.LABEL_OPTIONAL
_REPEATED = descriptor_pb2.FieldDescriptorProto.LABEL_REPEATED

# Field names, numbers and types as in kubelet's pkg/apis/podresources/v1/api.proto (kubernetes/kubelet, the
# staging copy of kubernetes/kubernetes staging/src/k8s.io/kubelet/pkg/apis/podresources/v1/api.proto), compared at
# tags v0.20.0 (Kubernetes 1.20, 30b4cd52c54d), v0.28.0 (64c8471fa33c), v0.36.0 (eb8f71c979ae) and master
# 63b3249724f7 (package v1, service PodResourcesLister, rpc List): the same in all. The fields left out
# (ContainerDevices.topology = 3, ContainerResources.cpu_ids = 3, memory = 4, dynamic_resources = 5, and on master
# PodResources.cpu_ids = 4, memory = 5) are skipped as unknown on decoding.
# message -> its fields: (name, number, label, type, message type name or "")
_MESSAGES: dict[str, tuple[tuple[str, int, int, int, str], ...]] = {
    "ListPodResourcesRequest": (),
    "ListPodResourcesResponse": (("pod_resources", 1, _REPEATED, _MESSAGE, "PodResources"),),
    "PodResources": (("name", 1, _OPTIONAL, _STRING, ""), ("namespace", 2, _OPTIONAL, _STRING, ""),
                     ("containers", 3, _REPEATED, _MESSAGE, "ContainerResources")),
    "ContainerResources": (("name", 1, _OPTIONAL, _STRING, ""),
                           ("devices", 2, _REPEATED, _MESSAGE, "ContainerDevices")),
    "ContainerDevices": (("resource_name", 1, _OPTIONAL, _STRING, ""), ("device_ids", 2, _REPEATED, _STRING, "")),
}


class Messages(NamedTuple):
    """The message classes of the List call."""

    request: Any  # ListPodResourcesRequest
    response: Any  # ListPodResourcesResponse
    pod: Any  # PodResources
    container: Any  # ContainerResources
    devices: Any  # ContainerDevices


@cache
def messages() -> Messages:
    """The message classes, built once in a pool of their own (nothing registered globally)."""
    file = descriptor_pb2.FileDescriptorProto(name="stepline/podresources/v1/api.proto", package="v1",
                                              syntax="proto3")
    for name, fields in _MESSAGES.items():
        message = file.message_type.add(name=name)
        for field, number, label, kind, type_name in fields:
            message.field.add(name=field, number=number, label=label, type=kind,
                              type_name=f".v1.{type_name}" if type_name else None)
    service = file.service.add(name="PodResourcesLister")
    service.method.add(name="List", input_type=".v1.ListPodResourcesRequest",
                       output_type=".v1.ListPodResourcesResponse")
    pool = descriptor_pool.DescriptorPool()
    pool.Add(file)
    classes = [message_factory.GetMessageClass(pool.FindMessageTypeByName(f"v1.{name}")) for name in _MESSAGES]
    return Messages(*classes)
