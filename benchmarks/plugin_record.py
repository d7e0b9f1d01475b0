#!/usr/bin/env python3
"""What the stepline plugin's `record()` costs per engine step, against what vLLM's own Prometheus logger costs.

vLLM calls every stat logger's `record()` once per engine-core output batch, on its output-handling
path. This measures stepline's `PluginCore.record()` there, per call, with a realistic step (32
running: one 8192-token prefill and 31 decodes, 31 ITL samples, one TTFT, eight finished requests),
in three states of the sidecar:

    up       a PluginReceiver in another process reads the socket in a loop and decodes every row
    down     no socket at the path (each flush finds no sidecar; reconnects are rate-limited)
    stalled  a bound socket that is never read, as with a SIGSTOPped sidecar: the kernel queue fills,
             sends hit EAGAIN, the plugin's bounded buffer fills and then drops its oldest batches

The baseline, measured in the same run, is the prometheus_client work vLLM's PrometheusStatLogger.record
does for the same step (see `VllmPrometheusBaseline`). Targets: stepline's median <= 0.5x the baseline's
median, and its p99 < 50 us, in all three states.

The benchmark runs calls back to back, far faster than an engine steps. So that the plugin flushes as
often as it would while serving (every `flush_interval_s` = 50 ms of engine time), its monotonic clock
runs ahead by `--step-ms` (default 10 ms, a decode step of 32 requests) per call: it flushes every
5th call, not every ~1,500th. `--step-ms 0` gives it the real clock (rare flushes, a rosier p99).
A flush in `record()` seals the batch and wakes the plugin's sender thread, which sends from this
process as it would inside vLLM's: the time it holds the GIL lands in the timed calls, as it would.
Back to back, the calls make ~70,000 steps/s, 70x a busy engine, so "sidecar up" also drops the oldest
batches (buffer_full) whenever the sender waits for its turn at the GIL; the sustained-rate figures are
benchmarks/receiver_throughput.py's and benchmarks/plugin_backlog.py's.

Prints figures; always exits 0. Missed targets are printed as "TARGET MISSED" lines.
"""

from __future__ import annotations

import argparse
import gc
import logging
import math
import multiprocessing as mp
import os
import platform
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Sequence, Sized
from dataclasses import dataclass, field
from multiprocessing.queues import Queue
from multiprocessing.synchronize import Event as MpEvent
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from realistic import CTX_TOKENS, RUNNING, Step, build_steps

from stepline.core.clock import SystemClock
from stepline.model.rows import Row
from stepline.plugin.core import PluginCore
from stepline.sim.metrics import (
    ITERATION_TOKEN_BUCKETS,
    N_BUCKETS,
    PREEMPTION_BUCKETS,
    REQUEST_LATENCY_BUCKETS,
    TOKEN_BUCKETS,
    TOKEN_LATENCY_BUCKETS,
    TTFT_BUCKETS,
)
from stepline.sources.base import SourceContext
from stepline.sources.plugin_receiver import PluginReceiver
from stepline.testing.vllm_standins import (
    FinishReason,
)

MODEL = "meta-llama/Llama-3.1-8B-Instruct"
FINISHED_PER_STEP = 8
DISTINCT_STEPS = 300
MEDIAN_RATIO_TARGET = 0.5
P99_TARGET_US = 50.0

RecordFn = Callable[[Any, Any, int], None]


# -- inputs ----------------------------------------------------------------------------------------------


# -- the baseline: vLLM's PrometheusStatLogger.record ----------------------------------------------------


