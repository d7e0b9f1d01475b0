"""The bar a gateway in front routes by, as the store saw it: its unit, and its units per token as measured.

A router that splits traffic by size compares each request with one bar in its own unit (gateway_decisions). Joined
to the engine's count of the same requests (diagnosis.gateway.joined), its decisions say how many of its units a
token is on this traffic. Shape-sharding then prices its thresholds in that unit, and offers the router's own bar
counted in tokens, the lane split a router measuring the wrong unit only approximates.
"""

from __future__ import annotations

from dataclasses import dataclass

from stepline.diagnosis.findings import Window
from stepline.queries.gateway import MIN_JOINED, joined, size_in_unit
from stepline.queries.query import Query
from stepline.store.reads import Reads

# Per gateway: the bar in force at its latest decision, its unit, and the decisions joined to their engine count, each
# as (size in the bar's unit, engine tokens).
_SIZED = joined(f"d.gateway AS gateway, d.ts AS decided, d.threshold AS threshold, d.threshold_unit AS unit, "
                f"{size_in_unit('d')} AS size, r.prompt_tokens AS prompt_tokens",
                "threshold IS NOT NULL AND threshold_unit != ''", ("ts", "prompt_tokens"), "r.prompt_tokens > 0")
_BARS = (f"SELECT gateway, argMax(threshold, decided) AS bar, argMax(unit, decided) AS bar_unit, "
         "groupArray((size, prompt_tokens)) AS pairs\n"
         f"FROM ({_SIZED})\nGROUP BY gateway ORDER BY gateway")


@dataclass(frozen=True, slots=True)
class RouterBar:
    """A gateway's size bar: `threshold` in `unit`, `per_token` of that unit to one engine-counted token (the median
    over `joined` requests; 1 when the unit is tokens)."""

    gateway: str
    threshold: float
    unit: str
    per_token: float
    joined: int

    @property
    def tokens(self) -> int:
        """The bar in engine-counted tokens, at the router's own traffic's units per token."""
        return max(1, round(self.threshold / self.per_token))

    def in_unit(self, tokens: int) -> str:
        """`tokens` in the router's unit, e.g. '~401,200 chars at the router's 3.94 chars/token'."""
        if self.unit == "tokens":
            return f"{tokens:,} tokens as {self.gateway} counts them"
        return f"~{tokens * self.per_token:,.0f} {self.unit} at {self.gateway}'s measured {self.per_token:.2f} " \
               f"{self.unit}/token"


def router_bars(reader: Reads, window: Window) -> list[RouterBar]:
    """Each gateway's bar over `window`, with its units per token from at least MIN_JOINED joined requests."""
    bars = []
    for r in Query(_BARS, engine=window.engine, start=window.start, end=window.end).rows(reader):
        gateway, threshold, unit, pairs = r.gateway, r.bar, r.bar_unit, r.pairs
        ratios = sorted(size / tokens for size, tokens in pairs if size is not None and tokens)
        if len(ratios) < MIN_JOINED or not threshold:
            continue
        per_token = 1.0 if unit == "tokens" else ratios[len(ratios) // 2]
        bars.append(RouterBar(str(gateway), float(threshold), str(unit), per_token, len(ratios)))
    return bars
