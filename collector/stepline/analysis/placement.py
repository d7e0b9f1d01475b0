"""Which requests each engine step carried, and what each cost it, inferred from the requests' phases.

No report says which requests a step carried: `steps` counts a step's prefill tokens and decoding requests, and
`requests` gives each finished request's phases in time. A request's prefill steps are those of its engine index
that ended after it was scheduled (arrival + queue) and by its first token (arrival + TTFT); its decode steps those
that ended after its first token and by its finish. Each moment is snapped to the nearest step end within SNAP_US
(the seconds are Float32 and a span ends milliseconds after the plugin's step). In each step the prefill tokens go
to the requests in prefill, those whose prefill ends there first, then oldest scheduled first, each up to its
uncached prompt tokens not yet computed (vLLM continues partial prefills oldest first); each decoding request takes
one decode slot, with prompt + 1 + the decode steps before it in context, and its share of the drafts. Work no known
request can take (a request still running, aborted without a report, recomputed after a preemption) stays unplaced.

What a step's work cost is the step's duration split by an affine cost (CostWeights), fitted per engine over the
steps read: elapsed = overhead + prefill_token * (prefill + draft tokens) + attention_pair * sum over chunks of
chunk * (chunk start + chunk / 2) + decode_request * decoding requests + context_token * their context tokens.
"""

from __future__ import annotations

import math
from bisect import bisect_right
from collections.abc import Sequence
from dataclasses import dataclass, field

from stepline.core.linsolve import solve

# A request's moment is snapped to a step end this close to it (Float32 seconds are exact to a few us over minutes).
SNAP_US = 1_000
# The prior cost weights (ms per unit) of an 8B dense model on one H100-class GPU, used where the engine's own steps
# cannot be fitted (too few, or too alike to tell the terms apart): only their ratios matter to the shares.
PRIOR = (9.0, 27e-3, 6.1e-7, 0.15, 30e-6)
TERMS = ("overhead", "prefill_token", "attention_pair", "decode_request", "context_token")
MIN_FIT_STEPS = 20
# A fit whose work terms explain less than this share of the steps' time on average says the steps cost the same
# whatever they carry: its weights are noise, and the prior's ratios split the steps instead.
MIN_WORK_SHARE = 0.02


@dataclass(frozen=True)
class CostWeights:
    """ms per unit of each term of a step's cost (TERMS); `fitted`: from the engine's own steps, else PRIOR."""

    overhead: float
    prefill_token: float
    attention_pair: float
    decode_request: float
    context_token: float
    fitted: bool
    steps: int = 0  # steps the fit used

    def describe(self) -> str:
        how = f"fitted over {self.steps} steps" if self.fitted else "prior (the steps could not be fitted)"
        return (f"{self.overhead:.3g} ms + {self.prefill_token * 1e3:.3g} us/prefill token + "
                f"{self.attention_pair * 1e6:.3g} ns/attention pair + {self.decode_request:.3g} ms/decoding request "
                f"+ {self.context_token * 1e6:.3g} ns/context token ({how})")


PRIOR_WEIGHTS = CostWeights(*PRIOR, fitted=False)


@dataclass(frozen=True)
class Phases:
    """One request on one engine index: when it was scheduled, got its first token and finished (us), its uncached
    prompt tokens (what its prefill computes) and its prompt."""

    key: int  # the caller's index of the request
    scheduled_us: int
    first_token_us: int
    finished_us: int
    uncached: int
    cached: int
    prompt: int


@dataclass
class Rank:
    """One engine index's steps in time order (parallel lists), and what the walk places on each."""

    end_us: list[int]
    elapsed_us: list[int]
    prefill_tokens: list[int]
    decoding: list[int]
    decode_tokens: list[int]
    # Placed: per step the prefill chunks (request key, tokens, chunk start), the placed decoders and their context.
    chunks: list[list[tuple[int, int, int]]] = field(default_factory=list)
    decoders: list[int] = field(default_factory=list)
    context: list[int] = field(default_factory=list)
    # Per request key: its decode steps [first, last + 1) and the context of its first decode less that step's index.
    decodes: dict[int, tuple[int, int, int]] = field(default_factory=dict)

    def after(self, t_us: int) -> int:
        """The index of the first step that ended after `t_us`, a step end within SNAP_US counting as `t_us`."""
        ends = self.end_us
        i = bisect_right(ends, t_us)
        near = [j for j in (i - 1, i) if 0 <= j < len(ends) and abs(ends[j] - t_us) <= SNAP_US]
        if near:
            return min(near, key=lambda j: abs(ends[j] - t_us)) + 1
        return i

    def drafts(self, i: int) -> float:
        """Draft tokens per decoding request in step `i` (speculative decoding; 0 without)."""
        return (self.decode_tokens[i] - self.decoding[i]) / self.decoding[i] if self.decoding[i] else 0.0


def place(rank: Rank, requests: Sequence[Phases]) -> None:
    """Fill `rank`'s chunks, decoders, context and decodes from the requests' phases."""
    n = len(rank.end_us)
    rank.chunks = [[] for _ in range(n)]
    count = [0] * (n + 1)
    offset = [0] * (n + 1)
    prefilling: list[tuple[int, int, Phases]] = []
    for r in requests:
        p0, p1, d1 = rank.after(r.scheduled_us), rank.after(r.first_token_us), rank.after(r.finished_us)
        if p1 > p0:
            prefilling.append((p0, p1, r))
        if d1 > p1:
            # Context at decode step i: prompt + 1 + (i - p1), kept as a constant per request plus the step index.
            rank.decodes[r.key] = (p1, d1, r.prompt + 1 - p1)
            count[p1] += 1
            count[d1] -= 1
            offset[p1] += r.prompt + 1 - p1
            offset[d1] -= r.prompt + 1 - p1
    _place_prefills(rank, prefilling)
    rank.decoders, rank.context = [], []
    placed = constant = 0
    for i in range(n):
        placed += count[i]
        constant += offset[i]
        rank.decoders.append(placed)
        rank.context.append(constant + placed * i)


