"""The engine's step cost, fitted from its recorded steps.

A step's period (the time from the previous step's end to its own, taken only where the previous step left work
in flight, so the engine went straight on) is fitted as the simulator's cost model is written:

    period = overhead + a * prefill tokens + b * attention pairs + c * decoding requests + d * decode context

Prefill tokens and decoding requests are the step's own (SchedulerIterationDetails; draft tokens count as prefill
tokens, as the engine verifies them). The other two are not recorded and are rebuilt from the requests: each
request prefills between its scheduling and its first token, so a step's prefill tokens are handed, oldest first,
to the requests prefilling then, and a chunk's attention pairs follow from where in its prompt it starts; the
decode context is the prompt plus the tokens generated so far of every request decoding then (tokens assumed to
come evenly between first and last). Coefficients are non-negative (a least-squares fit with an active set), and
the fit is checked on held-out steps: every fifth run of 50 consecutive steps is kept out of the fit that is
scored, and the model returned is refitted on all of them.
"""

from __future__ import annotations

import bisect
import random
from collections.abc import Sequence
from dataclasses import dataclass, field

from stepline.core.linsolve import solve
from stepline.core.stats import nearest_rank
from stepline.sim.costmodel import CostModel, attention_pairs
from stepline.whatif.trace import EngineTrace, TracedRequest

EPS_S = 50e-6  # request times and step stamps are microseconds apart at worst: closer than this is the same moment
HOLD_OUT_BLOCK = 50
HOLD_OUT_EVERY = 5
MIN_STEPS = 20
JITTER_BUCKETS = 8  # residuals are drawn from steps of about the same predicted time: an eighth of the steps
JITTER_FLOOR = 0.1  # a step never takes less than this share of what the model predicts
# How sure a fit is, as costs the perturbed replays run with (whatif's intervals): each draw refits the steps
# resampled a run of HOLD_OUT_BLOCK at a time (a block bootstrap: the coefficients' uncertainty, with the steps'
# dependence on their neighbours kept), then scales the whole cost by a factor spread evenly over +-E, E the fit's
# error on its held-out steps (at least MIN_MODEL_ERROR): what a cost of the wrong form costs the replay's clock,
# as far as steps it did not see can tell. Two such errors are measured and the larger taken: the total time the
# held-out steps were missed by (what the recorded mix of steps adds up to), and the form error: the held-out
# steps in FORM_BUCKETS groups of about the same predicted time, the largest total any group was missed by. A cost
# of another form than the fit's misses some kinds of step one way and others the other way (a per-chunk cost:
# steps carrying prefill under, decode-only steps over), which a total can cancel out and a lever that changes the
# mix of steps does not: a lever that runs mostly one kind of step meets that kind's error in full. A step's own
# jitter averages out within its group.
MIN_MODEL_ERROR = 0.05
FORM_BUCKETS = 8


class FitError(ValueError):
    """The recorded steps cannot support a fit (too few, or no iteration details)."""


@dataclass(frozen=True, slots=True)
class Fit:
    """A fitted cost model and how well it predicts steps it did not see."""

    cost: CostModel
    steps: int  # steps the model was fitted on (each with a known period)
    held_out: int
    median_error: float  # of |predicted - recorded| / recorded over held-out steps
    p90_error: float
    total_error: float  # (sum predicted - sum recorded) / sum recorded over held-out steps: the replay's clock
    form_error: float = 0.0  # the largest held-out group's total error (see FORM_BUCKETS)
    # (highest predicted seconds of a bucket of steps, the recorded - predicted seconds of its steps), ascending
    residuals: tuple[tuple[float, tuple[float, ...]], ...] = field(default=(), repr=False)
    samples: tuple[tuple[tuple[float, ...], float], ...] = field(default=(), repr=False)  # (features, period)

    @property
    def model_error(self) -> float:
        """The share by which the perturbed replays scale the cost, either way: the larger of the held-out total
        and form errors, MIN_MODEL_ERROR at least."""
        return max(abs(self.total_error), self.form_error, MIN_MODEL_ERROR)

    def draws(self, n: int, seed: str) -> list[CostModel]:
        """`n` costs as the fit might have come out: block-bootstrapped coefficients, each scaled by a factor
        spread evenly over +-model_error (seeded: the same draws for every lever).

        A fit off by more than 100% would scale the lowest draws below nothing: steps of negative time, the replay's
        clock running backwards, TTFT and ITL below 0 at the interval's low end (a real engine's short recording
        did, in CI). Those draws are free steps instead (factor 0): a fit that poor bounds nothing from below."""
        rng = random.Random(seed)
        blocks = [self.samples[i:i + HOLD_OUT_BLOCK] for i in range(0, len(self.samples), HOLD_OUT_BLOCK)]
        factors = [max(0.0, 1.0 + self.model_error * (-1.0 + 2.0 * (k + 0.5) / n)) for k in range(n)]
        rng.shuffle(factors)
        out = []
        for factor in factors:
            chosen = [x for _ in blocks for x in rng.choice(blocks)] if blocks else list(self.samples)
            coefficients = _nnls([x for x, _ in chosen], [y for _, y in chosen]) if chosen else []
            out.append(scaled(CostModel(*coefficients) if coefficients else self.cost, factor))
        return out

    def describe(self) -> str:
        c = self.cost
        return (f"step = {c.step_overhead_s * 1e3:.2f} ms + {c.prefill_token_s * 1e6:.3g} us/prefill token + "
                f"{c.prefill_attention_pair_s * 1e9:.3g} ns/attention pair + {c.decode_request_s * 1e3:.3g} "
                f"ms/decoding request + {c.decode_context_token_s * 1e9:.3g} ns/context token")


