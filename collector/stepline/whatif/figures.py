"""The figures a lever is judged by, computed the same way for the recording and for a replay."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from stepline.core.stats import percentile

# Prompt bands for decode rates: (label, lower bound in tokens); a request falls in the last band it reaches.
BANDS = (("<1k", 0), ("1k-8k", 1_000), ("8k-32k", 8_000), ("32k-128k", 32_000), (">=128k", 128_000))


@dataclass(frozen=True, slots=True)
class Objectives:
    """Per-request objectives that goodput counts: time to first token and mean time per output token, s."""

    ttft_s: float
    tpot_s: float


@dataclass(frozen=True, slots=True)
class Served:
    """One request's outcome: what every figure is computed from."""

    prompt_tokens: int
    generation_tokens: int
    ttft_s: float
    decode_s: float

    @property
    def tpot_s(self) -> float:
        return self.decode_s / (self.generation_tokens - 1) if self.generation_tokens > 1 else 0.0

    @property
    def decode_rate(self) -> float | None:
        """Tokens per second after the first, None for one-token requests."""
        return (self.generation_tokens - 1) / self.decode_s if self.generation_tokens > 1 and self.decode_s > 0 \
            else None


@dataclass(frozen=True, slots=True)
class Figures:
    requests: int
    unfinished: int  # requests a replay left unserved (did not drain)
    ttft_p50_s: float
    ttft_p99_s: float
    itl_p99_s: float
    decode_rates: dict[str, tuple[float, float, float]]  # band -> tok/s p10, p50, p90
    good: int  # requests meeting both objectives
    goodput_rps: float

    def as_json(self) -> dict[str, object]:
        return {"requests": self.requests, "unfinished": self.unfinished, "ttft_p50_s": _num(self.ttft_p50_s),
                "ttft_p99_s": _num(self.ttft_p99_s), "itl_p99_s": _num(self.itl_p99_s),
                "decode_tok_s_p10_p50_p90": {k: [_num(x) for x in v] for k, v in self.decode_rates.items()},
                "good_requests": self.good, "goodput_rps": _num(self.goodput_rps)}


def _num(x: float) -> float | None:
    return None if math.isnan(x) else round(x, 6)


def quantile(values: Sequence[float], q: float) -> float:
    """The q-quantile (0-1), interpolating linearly between ranks as the matrix's percentiles do; NaN when
    empty (a figure with nothing behind it, not zero)."""
    return percentile(values, q * 100.0) if values else math.nan


def band(prompt_tokens: int) -> str:
    label = BANDS[0][0]
    for name, low in BANDS:
        if prompt_tokens >= low:
            label = name
    return label


def figures(served: Iterable[Served], itls: Iterable[float], objectives: Objectives, span_s: float,
            unfinished: int = 0) -> Figures:
    """`span_s`: the time the requests arrived over, goodput's denominator (the same for every replay)."""
    done = list(served)
    ttfts = sorted(s.ttft_s for s in done)
    rates: dict[str, list[float]] = {}
    for s in done:
        rate = s.decode_rate
        if rate is not None:
            rates.setdefault(band(s.prompt_tokens), []).append(rate)
    good = sum(1 for s in done if s.ttft_s <= objectives.ttft_s and s.tpot_s <= objectives.tpot_s)
    ordered_itls = sorted(itls)
    decode = {name: (quantile(v, 0.1), quantile(v, 0.5), quantile(v, 0.9))
              for name, _ in BANDS if (v := sorted(rates.get(name, [])))}
    return Figures(len(done), unfinished, quantile(ttfts, 0.5), quantile(ttfts, 0.99),
                   quantile(ordered_itls, 0.99), decode, good, good / max(span_s, 1.0))
