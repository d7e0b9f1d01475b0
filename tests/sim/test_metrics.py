"""The simulator's /metrics must look like vLLM 0.33.0's, and agree with its own step records."""

from __future__ import annotations

from prometheus_client import REGISTRY
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from stepline.core.clock import ManualClock
from stepline.sim.config import EngineConfig
from stepline.sim.engine import Simulation
from stepline.sim.metrics import FINISHED_REASONS, VllmMetrics
from stepline.sim.records import FinishedRequest, StepRecord
from stepline.sim.workloads import make_workload
from tests.conftest import VLLM_METRICS_FIXTURE


def fixture_text() -> str:
    return VLLM_METRICS_FIXTURE.read_text()


class Shape:
    """Per-family type, help, label names and histogram buckets of one exposition."""

    def __init__(self, text: str) -> None:
        self.types: dict[str, str] = {}
        self.helps: dict[str, str] = {}
        self.labels: dict[str, set[str]] = {}
        self.buckets: dict[str, list[float]] = {}
        for family in text_string_to_metric_families(text):
            if not family.name.startswith("vllm:"):
                continue
            self.types[family.name] = family.type
            self.helps[family.name] = family.documentation
            self.labels[family.name] = {name for s in family.samples for name in s.labels if name != "le"}
            bounds = {float(s.labels["le"]) for s in family.samples if s.name.endswith("_bucket")}
            if bounds:
                self.buckets[family.name] = sorted(bounds)


def run_steady(seconds: float = 30.0) -> tuple[Simulation, list[StepRecord]]:
    steps: list[StepRecord] = []
    sim = Simulation(
        make_workload("steady", duration_s=seconds), EngineConfig(), ManualClock(0.0), on_step=steps.append
    )
    sim.advance_to(seconds + 30.0)
    return sim, steps