def scaled(cost: CostModel, factor: float) -> CostModel:
    """`cost` with every term multiplied by `factor`: every step that much dearer (or cheaper)."""
    return CostModel(*(c * factor for c in (cost.step_overhead_s, cost.prefill_token_s, cost.prefill_attention_pair_s,
                                            cost.decode_request_s, cost.decode_context_token_s)))


class Jitter:
    """Maps a step's predicted seconds to a drawn step time (seeded: every replay of a window draws alike)."""

    def __init__(self, residuals: tuple[tuple[float, tuple[float, ...]], ...], seed: str) -> None:
        self._bounds = [b for b, _ in residuals]
        self._residuals = [r for _, r in residuals]
        self._rng = random.Random(seed)

    def __call__(self, predicted: float) -> float:
        if not self._bounds:
            return predicted
        k = min(bisect.bisect_left(self._bounds, predicted), len(self._bounds) - 1)
        return max(JITTER_FLOOR * predicted, predicted + self._rng.choice(self._residuals[k]))


def features(trace: EngineTrace) -> list[tuple[float, float, float, float, float]]:
    """Per recorded step: (1, prefill tokens, attention pairs, decoding requests, decode context tokens)."""
    steps = trace.steps
    pairs = _prefill_pairs(trace)
    context = _decode_context(trace)
    return [(1.0, float(steps.ctx_tokens[i] + max(0, steps.gen_tokens[i] - steps.gen_requests[i])), pairs[i],
             float(steps.gen_requests[i]), context[i]) for i in range(len(steps))]


