"""The stand-ins for vLLM's stats classes and its stat-logger base: vLLM's names, defaults and behaviour where the
plugin relies on them (the plugin fed through them: tests/plugin/)."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

from stepline.testing import vllm_standins as standins


def test_finish_reasons_are_an_int_enum_printing_lower_case_as_vllms() -> None:
    assert [int(r) for r in standins.FinishReason] == [0, 1, 2, 3, 4]
    assert str(standins.FinishReason.LENGTH) == "length" and int(standins.FinishReason.STOP) == 0


def test_the_stats_carry_the_attributes_the_plugin_reads_with_vllms_defaults() -> None:
    stats = standins.SchedulerStats()
    assert stats.iteration_details is None and stats.spec_decoding_stats is None
    assert stats.prefix_cache_stats == standins.PrefixCacheStats()
    iteration = standins.IterationStats()
    assert iteration.finished_requests == [] and iteration.prompt_token_stats.cached_tokens == 0
    finished = {f.name for f in dataclasses.fields(standins.FinishedRequestStats)}
    assert {"finish_reason", "request_id", "e2e_latency", "queued_time", "prefill_time", "decode_time",
            "inference_time", "mean_time_per_output_token", "num_cached_tokens", "num_preemptions"} <= finished
    details = {f.name for f in dataclasses.fields(standins.SchedulerIterationDetails)}
    assert {"num_ctx_requests", "num_ctx_tokens", "num_generation_requests", "num_generation_tokens",
            "elapsed_ms", "is_dummy"} <= details


def test_the_written_package_holds_the_stat_logger_base_as_vllm_declares_it(tmp_path: Path) -> None:
    root = standins.write_vllm_package(tmp_path / "site")
    assert root == tmp_path / "site"
    script = ("import inspect; from vllm.v1.metrics.loggers import StatLoggerBase as B; "
              "print(sorted(B.__abstractmethods__), list(inspect.signature(B.record).parameters))")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60,
                          env={"PYTHONPATH": str(root), "PATH": "/usr/bin:/bin"})
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == ("['__init__', 'log_engine_initialized', 'record'] "
                                   "['self', 'scheduler_stats', 'iteration_stats', 'mm_cache_stats', 'engine_idx']")
    standins.write_vllm_package(root)  # again over itself: no error
