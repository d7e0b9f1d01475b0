"""The candidate levers: the engine's recorded settings read as the simulator's, the levers derived from them, and
those its build does not accept kept and marked, saying why."""

from __future__ import annotations

from stepline.sim.config import EngineConfig
from stepline.whatif.levers import baseline_config, candidates, shard_levers
from stepline.whatif.trace import EngineTrace, Steps, TracedRequest

REPORTED = {"served_model_name": "tiny", "max_num_batched_tokens": "2048", "max_num_seqs": "64",
            "long_prefill_token_threshold": "0", "num_gpu_blocks": "4096", "block_size": "16",
            "scheduling_policy": "SchedulerPolicy.FCFS", "prefill_schedule_interval": "1",
            "data_parallel_size": "2"}


def _trace(engine: str, config: dict[str, str], prompts: tuple[int, ...] = (100,)) -> EngineTrace:
    requests = [TracedRequest(f"r{i}", 0.0, 1.0, 0.0, 0.5, 0.5, p, 0, 10, "stop", 16) for i, p in enumerate(prompts)]
    return EngineTrace(engine, config, requests, Steps())


def test_the_recorded_settings_become_the_simulators_and_what_is_missing_is_assumed() -> None:
    config, assumed = baseline_config(_trace("e", REPORTED))
    assert (config.model, config.max_num_batched_tokens, config.max_num_seqs, config.block_size) == (
        "tiny", 2048, 64, 16)
    assert config.policy == "fcfs" and assumed == []
    bare, assumed = baseline_config(_trace("e", {}))
    defaults = EngineConfig()
    assert bare.max_num_seqs == defaults.max_num_seqs and "max_num_seqs=" + str(defaults.max_num_seqs) in assumed
    assert f"max_num_batched_tokens={defaults.max_num_batched_tokens}" in assumed


def test_levers_are_derived_from_the_engines_own_budget() -> None:
    traces = [_trace("a", REPORTED), _trace("b", REPORTED)]
    configs = [baseline_config(t)[0] for t in traces]
    levers = {lever.name: lever for lever in candidates(traces, configs, tpot_s=0.05)}
    assert {"long_prefill_token_threshold=128", "long_prefill_token_threshold=1024", "max_num_batched_tokens=512",
            "max_num_batched_tokens=8192", "max_num_seqs=16", "max_num_seqs=128",
            "deadline-aware chunks (TPOT 50 ms)"} <= set(levers)
    assert "max_num_batched_tokens=2048" not in levers  # the engine's own value is no lever
    assert levers["long_prefill_token_threshold=1024"].unavailable == ""
    assert levers["max_num_partial_prefills=2"].unavailable.startswith("removed from vLLM's scheduler settings")
    assert levers["policy=priority (shorter prompts first)"].priority_by_band


def test_a_setting_the_engine_does_not_report_is_a_lever_it_cannot_take() -> None:
    traces = [_trace("a", {k: v for k, v in REPORTED.items() if k != "max_num_seqs"}), _trace("b", REPORTED)]
    configs = [baseline_config(t)[0] for t in traces]
    levers = {lever.name: lever for lever in candidates(traces, configs, tpot_s=0.05)}
    assert levers["max_num_seqs=128"].unavailable.endswith("does not report max_num_seqs (its vLLM build has no "
                                                          "such setting, or its plugin predates it): a")
    unchunked = [_trace("a", REPORTED | {"enable_chunked_prefill": "False"})]
    lever = next(x for x in candidates(unchunked, [configs[1]], 0.05) if x.family == "long_prefill_token_threshold")
    assert lever.unavailable.startswith("gated: chunked prefill is off on a")


def test_shard_levers_split_at_the_long_prompts_and_need_two_engines() -> None:
    prompts = tuple([500] * 90 + [30_000] * 10)
    two = shard_levers([_trace("a", {}, prompts), _trace("b", {})], chars=None)
    assert [lever.shard_tokens for lever in two] == [1024, 30_720]  # the 90th and 99th percentile, in 1024s
    assert two[0].unavailable == "" and "--chars-per-token gives yours" in two[0].note
    one = shard_levers([_trace("a", {}, prompts)], chars=4.0)
    assert [lever.shard_tokens for lever in one] == [30_720]  # both percentiles there: one lever
    assert one[0].unavailable.startswith("one engine in the window") and "~122,880 characters" in one[0].note
