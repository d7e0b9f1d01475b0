"""A gateway's backend, named as the collector names the engine it watches at that address."""

from __future__ import annotations

from stepline.gateway.decisions import backend_engine
from stepline.sources.addresses import EngineAddresses

# As the README's attach section names engines.
ENGINES = ("heavy=http://127.0.0.1:8001/metrics", "fast=http://localhost:8002", "http://10.0.0.7:8000",
           "a=http://svc.ns:8000", "b=http://svc.ns:8000/metrics")


def test_a_backend_is_named_as_the_engine_at_its_address() -> None:
    addresses = EngineAddresses(ENGINES)
    # LiteLLM's api_base, vllm-router's worker URL: another path, another loopback name, the same address.
    assert addresses.name_of(backend_engine("http://127.0.0.1:8001/v1")) == "heavy"
    assert addresses.name_of(backend_engine("http://0.0.0.0:8002/v1")) == "fast"
    assert addresses.name_of(backend_engine("http://[::1]:8002")) == "fast"
    assert addresses.name_of(backend_engine("http://LOCALHOST:8001")) == "heavy"
    assert addresses.name_of("10.0.0.7:8000") == "10.0.0.7:8000"  # named by its URL: host:port, as it was


def test_an_address_the_collector_does_not_watch_or_shares_keeps_its_name() -> None:
    addresses = EngineAddresses(ENGINES)
    assert addresses.name_of("127.0.0.1:9999") == "127.0.0.1:9999"
    assert addresses.name_of("fast") == "fast"  # a lane or a deployment name, no address
    assert addresses.name_of(backend_engine("http://svc.ns:8000/v1")) == "svc.ns:8000"  # two engines behind it
    assert addresses.shared == {"svc.ns:8000": ["a", "b"]}
    assert EngineAddresses().name_of("127.0.0.1:8001") == "127.0.0.1:8001"


def test_a_service_in_front_of_replicas_is_declared_and_names_the_engines_behind_it() -> None:
    """`--backend vllm.svc:8000=a --backend vllm.svc:8000=b`: a Kubernetes service the collector does not watch
    stands for engines a and b; the decision keeps the service's name, and the join looks across both. One engine
    declared behind an address (a pod's address, where the sidecar watches 127.0.0.1) is that address's name."""
    declared = {("vllm.svc", 8000): ("a", "b"), ("10.1.2.3", 8000): ("pod-0",)}
    addresses = EngineAddresses(("pod-0=http://127.0.0.1:8000",), declared)
    assert addresses.name_of(backend_engine("http://vllm.svc:8000/v1")) == "vllm.svc:8000"
    assert addresses.behind("vllm.svc:8000") == ["a", "b"]
    assert addresses.name_of("10.1.2.3:8000") == "pod-0" and addresses.behind("10.1.2.3:8000") == []
    assert addresses.behind("127.0.0.1:8000") == [] and addresses.behind("fast") == []
    # Two watched names for one URL stand for both, too.
    assert EngineAddresses(ENGINES).behind("svc.ns:8000") == ["a", "b"]
