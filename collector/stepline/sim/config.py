"""The simulated engine's settings, named after vLLM's own flags."""

from __future__ import annotations

from dataclasses import dataclass, field

from stepline.sim.costmodel import CostModel

DEFAULT_MODEL = "Qwen/Qwen3-8B"
POLICIES = ("fcfs", "priority")


@dataclass(frozen=True, slots=True)
class SpecDecode:
    """Speculative decoding: each decoding request drafts `num_tokens` per step; the target model accepts the
    drafts position by position, each with probability `acceptance` (`acceptance_after` from simulated second
    `shift_at_s` on), up to the first rejection, and samples one token more: 1..num_tokens+1 tokens per step."""

    num_tokens: int
    acceptance: float
    shift_at_s: float | None = None
    acceptance_after: float | None = None
    method: str = "ngram"
    seed: int = 0

    def __post_init__(self) -> None:
        if self.num_tokens < 1:
            raise ValueError(f"num_tokens must be at least 1, got {self.num_tokens}")
        for name, rate in (("acceptance", self.acceptance), ("acceptance_after", self.acceptance_after)):
            if rate is not None and not 0.0 <= rate <= 1.0:
                raise ValueError(f"{name} must be in [0, 1], got {rate}")
        if (self.shift_at_s is None) != (self.acceptance_after is None):
            raise ValueError("shift_at_s and acceptance_after go together")

    def acceptance_at(self, now: float) -> float:
        """Per-position acceptance probability at simulated second `now`."""
        if self.shift_at_s is not None and self.acceptance_after is not None and now >= self.shift_at_s:
            return self.acceptance_after
        return self.acceptance


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """vLLM scheduler and cache settings the simulator honours."""

    model: str = DEFAULT_MODEL
    engine: str = "0"
    max_num_batched_tokens: int = 8192
    max_num_seqs: int = 256
    # 0 means "no cap", as in vLLM.
    long_prefill_token_threshold: int = 0
    # The fixture's engine (Qwen3-8B, 0.85 of an 80 GB GPU) had 48213 blocks of 16 tokens.
    num_gpu_blocks: int = 48213
    block_size: int = 16
    gpu_memory_utilization: float = 0.85
    enable_prefix_caching: bool = True
    cost: CostModel = field(default_factory=CostModel)
    # None: no speculative decoding (one token per decoding request per step), vLLM's default.
    speculative: SpecDecode | None = None
    # Waiting requests are admitted only on every Nth step (Scheduler.step_index % N == 0); 1: every step.
    prefill_schedule_interval: int = 1
    # "fcfs": the queue in arrival order; "priority": by (Request.priority, arrival), lower first, as vLLM's.
    policy: str = "fcfs"
    # Research lever, not a vLLM flag: with decodes in the step, prefill chunks are cut so the step ends within
    # max(deadline_tpot_s, the decodes' least slack on a deadline_tpot_s-per-token schedule). None: off.
    deadline_tpot_s: float | None = None
    # vLLM 0.33's default on GPUs (vllm/config/vllm.py:1685-1719): the engine core schedules step N+1 while step N
    # runs and then waits for step N (vllm/v1/engine/core.py:708-796). Steps still run back to back and take what
    # the cost model says; what changes is what vLLM reports (elapsed_ms: the wait, the step less the host's
    # `host_overhead_s` of scheduling the next one and processing the last one's outputs, 0 when the GPU finished
    # first) and when arrivals are scheduled (a request that arrives during step N waits for step N+2, as step N+1
    # was scheduled when step N began). False: vLLM's CPU build and --no-async-scheduling.
    async_scheduling: bool = False
    host_overhead_s: float = 0.004
    # Fault knobs for diagnosis scenarios; off, the simulator behaves as vLLM does.
    # An aborted request keeps its running slot and KV forever (a slot released only on success).
    leak_aborted_slots: bool = False
    # long_prefill_token_threshold is reported at start-up but never applied (a flag that did nothing).
    ignore_long_prefill_token_threshold: bool = False

    def __post_init__(self) -> None:
        positive = {
            "max_num_batched_tokens": self.max_num_batched_tokens,
            "max_num_seqs": self.max_num_seqs,
            "num_gpu_blocks": self.num_gpu_blocks,
            "block_size": self.block_size,
            "prefill_schedule_interval": self.prefill_schedule_interval,
        }
        for name, value in positive.items():
            if value < 1:
                raise ValueError(f"{name} must be at least 1, got {value}")
        if self.long_prefill_token_threshold < 0:
            raise ValueError(
                f"long_prefill_token_threshold must be 0 (off) or positive, got {self.long_prefill_token_threshold}"
            )
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if not self.model:
            raise ValueError("model must not be empty")
        if self.policy not in POLICIES:
            raise ValueError(f"policy must be one of {', '.join(POLICIES)}, got {self.policy!r}")
        if not self.host_overhead_s >= 0:
            raise ValueError(f"host_overhead_s must be 0 or more, got {self.host_overhead_s}")
        if self.deadline_tpot_s is not None and not self.deadline_tpot_s > 0:
            raise ValueError(f"deadline_tpot_s must be positive when set, got {self.deadline_tpot_s}")

    @property
    def kv_capacity_tokens(self) -> int:
        """Tokens the KV cache holds when full."""
        return self.num_gpu_blocks * self.block_size
