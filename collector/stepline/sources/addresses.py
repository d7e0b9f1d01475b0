"""The engines the collector watches, by the address it reaches each at: what a gateway calls a backend (the URL it
sends to, LiteLLM's deployment `api_base`, vllm-router's worker URL) is named as the collector names the engine at
that address (`--engine fast=http://10.0.0.5:8000` names it `fast`), so decisions join the engine's requests
whatever the engine is called.

Loopback names are one address (`localhost`, `127.0.0.1`, `::1`, `0.0.0.0`: a gateway beside the engine may call it
any of them). An address several watched engines share (a Kubernetes service in front of replicas, watched pod by
pod at the same address is impossible, but two names for one URL are not) names none of them: the decision keeps
the address, and `shared` says which engines stand behind it.

Public: EngineAddresses.
"""

from __future__ import annotations

from collections.abc import Sequence

from stepline.config.settings import split_named_url, url_host_port

_LOOPBACK = frozenset({"localhost", "127.0.0.1", "::1", "0.0.0.0", "::", "ip6-localhost"})


def _key(host: str, port: int) -> str:
    host = host.strip("[]").lower()
    return f"{'127.0.0.1' if host in _LOOPBACK or host.startswith('127.') else host}:{port}"


class EngineAddresses:
    """host:port -> the name of the engine the collector watches there (from the `--engine` specs)."""

    def __init__(self, engines: Sequence[str] = ()) -> None:
        names: dict[str, set[str]] = {}
        for spec in engines:
            name, url = split_named_url(spec)
            try:
                host, port = url_host_port(url)
            except ValueError:  # settings refuse it first; a bad spec names no address
                continue
            names.setdefault(_key(host, port), set()).add(name or f"{host}:{port}")
        self._names = {key: next(iter(found)) for key, found in names.items() if len(found) == 1}
        self.shared = {key: sorted(found) for key, found in names.items() if len(found) > 1}

    def name_of(self, backend: str) -> str:
        """The engine at `backend` (host:port, as gateway.decisions.backend_engine makes a URL), or `backend` as it
        is where no one engine the collector watches is there."""
        host, sep, port = backend.rpartition(":")
        if not self._names or not sep or not port.isdigit():
            return backend
        return self._names.get(_key(host, int(port)), backend)