def _place_prefills(rank: Rank, prefilling: list[tuple[int, int, Phases]]) -> None:
    """Each step's prefill tokens to the requests then in prefill: those finishing there first, then the oldest."""
    prefilling.sort(key=lambda x: (x[0], x[2].scheduled_us))
    remaining = {r.key: r.uncached for _, _, r in prefilling}
    active: list[tuple[int, int, Phases]] = []
    nxt = 0
    for i in range(len(rank.end_us)):
        while nxt < len(prefilling) and prefilling[nxt][0] <= i:
            active.append(prefilling[nxt])
            nxt += 1
        active = [a for a in active if a[1] > i]
        left = rank.prefill_tokens[i]
        for _, _, r in sorted(active, key=lambda a: (a[1] - 1 != i, a[2].scheduled_us)):
            tokens = min(left, remaining[r.key])
            if tokens > 0:
                rank.chunks[i].append((r.key, tokens, r.cached + r.uncached - remaining[r.key]))
                remaining[r.key] -= tokens
                left -= tokens


def pairs(start: int, tokens: int) -> float:
    """(query, key) pairs of a prefill chunk of `tokens` at context position `start`: its attention work."""
    return tokens * (start + tokens / 2.0)


def features(rank: Rank, i: int, fallback_context: float) -> tuple[float, float, float, float]:
    """Step `i`'s work by term (TERMS less the overhead): tokens computed (prefill + drafts), attention pairs,
    decoding requests and their context tokens; work nobody was placed on is estimated (a chunk from position 0,
    a decoder with `fallback_context`)."""
    placed_tokens = sum(t for _, t, _ in rank.chunks[i])
    chunk_pairs = sum(pairs(s, t) for _, t, s in rank.chunks[i])
    unplaced = rank.prefill_tokens[i] - placed_tokens
    decoding, decoders = rank.decoding[i], rank.decoders[i]
    context = (rank.context[i] * min(1.0, decoding / decoders) if decoders else 0.0)
    context += max(0, decoding - decoders) * fallback_context
    tokens = rank.prefill_tokens[i] + rank.decode_tokens[i] - decoding
    return float(tokens), chunk_pairs + pairs(0, max(0, unplaced)), float(decoding), context


def fit(rows: Sequence[tuple[tuple[float, float, float, float], float]]) -> CostWeights:
    """Least squares of elapsed (ms, relative errors) on the step's work by term, every weight but the overhead kept
    >= 0 (a term that comes out negative is dropped and the rest refitted); PRIOR_WEIGHTS when too few steps or too
    alike."""
    if len(rows) < MIN_FIT_STEPS:
        return PRIOR_WEIGHTS
    matrix = [(1.0, *x) for x, _ in rows]
    target = [y for _, y in rows]
    scale = [max(abs(r[j]) for r in matrix) for j in range(len(TERMS))]
    columns = [j for j in range(len(TERMS)) if scale[j] > 0]
    while len(columns) > 1:
        weights = _least_squares(matrix, target, columns, scale)
        if weights is None:
            return PRIOR_WEIGHTS
        negative = [j for j in columns[1:] if weights[j] < 0]
        if not negative:
            if not _telling(weights, rows):
                return PRIOR_WEIGHTS
            overhead, prefill, pair, decode, context = weights
            return CostWeights(overhead, prefill, pair, decode, context, fitted=True, steps=len(rows))
        columns.remove(min(negative, key=lambda j: weights[j]))
    return PRIOR_WEIGHTS


def _telling(weights: Sequence[float], rows: Sequence[tuple[tuple[float, float, float, float], float]]) -> bool:
    """Whether fitted weights can split steps: the work explains MIN_WORK_SHARE of their time, and each kind of
    work the steps carried (prefill, decode) costs something (else a step of only that kind could not be split)."""
    work = math.fsum(math.fsum(w * x for w, x in zip(weights[1:], xs, strict=True)) for xs, _ in rows)
    if work < MIN_WORK_SHARE * math.fsum(y for _, y in rows):
        return False
    prefilled = any(xs[0] > 0 or xs[1] > 0 for xs, _ in rows)
    decoded = any(xs[2] > 0 for xs, _ in rows)
    return (not prefilled or weights[1] > 0 or weights[2] > 0) and (not decoded or weights[3] > 0 or weights[4] > 0)


def _least_squares(matrix: Sequence[Sequence[float]], target: Sequence[float], columns: Sequence[int],
                   scale: Sequence[float]) -> list[float] | None:
    """The normal equations over `columns` (each scaled to at most 1, so that tokens and pairs are comparable)."""
    # Each row over its own elapsed: relative errors, since a step's noise grows with it (a host's jitter is a
    # share of the step), and a few long prefill steps would otherwise outweigh thousands of decode steps.
    a = [[row[j] / scale[j] / y for j in columns] for row, y in zip(matrix, target, strict=True)]
    k = len(columns)
    normal = [[math.fsum(r[p] * r[q] for r in a) for q in range(k)] for p in range(k)]
    rhs = [math.fsum(r[p] for r in a) for p in range(k)]
    solved = solve(normal, rhs, singular=1e-9 * len(a))
    if solved is None:
        return None
    weights = [0.0] * len(TERMS)
    for p, j in enumerate(columns):
        weights[j] = solved[p] / scale[j]
    return weights
