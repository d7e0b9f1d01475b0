"""The candidate levers, derived from each engine's own settings, and whether its build accepts them."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from stepline.diagnosis.common import config_int
from stepline.sim.config import EngineConfig
from stepline.whatif.router import RouterBar
from stepline.whatif.trace import EngineTrace

# The settings vLLM 0.33's SchedulerConfig holds, by the name the plugin reports them under (plugin/config.py).
REPORTED_AS = {"prefill_schedule_interval": "prefill_schedule_interval", "policy": "scheduling_policy",
               "long_prefill_token_threshold": "long_prefill_token_threshold",
               "max_num_batched_tokens": "max_num_batched_tokens", "max_num_seqs": "max_num_seqs"}


@dataclass(frozen=True, slots=True)
class Lever:
    """One setting, or routing, to try: picklable data, applied by whatif.engine."""

    name: str  # as printed, e.g. "long_prefill_token_threshold=512"
    family: str
    settings: dict[str, object] = field(default_factory=dict)  # EngineConfig fields to override on every engine
    shard_tokens: int | None = None  # prompts of at least this many tokens go to the long lane
    priority_by_band: bool = False  # priority policy, shorter prompts first
    note: str = ""  # what it is in vLLM terms, or why it is not a flag
    unavailable: str = ""  # why the engine's build does not accept it ('' when it does)


def baseline_config(trace: EngineTrace) -> tuple[EngineConfig, list[str]]:
    """The engine's recorded settings as the simulator's; and what had to be assumed."""
    c = trace.config
    assumed: list[str] = []
    defaults = EngineConfig()

    def setting(key: str, default: int, minimum: int = 1) -> int:
        value = config_int(c, key)
        if value is None or value < minimum:
            assumed.append(f"{key}={default}")
            return default
        return value

    budget = setting("max_num_batched_tokens", max([*trace.steps.ctx_tokens, defaults.max_num_batched_tokens]))
    config = EngineConfig(
        model=c.get("served_model_name") or c.get("model") or defaults.model,
        engine=str(config_int(c, "engine_index") or 0),
        max_num_batched_tokens=budget,
        max_num_seqs=setting("max_num_seqs", defaults.max_num_seqs),
        long_prefill_token_threshold=setting("long_prefill_token_threshold", 0, 0),
        num_gpu_blocks=setting("num_gpu_blocks", defaults.num_gpu_blocks),
        block_size=setting("block_size", defaults.block_size),
        enable_prefix_caching=c.get("enable_prefix_caching", "True") != "False",
        prefill_schedule_interval=setting("prefill_schedule_interval", 1) if "prefill_schedule_interval" in c else 1,
        policy=c.get("scheduling_policy", "fcfs").rsplit(".", 1)[-1].lower() or "fcfs",
    )
    return config, assumed


def candidates(traces: list[EngineTrace], configs: list[EngineConfig], tpot_s: float,
               chars_per_token: float | None = None, bars: Sequence[RouterBar] = ()) -> list[Lever]:
    """Every lever worth pricing on this fleet; one the build does not accept is kept, marked unavailable."""
    first = configs[0]
    budget, seqs, block = first.max_num_batched_tokens, first.max_num_seqs, first.block_size
    capacity = min(c.kv_capacity_tokens for c in configs)
    levers: list[Lever] = []

    def missing(setting: str) -> str:
        absent = [t.engine for t in traces if REPORTED_AS[setting] not in t.config]
        return (f"the engine's configuration does not report {setting} (its vLLM build has no such setting, or "
                f"its plugin predates it): {', '.join(absent)}") if absent else ""

    # vLLM applies the threshold to chunked prefills only: with chunked prefill off it is gated.
    unchunked = [t.engine for t in traces if t.config.get("enable_chunked_prefill") == "False"]
    gated = (f"gated: chunked prefill is off on {', '.join(unchunked)} (--enable-chunked-prefill), and vLLM "
             "applies the threshold to chunked prefills only") if unchunked else ""
    for divisor in (16, 8, 4, 2):
        value = max(block, budget // divisor // block * block)
        if value != first.long_prefill_token_threshold:
            levers.append(Lever(f"long_prefill_token_threshold={value}", "long_prefill_token_threshold",
                                {"long_prefill_token_threshold": value},
                                note="caps each prompt's chunk per step", unavailable=missing(
                                    "long_prefill_token_threshold") or gated))
    # The concurrent partial prefill knobs left vLLM's SchedulerConfig (DESIGN: removed by 0.33); the builds that
    # had them refused them at boot on the v1 engine ("Concurrent Partial Prefill is not supported").
    levers.append(Lever("max_num_partial_prefills=2", "max_num_partial_prefills", {},
                        note="several prompts prefilling at once",
                        unavailable="removed from vLLM's scheduler settings (not in 0.33); the v1 engines that "
                                    "still had the flag refused it at boot: 'Concurrent Partial Prefill is not "
                                    "supported'"))
    for factor in (0.25, 0.5, 2.0, 4.0):
        value = max(block, int(budget * factor) // block * block)
        if value == budget:
            continue
        reason = missing("max_num_batched_tokens")
        if value > capacity:
            reason = f"{value} tokens per step exceed the KV cache the engine reported ({capacity} tokens)"
        levers.append(Lever(f"max_num_batched_tokens={value}", "max_num_batched_tokens",
                            {"max_num_batched_tokens": value}, note="the step's token budget (chunk size)",
                            unavailable=reason))
    for factor in (0.25, 0.5, 2.0):
        value = max(1, int(seqs * factor))
        if value != seqs:
            levers.append(Lever(f"max_num_seqs={value}", "max_num_seqs", {"max_num_seqs": value},
                                note="requests running at once", unavailable=missing("max_num_seqs")))
    # vLLM reads prefill_schedule_interval only in its data-parallel engine core (DPEngineCoreProc, which serves
    # MoE models: vllm/v1/engine/core.py, `_should_throttle_prefills`, read from the CPU build 0.32.0 installed
    # by tests/realvllm/install.sh): on any other engine the flag is accepted and does nothing.
    single = [t.engine for t in traces if (config_int(t.config, "data_parallel_size") or 1) <= 1]
    no_dp = (f"gated: vLLM applies prefill_schedule_interval only in data-parallel engine cores (MoE models, "
             f"data_parallel_size > 1); on {', '.join(single)} it is accepted and does nothing") if single else ""
    for interval in (2, 4):
        levers.append(Lever(f"prefill_schedule_interval={interval}", "prefill_schedule_interval",
                            {"prefill_schedule_interval": interval}, note="admit new prefills every N steps",
                            unavailable=missing("prefill_schedule_interval") or no_dp))
    levers.append(Lever("policy=priority (shorter prompts first)", "policy", {"policy": "priority"},
                        priority_by_band=True, note="--scheduling-policy priority, the router setting each "
                        "request's priority from its prompt band", unavailable=missing("policy")))
    levers.extend(shard_levers(traces, chars_per_token, bars))
    levers.append(Lever(f"deadline-aware chunks (TPOT {tpot_s * 1e3:g} ms)", "deadline_chunk",
                        {"deadline_tpot_s": tpot_s},
                        note="each step's chunk sized to the decoding requests' slack: a scheduler change, not "
                             "a vLLM 0.33 flag"))
    return levers


def shard_levers(traces: list[EngineTrace], chars: float | None, bars: Sequence[RouterBar] = ()) -> list[Lever]:
    prompts = sorted(r.prompt_tokens for t in traces for r in t.requests)
    out: list[Lever] = []
    seen: set[int] = set()
    reason = "" if len(traces) >= 2 else (
        "one engine in the window: shape-sharding routes prompts between at least two")
    # The router's own bar, counted in tokens: what its lanes are meant to be, without the unit's error.
    for bar in bars:
        seen.add(bar.tokens)
        at = f"{bar.threshold:,.0f} {bar.unit}" + (f", ~{bar.tokens:,} tokens at its measured {bar.per_token:.2f} "
                                                    f"{bar.unit}/token over {bar.joined} requests"
                                                    if bar.unit != "tokens" else "")
        out.append(Lever(f"shard at {bar.tokens:,} tokens ({bar.gateway}'s bar)", "shard", shard_tokens=bar.tokens,
                         note=f"{bar.gateway}'s bar ({at}) counted in engine tokens: prompts at or over it to a long "
                              "lane of one engine, the rest round-robin over the others", unavailable=reason))
    for q in (0.9, 0.99):
        threshold = prompts[min(len(prompts) - 1, int(q * len(prompts)))] if prompts else 0
        threshold = max(1024, -(-threshold // 1024) * 1024)
        if threshold in seen:
            continue
        seen.add(threshold)
        if bars:
            in_unit = "; ".join(bar.in_unit(threshold) for bar in bars)
        elif chars:
            in_unit = f"~{threshold * chars:,.0f} characters at {chars:g} characters per token"
        else:
            in_unit = (f"~{threshold * 3:,}-{threshold * 4:,} characters at 3 (code) to 4 (prose) per token: the "
                       "store holds no prompt text, --chars-per-token gives yours")
        out.append(Lever(f"shard at {threshold:,} tokens", "shard", shard_tokens=threshold,
                         note=f"prompts >= {threshold:,} tokens ({in_unit}) to a long lane of one engine, the "
                              "rest round-robin over the others", unavailable=reason))
    return out
