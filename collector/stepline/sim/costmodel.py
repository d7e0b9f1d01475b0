"""How long one engine step takes, from what it carries.

One step costs

    step_s = STEP_OVERHEAD_S
           + PREFILL_TOKEN_S            * prefill tokens
           + PREFILL_ATTENTION_PAIR_S   * sum over chunks of chunk * (chunk start + chunk / 2)
           + DECODE_REQUEST_S           * decoding requests
           + DECODE_CONTEXT_TOKEN_S     * sum of the decoding requests' context lengths

The constants describe an 8B dense model (Qwen3-8B-like) on one H100/H200-class GPU:

- STEP_OVERHEAD_S = 9 ms: weights read once per step, kernel launches, sampling, output handling.
- PREFILL_TOKEN_S = 27 us: ~16 GFLOP per token of dense matmuls at ~600 TFLOP/s effective;
  an 8192-token chunk alone costs ~0.22 s.
- PREFILL_ATTENTION_PAIR_S = 0.61 ns per (chunk token x context token) pair (~0.6 MFLOP of
  attention per pair for 36 layers x 4096 query dims, near 1 PFLOP/s): each chunk token
  attends to everything before it, so a chunk's attention grows with its position. The late
  chunks of a 359k-token prompt take ~1.8 s of attention each, the first one ~20 ms.
- DECODE_REQUEST_S = 0.15 ms: per-sequence activations, sampling and bookkeeping.
- DECODE_CONTEXT_TOKEN_S = 30 ns: reading one token's KV (~144 KiB for Qwen3-8B) at
  memory bandwidth; memory-bound, so far dearer per token than the prefill pairs.

Consequences (asserted by tests/sim/test_costmodel.py): one request decoding alone at 512k
context steps in ~25 ms (~40 tok/s); a decode-only step of 32 requests at 4k context takes
~18 ms; a step carrying an 8192-token chunk takes ~0.25 s at the start of a prompt and ~2 s at
the end of a 359k-token one, so every request decoding beside it drops to 0.5-4 tok/s.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field

STEP_OVERHEAD_S = 9e-3
PREFILL_TOKEN_S = 27e-6
PREFILL_ATTENTION_PAIR_S = 6.1e-10
DECODE_REQUEST_S = 0.15e-3
DECODE_CONTEXT_TOKEN_S = 30e-9


def attention_pairs(start: int, tokens: int) -> float:
    """(query, key) pairs of a prefill chunk of `tokens` starting at context position `start`."""
    return tokens * (start + tokens / 2.0)


@dataclass(frozen=True, slots=True)
class CostModel:
    """Linear step-time model; see the module docstring for what each constant stands for."""

    step_overhead_s: float = STEP_OVERHEAD_S
    prefill_token_s: float = PREFILL_TOKEN_S
    prefill_attention_pair_s: float = PREFILL_ATTENTION_PAIR_S
    decode_request_s: float = DECODE_REQUEST_S
    decode_context_token_s: float = DECODE_CONTEXT_TOKEN_S

    def step_seconds(
        self,
        prefill_tokens: int,
        prefill_pairs: float,
        decode_requests: int,
        decode_context_tokens: int,
    ) -> float:
        """Seconds one step takes; `prefill_pairs` is the sum of `attention_pairs` of its chunks."""
        return (
            self.step_overhead_s
            + self.prefill_token_s * prefill_tokens
            + self.prefill_attention_pair_s * prefill_pairs
            + self.decode_request_s * decode_requests
            + self.decode_context_token_s * decode_context_tokens
        )

    def scaled(self, factor: float) -> CostModel:
        """The same model with every step `factor` times as long: a smaller model or faster GPU below 1,
        a larger model, slower GPU or longer context above."""
        if not factor > 0:
            raise ValueError(f"a speed factor must be positive, got {factor}")
        return CostModel(self.step_overhead_s * factor, self.prefill_token_s * factor,
                         self.prefill_attention_pair_s * factor, self.decode_request_s * factor,
                         self.decode_context_token_s * factor)

    def chunk_step_seconds(
        self, chunk_start: int, chunk_tokens: int, decode_requests: int = 0, decode_context_tokens: int = 0
    ) -> float:
        """Seconds of a step carrying one prefill chunk beside some decoding requests."""
        return self.step_seconds(
            chunk_tokens, attention_pairs(chunk_start, chunk_tokens), decode_requests, decode_context_tokens
        )


class Throttle:
    """A mutable slowdown factor (1.0: full speed) that a scenario runner sets as simulated time passes."""

    __slots__ = ("factor",)

    def __init__(self, factor: float = 1.0) -> None:
        self.factor = factor


@dataclass(frozen=True, slots=True)
class ThrottledCostModel(CostModel):
    """A CostModel whose steps take `throttle.factor` times as long: clocks held down by a power cap."""

    throttle: Throttle = field(default_factory=Throttle)
    inner: CostModel | None = None  # a cost of another form (ShapedCostModel) whose steps are slowed

    @classmethod
    def wrap(cls, cost: CostModel, throttle: Throttle) -> ThrottledCostModel:
        """`cost`, slowed by `throttle` (its constants, and its own step_seconds where it is of another form)."""
        return cls(cost.step_overhead_s, cost.prefill_token_s, cost.prefill_attention_pair_s,
                   cost.decode_request_s, cost.decode_context_token_s, throttle,
                   None if type(cost) is CostModel else cost)

    def step_seconds(
        self,
        prefill_tokens: int,
        prefill_pairs: float,
        decode_requests: int,
        decode_context_tokens: int,
    ) -> float:
        """As the wrapped cost's step_seconds, times the throttle's current factor."""
        # Zero-argument super() fails in slotted dataclasses: name the base explicitly.
        base = (self.inner.step_seconds(prefill_tokens, prefill_pairs, decode_requests, decode_context_tokens)
                if self.inner is not None else
                CostModel.step_seconds(self, prefill_tokens, prefill_pairs, decode_requests, decode_context_tokens))
        return base * self.throttle.factor


@dataclass(frozen=True, slots=True)
class ShapedCostModel(CostModel):
    """A step cost that is not of CostModel's linear form, as real engines' are not: what `whatif`'s fit (which
    assumes the linear form) is validated against (benchmarks/whatif_validation.py --family shaped).

    - `prefill_tile`: prefill tokens are computed in tiles of this many (wave/tile quantisation; 0: none);
    - `chunk_overhead_s`: a fixed cost for every step that carries prefill (per-chunk kernels and metadata);
    - `decode_batch_exponent`: decoding requests cost `decode_request_s * n ** exponent` (batching that gets
      cheaper, below 1, or dearer, above, per request as the batch grows);
    - `context_knee_tokens`: the decode context's cost grows by a factor (1 + context / knee) (KV reads falling
      out of cache as the batch's context grows; 0: linear);
    - `jitter`: each step's time is multiplied by exp(N(0, jitter)) drawn from `seed` (a busy host's noise).
    """

    prefill_tile: int = 0
    chunk_overhead_s: float = 0.0
    decode_batch_exponent: float = 1.0
    context_knee_tokens: int = 0
    jitter: float = 0.0
    seed: int = 0
    # Each copy (dataclasses.replace: a lever's settings) draws its own sequence from `seed`.
    _rng: random.Random = field(default_factory=random.Random, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        self._rng.seed(self.seed)

    def step_seconds(
        self,
        prefill_tokens: int,
        prefill_pairs: float,
        decode_requests: int,
        decode_context_tokens: int,
    ) -> float:
        tiled = (-(-prefill_tokens // self.prefill_tile) * self.prefill_tile if self.prefill_tile else
                 prefill_tokens)
        # The linear model's overhead, prefill and context terms (its decoding requests' term is replaced below).
        seconds = CostModel.step_seconds(self, tiled, prefill_pairs, 0, decode_context_tokens)
        if self.context_knee_tokens:
            seconds += self.decode_context_token_s * decode_context_tokens ** 2 / self.context_knee_tokens
        seconds += ((self.chunk_overhead_s if prefill_tokens else 0.0)
                    + self.decode_request_s * math.pow(decode_requests, self.decode_batch_exponent))
        return seconds * math.exp(self._rng.gauss(0.0, self.jitter)) if self.jitter else seconds