class VllmPrometheusBaseline:
    """The prometheus_client work of vLLM 0.33's PrometheusStatLogger.record, for one engine.

    Families, labels (model_name, engine) and buckets as vLLM 0.33 exposes them (the simulator's
    stepline.sim.metrics, checked against tests/fixtures/vllm-0.33.0-metrics.txt). Children are resolved
    once up front into per-engine dicts, as vLLM does, and looked up by engine index per call, as vLLM
    does. Per step it covers: the running/waiting/waiting-by-reason/KV-usage gauges; the prefix-cache,
    preemption, prompt-token, prompt-tokens-by-source, cached-prompt-token and generation-token counters;
    the iteration-tokens histogram; one observation per max-generation-tokens, n-param, TTFT and ITL
    sample; and per finished request the success counter by reason and the e2e, queue, prefill,
    inference, decode, prefill-KV-computed, prompt-tokens, generation-tokens, time-per-output-token,
    num-preemptions and max_tokens histograms. Not covered (off by default or absent from this step):
    spec decoding, KV connector, LoRA info, multi-modal cache, KV-block eviction and corrupted-request
    metrics. vLLM's own bookkeeping around the call (building the stats objects) is not counted for
    either side.
    """

    def __init__(self, engine_indexes: Sequence[int] = (0,)) -> None:
        self.registry = CollectorRegistry()
        reg = self.registry
        labels = ["model_name", "engine"]

        def per_engine(family: Any, *extra: str) -> dict[int, Any]:
            return {idx: family.labels(MODEL, str(idx), *extra) for idx in engine_indexes}

        def gauge(name: str) -> dict[int, Gauge]:
            return per_engine(Gauge(name, name, labels, registry=reg))

        def counter(name: str) -> dict[int, Counter]:
            return per_engine(Counter(name, name, labels, registry=reg))

        def histogram(name: str, buckets: Sequence[float]) -> dict[int, Histogram]:
            return per_engine(Histogram(name, name, labels, buckets=buckets, registry=reg))

        self.gauge_running = gauge("vllm:num_requests_running")
        self.gauge_waiting = gauge("vllm:num_requests_waiting")
        by_reason = Gauge("vllm:num_requests_waiting_by_reason", "by reason", [*labels, "reason"], registry=reg)
        self.gauge_waiting_by_reason = {r: per_engine(by_reason, r) for r in ("capacity", "deferred")}
        self.gauge_kv_usage = gauge("vllm:kv_cache_usage_perc")
        self.counter_prefix_queries = counter("vllm:prefix_cache_queries")
        self.counter_prefix_hits = counter("vllm:prefix_cache_hits")
        self.counter_preemptions = counter("vllm:num_preemptions")
        self.counter_prompt_tokens = counter("vllm:prompt_tokens")
        by_source = Counter("vllm:prompt_tokens_by_source", "by source", [*labels, "source"], registry=reg)
        self.counter_prompt_by_source = {s: per_engine(by_source, s)
                                         for s in ("local_compute", "local_cache_hit", "external_kv_transfer")}
        self.counter_prompt_cached = counter("vllm:prompt_tokens_cached")
        self.counter_generation_tokens = counter("vllm:generation_tokens")
        success = Counter("vllm:request_success", "success", [*labels, "finished_reason"], registry=reg)
        self.counter_success = {reason: per_engine(success, str(reason)) for reason in FinishReason}
        self.hist_iteration_tokens = histogram("vllm:iteration_tokens_total", ITERATION_TOKEN_BUCKETS)
        self.hist_max_generation = histogram("vllm:request_max_num_generation_tokens", TOKEN_BUCKETS)
        self.hist_n = histogram("vllm:request_params_n", N_BUCKETS)
        self.hist_ttft = histogram("vllm:time_to_first_token_seconds", TTFT_BUCKETS)
        self.hist_itl = histogram("vllm:inter_token_latency_seconds", TOKEN_LATENCY_BUCKETS)
        self.hist_e2e = histogram("vllm:e2e_request_latency_seconds", REQUEST_LATENCY_BUCKETS)
        self.hist_queue = histogram("vllm:request_queue_time_seconds", REQUEST_LATENCY_BUCKETS)
        self.hist_prefill = histogram("vllm:request_prefill_time_seconds", REQUEST_LATENCY_BUCKETS)
        self.hist_inference = histogram("vllm:request_inference_time_seconds", REQUEST_LATENCY_BUCKETS)
        self.hist_decode = histogram("vllm:request_decode_time_seconds", REQUEST_LATENCY_BUCKETS)
        self.hist_kv_computed = histogram("vllm:request_prefill_kv_computed_tokens", TOKEN_BUCKETS)
        self.hist_prompt_tokens = histogram("vllm:request_prompt_tokens", TOKEN_BUCKETS)
        self.hist_generation_tokens = histogram("vllm:request_generation_tokens", TOKEN_BUCKETS)
        self.hist_tpot = histogram("vllm:request_time_per_output_token_seconds", TOKEN_LATENCY_BUCKETS)
        self.hist_preemptions = histogram("vllm:request_num_preemptions", PREEMPTION_BUCKETS)
        self.hist_max_tokens = histogram("vllm:request_params_max_tokens", TOKEN_BUCKETS)

    def record(self, scheduler_stats: Any, iteration_stats: Any, engine_idx: int = 0) -> None:
        """Follows the structure of vLLM's PrometheusStatLogger.record (v1 engine)."""
        if scheduler_stats is not None:
            self.gauge_running[engine_idx].set(scheduler_stats.num_running_reqs)
            self.gauge_waiting[engine_idx].set(scheduler_stats.num_waiting_reqs
                                               + scheduler_stats.num_skipped_waiting_reqs)
            self.gauge_waiting_by_reason["capacity"][engine_idx].set(scheduler_stats.num_waiting_reqs)
            self.gauge_waiting_by_reason["deferred"][engine_idx].set(scheduler_stats.num_skipped_waiting_reqs)
            self.gauge_kv_usage[engine_idx].set(scheduler_stats.kv_cache_usage)
            self.counter_prefix_queries[engine_idx].inc(scheduler_stats.prefix_cache_stats.queries)
            self.counter_prefix_hits[engine_idx].inc(scheduler_stats.prefix_cache_stats.hits)
        if iteration_stats is None:
            return
        pts = iteration_stats.prompt_token_stats
        self.counter_preemptions[engine_idx].inc(iteration_stats.num_preempted_reqs)
        self.counter_prompt_tokens[engine_idx].inc(pts.total)
        self.counter_prompt_by_source["local_compute"][engine_idx].inc(pts.computed)
        self.counter_prompt_by_source["local_cache_hit"][engine_idx].inc(pts.local_cache_hit)
        self.counter_prompt_by_source["external_kv_transfer"][engine_idx].inc(pts.external_kv_transfer)
        self.counter_prompt_cached[engine_idx].inc(pts.cached_tokens)
        self.counter_generation_tokens[engine_idx].inc(iteration_stats.num_generation_tokens)
        self.hist_iteration_tokens[engine_idx].observe(pts.total + iteration_stats.num_generation_tokens)
        for max_gen_tokens in iteration_stats.max_num_generation_tokens_iter:
            self.hist_max_generation[engine_idx].observe(max_gen_tokens)
        for n_param in iteration_stats.n_params_iter:
            self.hist_n[engine_idx].observe(n_param)
        for ttft in iteration_stats.time_to_first_tokens_iter:
            self.hist_ttft[engine_idx].observe(ttft)
        for itl in iteration_stats.inter_token_latencies_iter:
            self.hist_itl[engine_idx].observe(itl)
        for f in iteration_stats.finished_requests:
            self.counter_success[f.finish_reason][engine_idx].inc()
            self.hist_e2e[engine_idx].observe(f.e2e_latency)
            self.hist_queue[engine_idx].observe(f.queued_time)
            self.hist_prefill[engine_idx].observe(f.prefill_time)
            self.hist_inference[engine_idx].observe(f.inference_time)
            self.hist_decode[engine_idx].observe(f.decode_time)
            self.hist_kv_computed[engine_idx].observe(f.num_prompt_tokens - max(f.num_cached_tokens, 0))
            self.hist_prompt_tokens[engine_idx].observe(f.num_prompt_tokens)
            self.hist_generation_tokens[engine_idx].observe(f.num_generation_tokens)
            self.hist_tpot[engine_idx].observe(f.mean_time_per_output_token)
            self.hist_preemptions[engine_idx].observe(f.num_preemptions)
            if f.max_tokens_param:
                self.hist_max_tokens[engine_idx].observe(f.max_tokens_param)


