"""The service-level objectives one deployment holds its engines to: dashboards draw them, alerts page on
them, `stepline whatif` scores goodput against them."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Slo:
    """Service-level objectives; dashboards draw these as thresholds, alerts page on them."""

    itl_p99_seconds: float = 0.1
    """Inter-token latency p99 a decoding stream should see (DecodeStarvation warning)."""
    itl_p99_critical_seconds: float = 1.0
    """ITL p99 at which decode is effectively stopped (~1 token/s): DecodeStarvation critical."""
    ttft_p99_seconds: float = 10.0
    """Time to first token p99; for dashboards (no alert reads it yet), and the TTFT objective of `stepline whatif`'s
    goodput."""
    tpot_seconds: float = 0.1
    """Mean time per output token a request should see: the TPOT objective of `stepline whatif`'s goodput (a
    request meets it when its decode averages this or better)."""
