"""What the plugin reads of vLLM's configuration: how the engine core steps, named as the timeline names it."""

from __future__ import annotations

import enum
from typing import Any

import pytest

from stepline.plugin.config import batch_queue, describe_config


class _Section:
    def __init__(self, **kw: Any) -> None:
        self.__dict__.update(kw)


class _CUDAGraphMode(enum.Enum):  # vLLM's is an enum too (vllm/config/compilation.py)
    FULL_AND_PIECEWISE = (2, 1)


class _VllmConfig(_Section):
    """As vLLM 0.33's VllmConfig.max_concurrent_batches computes it (vllm/config/vllm.py:587-598, V1 runner)."""

    parallel_config: Any
    scheduler_config: Any

    @property
    def max_concurrent_batches(self) -> int:
        pp = self.parallel_config.pipeline_parallel_size
        return (2 if pp <= 1 else pp) if self.scheduler_config.async_scheduling else pp


def _config(async_scheduling: bool | None, pp: int = 1) -> _VllmConfig:
    return _VllmConfig(
        model_config=_Section(model="Qwen/Qwen3-8B"),
        scheduler_config=_Section(max_num_batched_tokens=8192, async_scheduling=async_scheduling),
        parallel_config=_Section(tensor_parallel_size=2, pipeline_parallel_size=pp, data_parallel_size=4,
                                 data_parallel_rank=3, enable_expert_parallel=True, enable_elastic_ep=False,
                                 _api_process_count=2, _api_process_rank=1),
        compilation_config=_Section(cudagraph_mode=_CUDAGraphMode.FULL_AND_PIECEWISE),
        kv_transfer_config=_Section(kv_role="kv_consumer"),
    )


def test_the_scheduling_mode_is_recorded_with_the_config() -> None:
    described = describe_config(_config(True), 3)
    assert {k: described[k] for k in ("async_scheduling", "max_concurrent_batches", "tensor_parallel_size",
                                      "pipeline_parallel_size", "data_parallel_size", "data_parallel_rank",
                                      "enable_expert_parallel", "enable_elastic_ep", "api_server_count",
                                      "api_server_rank", "kv_role")} == {
        "async_scheduling": True, "max_concurrent_batches": 2, "tensor_parallel_size": 2,
        "pipeline_parallel_size": 1, "data_parallel_size": 4, "data_parallel_rank": 3,
        "enable_expert_parallel": True, "enable_elastic_ep": False, "api_server_count": 2, "api_server_rank": 1,
        "kv_role": "kv_consumer"}
    assert described["cudagraph_mode"] == str(_CUDAGraphMode.FULL_AND_PIECEWISE)  # an enum, as text
    assert batch_queue(described)


@pytest.mark.parametrize(("async_scheduling", "pp", "queued"), [(True, 1, True), (False, 1, False),
                                                                (False, 2, True), (None, 1, False)])
def test_the_batch_queue_follows_max_concurrent_batches(async_scheduling: bool | None, pp: int,
                                                        queued: bool) -> None:
    described = describe_config(_config(async_scheduling, pp))
    assert batch_queue(described) is queued
    # A plugin that could not read the property judges by async scheduling and the pipeline, as vLLM does.
    del described["max_concurrent_batches"]
    assert batch_queue(described) is queued


def test_a_property_that_fails_leaves_the_figure_out() -> None:
    class Broken(_Section):
        @property
        def max_concurrent_batches(self) -> int:
            raise RuntimeError("this vLLM computes it from a platform it has not loaded")

    described = describe_config(Broken(scheduler_config=_Section(async_scheduling=True)))
    assert "max_concurrent_batches" not in described and described["async_scheduling"] is True
    assert batch_queue(described)