# -- the sidecar, in a process of its own ----------------------------------------------------------------


def _pin(cpu: int | None) -> None:
    if cpu is not None and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {cpu})


def run_sidecar(socket_path: str, cpu: int | None, ready: MpEvent, stop: MpEvent,
                results: Queue[tuple[int, dict[str, int]]]) -> None:
    """A PluginReceiver draining the socket: poll with a short window, decode, count and discard rows."""
    _pin(cpu)
    receiver = PluginReceiver(SourceContext("bench", SystemClock()), socket_path, window_s=0.02)
    receiver.start()
    ready.set()
    rows = 0

    def emit(batch: Iterable[Row]) -> None:
        nonlocal rows
        rows += len(batch) if isinstance(batch, Sized) else sum(1 for _ in batch)

    while not stop.is_set():
        receiver.poll(emit)
    receiver.stop()
    receiver.poll(emit)
    results.put((rows, receiver.stats()))


# -- timing ------------------------------------------------------------------------------------------------


class AheadClock:
    """A monotonic clock that runs ahead of the real one by `step_s` per simulated engine step."""

    def __init__(self, step_s: float) -> None:
        self.step_s = step_s
        self.offset = 0.0

    def tick(self) -> None:
        self.offset += self.step_s

    def monotonic(self) -> float:
        return time.monotonic() + self.offset