def samples(text: bytes) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    out: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
    for family in text_string_to_metric_families(text.decode()):
        sample: Sample
        for sample in family.samples:
            out[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return out


def value(values: dict[tuple[str, tuple[tuple[str, str], ...]], float], name: str, **labels: str) -> float:
    return sum(v for (n, ls), v in values.items() if n == name and set(labels.items()) <= set(ls))


def test_families_types_labels_and_buckets_match_vllm_0_33() -> None:
    fixture = Shape(fixture_text())
    sim, _ = run_steady()
    ours = Shape(sim.render_metrics().decode())
    assert len(fixture.types) > 60
    assert sorted(ours.types) == sorted(fixture.types)
    assert ours.types == fixture.types
    assert ours.helps == fixture.helps
    assert ours.labels == fixture.labels
    assert ours.buckets == fixture.buckets


def test_fixed_label_values_match_the_fixture() -> None:
    sim, _ = run_steady(5.0)
    ours = samples(sim.render_metrics())
    fixture = samples(fixture_text().encode())

    def values_of(table: dict[tuple[str, tuple[tuple[str, str], ...]], float], name: str, label: str) -> set[str]:
        return {dict(ls)[label] for (n, ls) in table if n == name}

    for name, label in [
        ("vllm:request_success_total", "finished_reason"),
        ("vllm:prompt_tokens_by_source_total", "source"),
        ("vllm:prompt_tokens_cached_by_source_total", "source"),
        ("vllm:num_requests_waiting_by_reason", "reason"),
        ("vllm:engine_sleep_state", "sleep_state"),
        ("vllm:admission_rejections_total", "reason"),
    ]:
        assert values_of(ours, name, label) == values_of(fixture, name, label), name
    assert value(ours, "vllm:cache_config_info", block_size="16", num_gpu_blocks="48213") == 1.0


def test_no_process_or_gc_families_and_no_global_registration() -> None:
    sim, _ = run_steady(5.0)
    names = {f.name for f in text_string_to_metric_families(sim.render_metrics().decode())}
    assert all(name.startswith("vllm:") for name in names)
    assert not any(family.name.startswith("vllm:") for family in REGISTRY.collect())


def test_two_simulations_do_not_share_counters() -> None:
    first, _ = run_steady(10.0)
    second = Simulation(make_workload("steady", duration_s=10.0), EngineConfig(), ManualClock(0.0))
    assert value(samples(first.render_metrics()), "vllm:generation_tokens_total") > 0
    assert value(samples(second.render_metrics()), "vllm:generation_tokens_total") == 0


def test_counters_and_histograms_agree_with_the_step_records() -> None:
    sim, steps = run_steady()
    values = samples(sim.render_metrics())
    finished = [f for s in steps for f in s.finished_requests]
    assert sim.is_done() and len(finished) == len(sim.workload.arrivals)
    assert value(values, "vllm:generation_tokens_total") == sum(s.num_output_tokens for s in steps)
    assert value(values, "vllm:generation_tokens_total") == sum(f.num_generation_tokens for f in finished)
    assert value(values, "vllm:prompt_tokens_total") == sum(f.num_prompt_tokens for f in finished)
    assert value(values, "vllm:prompt_tokens_cached_total") == sum(f.num_cached_tokens for f in finished)
    assert value(values, "vllm:prefix_cache_hits_total") == sum(s.prefix_cache_hits for s in steps)
    assert value(values, "vllm:prefix_cache_queries_total") == sum(s.prefix_cache_queries for s in steps)
    assert 0.8 < value(values, "vllm:prefix_cache_hits_total") / value(values, "vllm:prefix_cache_queries_total") < 1
    computed = value(values, "vllm:prompt_tokens_by_source_total", source="local_compute")
    cached = value(values, "vllm:prompt_tokens_by_source_total", source="local_cache_hit")
    assert computed + cached == value(values, "vllm:prompt_tokens_total")
    for reason in ("stop", "length", "abort"):
        expected = sum(1 for a in sim.workload.arrivals if a.finish_reason == reason)
        assert value(values, "vllm:request_success_total", finished_reason=reason) == expected
    assert value(values, "vllm:time_to_first_token_seconds_count") == len(finished)
    assert value(values, "vllm:e2e_request_latency_seconds_count") == len(finished)
    itl_count = sum(len(s.inter_token_latencies_iter) for s in steps)
    assert value(values, "vllm:inter_token_latency_seconds_count") == itl_count
    assert itl_count == sum(f.num_generation_tokens - 1 for f in finished)
    assert value(values, "vllm:num_requests_running") == 0
    assert value(values, "vllm:kv_cache_usage_perc") == 0
    assert value(values, "vllm:iteration_tokens_total_sum") == sum(
        s.num_prompt_tokens + s.num_output_tokens for s in steps
    )


def test_a_finished_request_moves_the_families_vllm_moves_for_it() -> None:
    metrics = VllmMetrics(EngineConfig(model="m"))
    metrics.observe_queue(running=3, waiting=2, kv_cache_usage=0.25)
    metrics.observe_finished(FinishedRequest(
        request_id="r", finish_reason="length", arrival_ts=1.0, finished_ts=3.0, e2e_latency=2.0, queued_time=0.5,
        prefill_time=0.25, decode_time=1.25, inference_time=1.5, time_to_first_token=0.75,
        mean_time_per_output_token=0.05, num_prompt_tokens=100, num_cached_tokens=40, num_generation_tokens=26,
        max_tokens_param=26, num_preemptions=0))
    values = samples(metrics.render())
    assert value(values, "vllm:num_requests_running") == 3 and value(values, "vllm:num_requests_waiting") == 2
    assert value(values, "vllm:kv_cache_usage_perc") == 0.25
    assert {reason: value(values, "vllm:request_success_total", finished_reason=reason)
            for reason in FINISHED_REASONS} == {r: float(r == "length") for r in FINISHED_REASONS}
    assert value(values, "vllm:e2e_request_latency_seconds_sum") == 2.0
    assert value(values, "vllm:request_queue_time_seconds_count") == 1
    assert value(values, "vllm:request_prefill_kv_computed_tokens_sum") == 60  # prompt tokens not from the cache
    assert value(values, "vllm:request_params_n_sum") == 1
