"""The kubelet pod-resources List messages: kubelet's field numbers on the wire, the fields stepline leaves out
skipped when kubelet sends them, and nothing registered in protobuf's global pool."""

from __future__ import annotations

import pytest
from google.protobuf import descriptor_pool  # type: ignore[import-untyped]

from stepline.sources.podresources_pb import LIST_METHOD, SERVICE, messages


def _field(number: int, payload: bytes) -> bytes:
    """One length-delimited field as protobuf writes it (tag, then a one-byte length: payloads here are short)."""
    assert len(payload) < 128
    return bytes([number << 3 | 2, len(payload)]) + payload


def test_a_response_is_encoded_with_kubelets_field_numbers() -> None:
    m = messages()
    devices = m.devices(resource_name="nvidia.com/gpu", device_ids=["GPU-1"])
    container = m.container(name="vllm", devices=[devices])
    response = m.response(pod_resources=[m.pod(name="vllm-0", namespace="ml", containers=[container])])
    wire_devices = _field(1, b"nvidia.com/gpu") + _field(2, b"GPU-1")
    wire_container = _field(1, b"vllm") + _field(2, wire_devices)
    wire_pod = _field(1, b"vllm-0") + _field(2, b"ml") + _field(3, wire_container)
    assert response.SerializeToString() == _field(1, wire_pod)


def test_fields_kubelet_sends_that_stepline_leaves_out_are_skipped() -> None:
    m = messages()
    topology = _field(3, _field(1, b"\x08\x00"))  # ContainerDevices.topology (NUMA nodes)
    cpu_ids = bytes([3 << 3 | 2, 2, 1, 2])  # ContainerResources.cpu_ids, packed
    container = _field(1, b"vllm") + _field(2, _field(1, b"nvidia.com/gpu") + _field(2, b"GPU-7") + topology) \
        + cpu_ids
    response = m.response.FromString(_field(1, _field(1, b"p") + _field(3, container)))
    (pod,) = response.pod_resources
    assert (pod.name, pod.containers[0].name, list(pod.containers[0].devices[0].device_ids)) == ("p", "vllm",
                                                                                                ["GPU-7"])


def test_the_service_is_kubelets_and_its_classes_stay_out_of_the_global_pool() -> None:
    assert (SERVICE, LIST_METHOD) == ("v1.PodResourcesLister", "/v1.PodResourcesLister/List")
    assert messages() is messages()  # built once
    assert messages().request().SerializeToString() == b""
    with pytest.raises(KeyError):
        descriptor_pool.Default().FindMessageTypeByName("v1.PodResources")