@dataclass
class Figures:
    """One case's per-call times (the median round's), in microseconds, and the plugin's counters."""

    case: str
    median_us: float
    p99_us: float
    max_us: float
    rounds_median_us: list[float]
    sent: int | None = None
    dropped: dict[str, int] = field(default_factory=dict)
    note: str = ""


def percentile(sorted_ns: Sequence[int], q: float) -> float:
    """Nearest-rank percentile of sorted nanoseconds, in microseconds."""
    rank = max(0, min(len(sorted_ns) - 1, math.ceil(round(q * len(sorted_ns), 6)) - 1))
    return sorted_ns[rank] / 1000.0


def time_calls(record: RecordFn, steps: Sequence[Step], calls: int, tick: Callable[[], None]) -> list[int]:
    """Each call's duration in ns, timed on its own with perf_counter_ns."""
    samples = [0] * calls
    clock = time.perf_counter_ns
    n = len(steps)
    for i in range(calls):
        sched, it = steps[i % n]
        tick()
        t0 = clock()
        record(sched, it, 0)
        samples[i] = clock() - t0
    return samples


@dataclass
class Case:
    """Something to time per call: a record() and the clock tick that goes with each call."""

    name: str
    record: RecordFn
    tick: Callable[[], None] = lambda: None
    core: PluginCore | None = None
    rounds: list[tuple[float, float, float]] = field(default_factory=list)  # (median, p99, max) us

    def warm_up(self, steps: Sequence[Step], calls: int) -> float:
        """Run untimed-for-the-report calls (caches, buffers, the stalled queue's steady state); their median."""
        samples = sorted(time_calls(self.record, steps, calls, self.tick))
        return percentile(samples, 0.5)

    def round(self, steps: Sequence[Step], calls: int) -> None:
        gc.collect()
        samples = sorted(time_calls(self.record, steps, calls, self.tick))
        self.rounds.append((percentile(samples, 0.5), percentile(samples, 0.99), samples[-1] / 1000.0))

    def figures(self) -> Figures:
        """The median round (by its median)."""
        median_us, p99_us, max_us = sorted(self.rounds)[len(self.rounds) // 2]
        figures = Figures(self.name, median_us, p99_us, max_us, [r[0] for r in self.rounds])
        if self.core is not None:
            figures.sent = self.core.records_sent
            figures.dropped = dict(self.core.dropped)
        return figures


def measure(case: Case, steps: Sequence[Step], calls: int, rounds: int) -> Figures:
    """Warm up, then time `rounds` rounds of `calls` calls."""
    case.warm_up(steps, max(2_000, calls // 10))
    for _ in range(rounds):
        case.round(steps, calls)
    return case.figures()


def _noop(_scheduler_stats: Any, _iteration_stats: Any, _engine_idx: int) -> None:
    return None


def fixed_work(target_us: float, steps: Sequence[Step]) -> RecordFn:
    """A call doing the same pure-Python work every time, about `target_us` long: the machine's own tail."""

    def spin(n: int) -> int:
        total = 0
        for i in range(n):
            total += i
        return total

    def calls(n: int) -> RecordFn:
        def call(_scheduler_stats: Any, _iteration_stats: Any, _engine_idx: int) -> None:
            spin(n)

        return call

    probe = 2_000
    median_us = measure(Case("probe", calls(probe)), steps, 2_000, 1).median_us
    return calls(max(1, round(probe * target_us / max(median_us, 0.001))))


def _no_tick() -> None:
    return None


def plugin_case(name: str, socket_path: str, step_s: float) -> Case:
    clock = AheadClock(step_s)
    core = PluginCore("bench", socket_path, monotonic=clock.monotonic)
    return Case(name, core.record, clock.tick, core)


# -- main ----------------------------------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--calls", type=int, default=20_000, help="timed calls per round (default 20000)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds per case; the median round is reported")
    parser.add_argument("--step-ms", type=float, default=10.0,
                        help="engine time per step seen by the plugin's flush clock (0: the real clock)")
    args = parser.parse_args(argv)
    calls, rounds, step_s = max(100, args.calls), max(1, args.rounds), max(0.0, args.step_ms) / 1000.0

    # The plugin logs drops once a minute of its clock; keep that off the benchmark's output, but still pay for it.
    plugin_log = logging.getLogger("stepline.plugin")
    plugin_log.addHandler(logging.NullHandler())
    plugin_log.propagate = False

    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    main_cpu = cpus[0] if len(cpus) >= 2 else None
    sidecar_cpu = cpus[1] if len(cpus) >= 2 else None
    _pin(main_cpu)

    print(f"machine: {platform.platform()}; {platform.processor() or platform.machine()}; "
          f"python {platform.python_version()} ({sys.implementation.name}); cpu_count={os.cpu_count()}, "
          f"usable={len(cpus) or '?'}; timed process on cpu {main_cpu}, sidecar on cpu {sidecar_cpu}")
    started = time.perf_counter()
    steps = build_steps(DISTINCT_STEPS, lambda _i: FINISHED_PER_STEP)
    gc.collect()
    gc.freeze()  # as vLLM does after start-up: long-lived objects stay out of the collector's way
    print(f"step: {RUNNING} running (1 prefill of {CTX_TOKENS} tokens, {RUNNING - 1} decodes), "
          f"{RUNNING - 1} ITL + 1 TTFT samples, {FINISHED_PER_STEP} finished requests; {len(steps)} distinct steps; "
          f"{calls} timed calls x {rounds} rounds per case; plugin clock "
          + (f"+{step_s * 1000:g} ms per call (a flush every {max(1, round(0.05 / step_s))} calls)" if step_s
             else "real (back-to-back calls: rare flushes)"))

    overhead = measure(Case("timer", _noop), steps, calls, 1)
    tmp = tempfile.mkdtemp(prefix="stepline-bench-")
    ctx = mp.get_context("spawn")
    up_path = os.path.join(tmp, "up.sock")
    ready, stop = ctx.Event(), ctx.Event()
    results: Queue[tuple[int, dict[str, int]]] = ctx.Queue()
    sidecar = ctx.Process(target=run_sidecar, args=(up_path, sidecar_cpu, ready, stop, results), daemon=True)
    stalled_receiver = PluginReceiver(SourceContext("bench", SystemClock()), os.path.join(tmp, "stalled.sock"))
    try:
        # (a) sidecar up: a receiver in another process reads and decodes everything.
        sidecar.start()
        if not ready.wait(30):
            raise SystemExit("the sidecar process did not start")
        # (c) sidecar stalled: bound, never read (a SIGSTOPped sidecar).
        stalled_receiver.start()
        baseline_case = Case("vLLM prometheus (baseline)", VllmPrometheusBaseline().record)
        up_case = plugin_case("stepline, sidecar up", up_path, step_s)
        plugin_cases = [
            up_case,
            plugin_case("stepline, sidecar down", os.path.join(tmp, "absent.sock"), step_s),  # (b) nothing there
            plugin_case("stepline, sidecar stalled", stalled_receiver.socket_path, step_s),
        ]
        warm_up_calls = max(2_000, calls // 10)
        up_warm_median = 0.0
        for case in (baseline_case, *plugin_cases):
            median = case.warm_up(steps, warm_up_calls)
            up_warm_median = median if case is up_case else up_warm_median
        # Same-median fixed work shows how much of a p99 is the machine (steal, interrupts, frequency), not the code.
        noise_case = Case("fixed work, same median", fixed_work(up_warm_median, steps))
        noise_case.warm_up(steps, warm_up_calls)
        # Rounds interleave the cases, so that a noisy spell of the machine does not land on one case only.
        for _ in range(rounds):
            for case in (baseline_case, *plugin_cases, noise_case):
                case.round(steps, calls)
        baseline, noise = baseline_case.figures(), noise_case.figures()
        figures = [case.figures() for case in plugin_cases]
        for case in plugin_cases[1:]:
            assert case.core is not None
            case.core.close(drain_timeout_s=0.0)
        assert up_case.core is not None
        up_case.core.close(drain_timeout_s=5.0)
        stop.set()
        rows, stats = results.get(timeout=30)
        sidecar.join(10)
        figures[0].note = (f"sidecar decoded {stats['steps']} steps + {stats['requests']} requests ({rows} rows) "
                           f"of {up_case.core.records_sent} sent; lost datagrams {stats['lost_datagrams']}")
    finally:
        stop.set()
        stalled_receiver.stop()
        shutil.rmtree(tmp, ignore_errors=True)

    print()
    print(f"{'case':<28} {'median us':>10} {'p99 us':>8} {'max us':>9} {'median/base':>12}  "
          f"{'sent':>8}  dropped  (round medians us)")
    for f in (baseline, *figures, noise):
        ratio = f.median_us / baseline.median_us
        sent = "" if f.sent is None else str(f.sent)
        dropped = ", ".join(f"{n} {reason}" for reason, n in sorted(f.dropped.items())) or ("-" if f.sent is not None
                                                                                            else "")
        spread = "/".join(f"{m:.1f}" for m in f.rounds_median_us)
        print(f"{f.case:<28} {f.median_us:>10.2f} {f.p99_us:>8.2f} {f.max_us:>9.1f} {ratio:>11.2f}x  "
              f"{sent:>8}  {dropped}  ({spread})")
    print(f"(timer and call overhead, not subtracted: median {overhead.median_us * 1000:.0f} ns, "
          f"p99 {overhead.p99_us * 1000:.0f} ns)")
    for f in figures:
        if f.note:
            print(f"{f.case}: {f.note}")
    print(f"machine noise: fixed pure-Python work with a {noise.median_us:.1f} us median has p99 {noise.p99_us:.1f} us "
          f"({noise.p99_us / noise.median_us:.2f}x) on this machine; stepline's p99/median is "
          + ", ".join(f"{f.p99_us / f.median_us:.2f}x" for f in figures) + " (up, down, stalled)")

    print()
    missed = 0
    for f in figures:
        ratio = f.median_us / baseline.median_us
        checks = [(ratio <= MEDIAN_RATIO_TARGET,
                   f"median {f.median_us:.2f} us = {ratio:.2f}x baseline (target <= {MEDIAN_RATIO_TARGET}x)"),
                  (f.p99_us < P99_TARGET_US, f"p99 {f.p99_us:.2f} us (target < {P99_TARGET_US:g} us)")]
        for ok, what in checks:
            if ok:
                print(f"ok             {f.case}: {what}")
            else:
                missed += 1
                print(f"TARGET MISSED  {f.case}: {what}")
    print(f"{'all targets met' if not missed else f'{missed} target(s) missed'}; "
          f"ran {time.perf_counter() - started:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