def fit(trace: EngineTrace) -> Fit:
    """Fit `trace`'s engine; FitError when its steps cannot tell the cost."""
    if not trace.has_iteration_details:
        raise FitError(f"engine {trace.engine}: its steps carry no composition (vLLM ran without "
                       "--enable-logging-iteration-details), so its step cost cannot be fitted")
    steps = trace.steps
    rows = features(trace)
    samples = [(rows[i], steps.ts[i] - steps.ts[i - 1]) for i in range(1, len(steps))
               if steps.in_flight_after[i - 1] > 0 and steps.ts[i] > steps.ts[i - 1]]
    if len(samples) < MIN_STEPS:
        raise FitError(f"engine {trace.engine}: {len(samples)} back-to-back steps in the window, too few to fit "
                       f"its step cost (at least {MIN_STEPS})")
    held = [k for k in range(len(samples)) if (k // HOLD_OUT_BLOCK) % HOLD_OUT_EVERY == HOLD_OUT_EVERY - 1]
    held_set = set(held)
    train = [samples[k] for k in range(len(samples)) if k not in held_set] if held else samples
    scored = [samples[k] for k in held] if held else samples
    coefficients = _nnls([x for x, _ in train], [y for _, y in train])
    errors = sorted(abs(_dot(coefficients, x) - y) / y for x, y in scored)
    predicted = sum(_dot(coefficients, x) for x, _ in scored)
    recorded = sum(y for _, y in scored)
    final = _nnls([x for x, _ in samples], [y for _, y in samples])
    return Fit(CostModel(*final), len(samples), len(scored), nearest_rank(errors, 0.5), nearest_rank(errors, 0.9),
               (predicted - recorded) / recorded, form_error(coefficients, scored), _residuals(final, samples),
               tuple(samples))


def form_error(coefficients: list[float], scored: Sequence[tuple[tuple[float, ...], float]]) -> float:
    """The held-out steps in FORM_BUCKETS groups of about the same predicted time: the largest total error of a
    group, either way."""
    # By predicted time alone (ties in recorded order): sorting on the recorded time too would group a step's own
    # jitter, among steps predicted alike, into errors that look systematic.
    pairs = sorted(((_dot(coefficients, x), y) for x, y in scored), key=lambda pair: pair[0])
    worst = 0.0
    for group in _groups(pairs, FORM_BUCKETS):
        recorded = sum(y for _, y in group)
        if recorded > 0:
            worst = max(worst, abs(sum(p for p, _ in group) - recorded) / recorded)
    return worst


def _groups(pairs: list[tuple[float, float]], count: int) -> list[list[tuple[float, float]]]:
    """`pairs` cut, in order, into `count` groups of about the same size (fewer when there are fewer pairs)."""
    size = max(1, -(-len(pairs) // count))
    return [pairs[i:i + size] for i in range(0, len(pairs), size)]


def _residuals(coefficients: list[float], samples: Sequence[tuple[tuple[float, ...], float]]
               ) -> tuple[tuple[float, tuple[float, ...]], ...]:
    pairs = sorted((_dot(coefficients, x), y) for x, y in samples)
    return tuple((chunk[-1][0], tuple(y - p for p, y in chunk)) for chunk in _groups(pairs, JITTER_BUCKETS))


def _dot(a: list[float], b: tuple[float, ...]) -> float:
    return sum(x * y for x, y in zip(a, b, strict=True))


def _prefill_pairs(trace: EngineTrace) -> list[float]:
    steps = trace.steps
    pending = sorted((r for r in trace.requests if r.prompt_tokens > r.cached_tokens),
                     key=lambda r: (r.scheduled, r.arrival))
    active: list[list[float]] = []  # [first token, next chunk start, prompt end], oldest first
    cursor = 0
    out: list[float] = []
    for i, ts in enumerate(steps.ts):
        while cursor < len(pending) and pending[cursor].scheduled < ts - EPS_S:
            r = pending[cursor]
            active.append([r.first_token, float(r.cached_tokens), float(r.prompt_tokens)])
            cursor += 1
        active = [a for a in active if a[0] >= ts - EPS_S and a[1] < a[2]]
        left = float(steps.ctx_tokens[i])
        pairs = 0.0
        for a in active:
            if left <= 0:
                break
            chunk = min(left, a[2] - a[1])
            pairs += attention_pairs(int(a[1]), int(chunk))
            a[1] += chunk
            left -= chunk
        if left > 0:  # tokens no recorded request accounts for: a prompt of its own, from its start
            pairs += attention_pairs(0, int(left))
        out.append(pairs)
    return out


def _decode_context(trace: EngineTrace) -> list[float]:
    # A decoding request's context grows linearly from prompt + 1 at its first token to prompt + generated at its
    # end: the sum over those decoding at t is s0 + s1 * t, kept by adding and removing requests in time order.
    decoding = [r for r in trace.requests if r.generation_tokens > 1]
    starts = sorted(decoding, key=lambda r: r.first_token)
    ends = sorted(decoding, key=lambda r: r.finished)
    s0 = s1 = 0.0
    i = j = 0
    out: list[float] = []

    def terms(r: TracedRequest) -> tuple[float, float]:
        span = r.finished - r.first_token
        rate = (r.generation_tokens - 1) / span if span > 0 else 0.0
        return r.prompt_tokens + 1 - rate * r.first_token, rate

    for ts in trace.steps.ts:
        while i < len(starts) and starts[i].first_token < ts - EPS_S:
            a, b = terms(starts[i])
            s0, s1 = s0 + a, s1 + b
            i += 1
        while j < len(ends) and ends[j].finished < ts - EPS_S:
            a, b = terms(ends[j])
            s0, s1 = s0 - a, s1 - b
            j += 1
        out.append(max(0.0, s0 + s1 * ts))
    return out


def _nnls(xs: list[tuple[float, ...]], ys: list[float]) -> list[float]:
    """Least squares with every coefficient >= 0: solve on the free terms, drop the most negative, repeat."""
    width = len(xs[0])
    scale = [max((abs(x[k]) for x in xs), default=0.0) or 1.0 for k in range(width)]
    free = [k for k in range(width) if any(x[k] for x in xs)]
    while free:
        solution = _solve(xs, ys, free, scale)
        worst = min(free, key=lambda k: solution[k])
        if solution[worst] >= 0:
            return solution
        free.remove(worst)
    return [0.0] * width


def _solve(xs: list[tuple[float, ...]], ys: list[float], free: list[int], scale: list[float]) -> list[float]:
    n = len(free)
    a = [[0.0] * n for _ in range(n)]
    b = [0.0] * n
    for x, y in zip(xs, ys, strict=True):
        v = [x[k] / scale[k] for k in free]
        for p in range(n):
            b[p] += v[p] * y
            row = a[p]
            for q in range(n):
                row[q] += v[p] * v[q]
    for p in range(n):
        a[p][p] += 1e-12 * (a[p][p] or 1.0)  # a ridge too small to matter, so a duplicate column still solves
    coefficients = solve(a, b, singular=0.0)
    if coefficients is None:  # the ridge keeps the system positive definite: only degenerate data gets here
        raise FitError("the recorded steps cannot tell the step cost's terms apart")
    out = [0.0] * len(scale)
    for p, k in enumerate(free):
        out[k] = coefficients[p] / scale[k]
    return out

