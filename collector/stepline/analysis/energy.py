"""A GPU's energy as a function of time, from its samples: what it used over a step, a window or an idle gap.

NVML's energy counter (gpu_samples.energy_mj, mJ since the driver loaded) is read where the GPU has it: the energy
between two moments is the counter's rise, linear between samples. A drop is a driver reload: that interval counts
nothing. Where fewer than two reads of the counter succeeded (a GPU without it, or failed reads), the GPU's power
(gpu_samples.power_w, the driver's 1 s average) is integrated over time instead, by trapezoids; an interval whose
power is unknown at both ends counts nothing. Outside its first and last sample a curve is flat: energy before the
first sample read or after the last is not measured.
"""

from __future__ import annotations

import math
from bisect import bisect_right
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import pairwise

# A GPU needs this many successful counter reads before its counter is used.
MIN_COUNTER_READS = 2


@dataclass(frozen=True)
class EnergyCurve:
    """One GPU's cumulative energy (mJ, from its first sample) at its sample times, and how it was measured."""

    times_us: tuple[int, ...]
    cumulative_mj: tuple[float, ...]
    method: str  # "counter" or "power"

    def at(self, t_us: int) -> float:
        """Energy used from the first sample to `t_us`, mJ: linear between samples, flat outside them."""
        times, cumulative = self.times_us, self.cumulative_mj
        i = bisect_right(times, t_us)
        if i == 0:
            return cumulative[0]
        if i == len(times):
            return cumulative[-1]
        t0, t1 = times[i - 1], times[i]
        return cumulative[i - 1] + (cumulative[i] - cumulative[i - 1]) * (t_us - t0) / (t1 - t0)


def curve(samples: Sequence[tuple[int, int | None, float]]) -> EnergyCurve | None:
    """The curve of one GPU's samples (when in us, counter in mJ or None, power in W or NaN), in time order: from
    the counter where it was read at least MIN_COUNTER_READS times, else from power; None when neither is known."""
    read = [(t, e) for t, e, _ in samples if e is not None]
    if len(read) >= MIN_COUNTER_READS:
        return _from_counter(read)
    powered = [(t, p) for t, _, p in samples]
    if sum(1 for _, p in powered if math.isfinite(p)) < 1 or len(powered) < 2:
        return None
    return _from_power(powered)


def _from_counter(read: Sequence[tuple[int, int]]) -> EnergyCurve:
    cumulative = [0.0]
    for (_, e0), (_, e1) in pairwise(read):
        cumulative.append(cumulative[-1] + max(0, e1 - e0))  # a drop: the driver reloaded and the counter restarted
    return EnergyCurve(tuple(t for t, _ in read), tuple(cumulative), "counter")


def _from_power(samples: Sequence[tuple[int, float]]) -> EnergyCurve:
    cumulative = [0.0]
    for (t0, p0), (t1, p1) in pairwise(samples):
        known = [p for p in (p0, p1) if math.isfinite(p)]
        watts = sum(known) / len(known) if known else 0.0
        cumulative.append(cumulative[-1] + watts * (t1 - t0) / 1e3)  # W x us = 1e-3 mJ
    return EnergyCurve(tuple(t for t, _ in samples), tuple(cumulative), "power")


def used(curves: Sequence[EnergyCurve], start_us: int, end_us: int) -> float:
    """Energy the GPUs of `curves` used together from `start_us` to `end_us`, mJ."""
    return sum(c.at(end_us) - c.at(start_us) for c in curves)


def method(curves: Sequence[EnergyCurve]) -> str:
    """How a group of GPUs' energy was measured: counter, power, counter+power (some of each), or none."""
    return "+".join(sorted({c.method for c in curves})) or "none"
