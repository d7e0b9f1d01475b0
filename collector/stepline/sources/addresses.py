"""The engines the collector watches, by the address it reaches each at: what a gateway calls a backend (the URL it
sends to, LiteLLM's deployment `api_base`, vllm-router's worker URL) is named as the collector names the engine at
that address (`--engine fast=http://10.0.0.5:8000` names it `fast`), so decisions join the engine's requests
whatever the engine is called.

Loopback names are one address (`localhost`, `127.0.0.1`, `::1`, `0.0.0.0`: a gateway beside the engine may call it
any of them). A backend the collector does not reach its engines at (a Kubernetes service in front of replicas, a
pod's address where the sidecar watches 127.0.0.1) is told it: `--backend vllm.svc:8000=vllm-0`, an entry per
engine behind it. An address that stands for several engines (declared so, or two watched engines' names for one
URL) names none of them: the decision keeps the address, and `behind` says which engines the join looks across
(queries/gateway.py: by time and size among their requests). One declared engine is the address's name.

Public: EngineAddresses.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from stepline.config.settings import split_named_url, url_host_port

_LOOPBACK = frozenset({"localhost", "127.0.0.1", "::1", "0.0.0.0", "::", "ip6-localhost"})


def _key(host: str, port: int) -> str:
    host = host.strip("[]").lower()
    return f"{'127.0.0.1' if host in _LOOPBACK or host.startswith('127.') else host}:{port}"


class EngineAddresses:
    """host:port -> the name of the engine the collector watches there (from the `--engine` specs)."""

    def __init__(self, engines: Sequence[str] = (),
                 backends: Mapping[tuple[str, int], Sequence[str]] | None = None) -> None:
        names: dict[str, set[str]] = {}
        for spec in engines:
            name, url = split_named_url(spec)
            try:
                host, port = url_host_port(url)
            except ValueError:  # settings refuse it first; a bad spec names no address
                continue
            names.setdefault(_key(host, port), set()).add(name or f"{host}:{port}")
        for (host, port), behind in (backends or {}).items():  # declared: it replaces what the URLs say there
            names[_key(host, port)] = set(behind)
        self._names = {key: next(iter(found)) for key, found in names.items() if len(found) == 1}
        self.shared = {key: sorted(found) for key, found in names.items() if len(found) > 1}

    def name_of(self, backend: str) -> str:
        """The engine at `backend` (host:port, as gateway.decisions.backend_engine makes a URL), or `backend` as it
        is where no one engine the collector watches is there."""
        key = _parsed(backend)
        return self._names.get(key, backend) if key else backend

    def behind(self, backend: str) -> list[str]:
        """The engines that stand behind `backend` where it is several (the join looks across them), else []."""
        key = _parsed(backend)
        return self.shared.get(key, []) if key else []


def _parsed(backend: str) -> str:
    """`backend` (host:port) as an address key; '' where it is no host:port (a router's own name for it)."""
    host, sep, port = backend.rpartition(":")
    return _key(host, int(port)) if sep and host and port.isdigit() else ""
