"""The simulated engine's settings: vLLM's defaults, refused when vLLM would refuse them, and speculative decoding's
acceptance over time."""

from __future__ import annotations

import pytest

from stepline.sim.config import DEFAULT_MODEL, POLICIES, EngineConfig, SpecDecode


def test_the_defaults_are_the_fixtures_engine() -> None:
    config = EngineConfig()
    assert (config.model, config.max_num_batched_tokens, config.max_num_seqs, config.long_prefill_token_threshold) \
        == (DEFAULT_MODEL, 8192, 256, 0)
    assert config.kv_capacity_tokens == 48213 * 16 and config.speculative is None and config.policy == "fcfs"
    assert POLICIES == ("fcfs", "priority")


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"max_num_batched_tokens": 0}, "max_num_batched_tokens must be at least 1, got 0"),
    ({"block_size": -16}, "block_size must be at least 1, got -16"),
    ({"long_prefill_token_threshold": -1}, "must be 0 \\(off\\) or positive, got -1"),
    ({"gpu_memory_utilization": 1.5}, "gpu_memory_utilization must be in \\(0, 1\\], got 1.5"),
    ({"model": ""}, "model must not be empty"),
    ({"policy": "lifo"}, "policy must be one of fcfs, priority, got 'lifo'"),
    ({"host_overhead_s": -0.001}, "host_overhead_s must be 0 or more"),
    ({"deadline_tpot_s": 0.0}, "deadline_tpot_s must be positive when set, got 0.0"),
])
def test_a_setting_vllm_would_refuse_is_refused_naming_it(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        EngineConfig(**kwargs)  # type: ignore[arg-type]


def test_speculative_acceptance_shifts_at_its_second() -> None:
    spec = SpecDecode(num_tokens=3, acceptance=0.8, shift_at_s=60.0, acceptance_after=0.2)
    assert [spec.acceptance_at(t) for t in (0.0, 59.9, 60.0, 600.0)] == [0.8, 0.8, 0.2, 0.2]
    assert SpecDecode(2, 0.5).acceptance_at(1e9) == 0.5


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"num_tokens": 0, "acceptance": 0.5}, "num_tokens must be at least 1, got 0"),
    ({"num_tokens": 2, "acceptance": 1.2}, "acceptance must be in \\[0, 1\\], got 1.2"),
    ({"num_tokens": 2, "acceptance": 0.5, "shift_at_s": 10.0}, "shift_at_s and acceptance_after go together"),
])
def test_a_speculative_setting_out_of_range_is_refused(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SpecDecode(**kwargs)  # type: ignore[arg-type]
