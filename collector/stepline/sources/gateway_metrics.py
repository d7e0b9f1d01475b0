"""Source: a gateway's /metrics (LiteLLM's proxy, vllm-router), every `litellm_` and `vllm_router_` sample into
`gateway_samples`, each series tied to the backend it is about.

Series names and labels (versions pinned in tests/gateway/install.sh, both scraped for real in the tests):
- vllm-router 0.1.17, a Rust binary in its wheel: `vllm_router_worker_load{worker}`,
  `vllm_router_running_requests{worker}`, `vllm_router_processed_requests_total{worker}`,
  `vllm_router_policy_decisions_total{policy,worker}`, `vllm_router_worker_health{worker}`,
  `vllm_router_cb_state{worker}`, `worker` the worker's URL (shared/DESIGN.md, "Gateways in front of vLLM"; the
  processed and health series checked in tests/sources/test_gateway_metrics.py).
- LiteLLM 1.108.7 (`litellm/integrations/prometheus.py`, the proxy's `callbacks: ["prometheus"]`):
  `litellm_deployment_*` series carry `api_base` (the deployment's URL) and `model_group`;
  `litellm_in_flight_requests` is the whole worker's (no deployment label). `/metrics` answers 401 without the
  proxy's key (`--gateway` scrapes send STEPLINE_GATEWAY_TOKEN as a Bearer).
"""

from __future__ import annotations

from stepline.config.settings import split_named_url
from stepline.gateway.decisions import backend_engine
from stepline.model.rows import GatewaySample
from stepline.sources.base import SourceContext
from stepline.sources.vllm_metrics import Fetch, ParsedSample, Scraper, http_fetch

PREFIXES = ("litellm_", "vllm_router_")
# The labels that name a backend, in the order they are looked for.
BACKEND_LABELS = ("worker", "api_base", "backend", "url")


class GatewayMetricsSource(Scraper):
    """Scrapes one gateway; counters become reset-safe deltas, up/down/restart become gateway_* events."""

    subject = "gateway"
    source = "gateway_metrics"
    prefixes = PREFIXES
    serving = "a LiteLLM proxy's or vllm-router"

    def __init__(self, url: str, ctx: SourceContext, *, gateway: str | None = None, timeout_s: float = 3.0,
                 token: str | None = None, fetch: Fetch | None = None) -> None:
        # LiteLLM's proxy answers /metrics with 401 without its key (1.108.7): the token is sent as a Bearer.
        super().__init__(url, ctx, name=gateway, timeout_s=timeout_s,
                         fetch=fetch or (lambda u, t: http_fetch(u, t, token)))

    def _context(self, samples: list[ParsedSample]) -> str:
        return ""

    def _row(self, stamp: int, s: ParsedSample, delta: float, context: str) -> GatewaySample:
        backend = next((s.labels[label] for label in BACKEND_LABELS if s.labels.get(label)), "")
        return GatewaySample(stamp, self._ctx.host, self._ctx.engine_addresses.name_of(backend_engine(backend)),
                             self.target, s.metric, s.kind,
                             dict(s.labels), s.value, delta)

    def _event_subject(self) -> tuple[str, dict[str, str]]:
        return "", {"gateway": self.target}  # a gateway's events are no engine's


def build(ctx: SourceContext, gateways: tuple[str, ...], timeout_s: float, token: str | None = None
          ) -> list[GatewayMetricsSource]:
    """One source per `--gateway`, each `URL` or `NAME=URL`, each sent `token` (STEPLINE_GATEWAY_TOKEN)."""
    return [GatewayMetricsSource(url, ctx, gateway=name or None, timeout_s=timeout_s, token=token)
            for name, url in map(split_named_url, gateways)]
