"""Scheduler invariants: budget, decode-first, one partial prefill, caps, preemption, completion."""

from __future__ import annotations

from dataclasses import dataclass, field

from hypothesis import example, given, settings
from hypothesis import strategies as st

from stepline.sim.config import EngineConfig
from stepline.sim.scheduler import Batch, Request, Scheduler


@dataclass
class Run:
    """Every batch a scheduler produced while draining a set of requests."""

    batches: list[Batch] = field(default_factory=list)
    finished: list[Request] = field(default_factory=list)
    max_waiting: int = 0


def drive(config: EngineConfig, requests: list[Request], max_steps: int = 200_000) -> Run:
    """Run schedule/complete until idle, checking the invariants after every scheduling decision."""
    scheduler = Scheduler(config)
    pending = sorted(requests, key=lambda r: r.arrival)
    run = Run()
    now = 0.0
    for _ in range(max_steps):
        while pending and pending[0].arrival <= now:
            scheduler.add(pending.pop(0))
        if not scheduler.has_work():
            if not pending:
                return run
            now = pending[0].arrival
            continue
        decoding_before = [r for r in scheduler.running if r.is_decoding]
        batch = scheduler.schedule(now)
        check_batch(config, scheduler, batch, decoding_before)
        run.batches.append(batch)
        run.max_waiting = max(run.max_waiting, len(scheduler.waiting))
        now += config.cost.step_seconds(
            batch.prefill_tokens, batch.prefill_pairs, len(batch.decodes), batch.decode_context_tokens
        )
        run.finished.extend(scheduler.complete(batch, now).finished)
    raise AssertionError("the scheduler did not drain")


def check_batch(config: EngineConfig, scheduler: Scheduler, batch: Batch, decoding_before: list[Request]) -> None:
    assert not batch.is_empty or batch.num_preempted, "work was pending but nothing was scheduled"
    assert batch.prefill_tokens + len(batch.decodes) <= config.max_num_batched_tokens
    assert len(scheduler.running) <= config.max_num_seqs
    lone = not batch.decodes and len(scheduler.running) + len(scheduler.waiting) == 1
    if config.long_prefill_token_threshold and not lone:  # a lone request is not capped (vLLM)
        assert all(tokens <= config.long_prefill_token_threshold for _, _, tokens in batch.prefills)
    partial = [r for r in scheduler.running if r.computed < r.num_tokens]
    # Uncapped, one prompt at a time is partway through prefill; capped, several may be (vLLM v1).
    assert len(partial) <= 1 or config.long_prefill_token_threshold, "more than one unfinished prefill"
    held = sum(r.blocks for r in scheduler.running)
    assert held + scheduler.free_blocks == config.num_gpu_blocks
    assert scheduler.free_blocks >= 0
    for request in scheduler.running:
        assert request.blocks * config.block_size >= request.computed
    if len(decoding_before) <= config.max_num_batched_tokens:
        # A request resumed after preemption may need exactly one token more; it gets it as the partial prefill.
        scheduled = {id(r) for r in batch.decodes} | {id(r) for r, _, _ in batch.prefills}
        preempted = {id(r) for r in scheduler.waiting}
        for request in decoding_before:
            assert id(request) in scheduled or id(request) in preempted, "a decoding request was skipped"


def requests_of(sizes: list[tuple[int, int]], cached: float = 0.0, spacing: float = 0.0) -> list[Request]:
    return [Request(f"r{i}", i * spacing, prompt, output, cached) for i, (prompt, output) in enumerate(sizes)]


def test_every_request_finishes_with_its_output_tokens() -> None:
    requests = requests_of([(100 + 37 * i, 1 + (i * 13) % 60) for i in range(40)], cached=0.3, spacing=0.01)
    run = drive(EngineConfig(max_num_batched_tokens=512), requests)
    assert sorted(r.request_id for r in run.finished) == sorted(r.request_id for r in requests)
    assert all(r.generated == r.output_tokens for r in run.finished)
    assert all(r.blocks == 0 for r in run.finished)


def test_decodes_come_first_and_prefill_gets_the_remaining_budget() -> None:
    config = EngineConfig(max_num_batched_tokens=200)
    scheduler = Scheduler(config)
    for request in requests_of([(16, 50)] * 10):
        scheduler.add(request)
    batch = scheduler.schedule(0.0)
    scheduler.complete(batch, 0.01)
    assert all(r.is_decoding for r in scheduler.running)
    scheduler.add(Request("long", 0.01, 5000, 4))
    batch = scheduler.schedule(0.01)
    assert len(batch.decodes) == 10
    assert [(r.request_id, tokens) for r, _, tokens in batch.prefills] == [("long", 190)]


def test_only_one_prefill_stays_partial() -> None:
    scheduler = Scheduler(EngineConfig(max_num_batched_tokens=8192))
    for request in requests_of([(20_000, 4), (20_000, 4)]):
        scheduler.add(request)
    batch = scheduler.schedule(0.0)
    assert [(r.request_id, start, tokens) for r, start, tokens in batch.prefills] == [("r0", 0, 8192)]
    assert [r.request_id for r in scheduler.waiting] == ["r1"]


def test_threshold_caps_every_chunk_and_prefills_several_prompts_at_once() -> None:
    """vLLM v1: each prompt's chunk is capped, and capped prompts prefill side by side (scheduler.py)."""
    scheduler = Scheduler(EngineConfig(max_num_batched_tokens=8192, long_prefill_token_threshold=1000))
    for request in requests_of([(5000, 4), (500, 4), (900, 4), (5000, 4), (100, 4)]):
        scheduler.add(request)
    batch = scheduler.schedule(0.0)
    assert [(r.request_id, tokens) for r, _, tokens in batch.prefills] == [
        ("r0", 1000), ("r1", 500), ("r2", 900), ("r3", 1000), ("r4", 100)]
    assert not scheduler.waiting
    # r0 and r3 both continue, capped, oldest first
    scheduler.complete(batch, 0.1)
    following = scheduler.schedule(0.1)
    assert [(r.request_id, start, tokens) for r, start, tokens in following.prefills] == [
        ("r0", 1000, 1000), ("r3", 1000, 1000)]


def test_a_lone_request_is_not_capped() -> None:
    """vLLM drops the threshold when the engine holds one request: nobody to starve."""
    scheduler = Scheduler(EngineConfig(max_num_batched_tokens=8192, long_prefill_token_threshold=1000))
    scheduler.add(Request("alone", 0.0, 5000, 4))
    assert [tokens for _, _, tokens in scheduler.schedule(0.0).prefills] == [5000]


def test_threshold_is_honoured_over_a_whole_run() -> None:
    config = EngineConfig(max_num_batched_tokens=4096, long_prefill_token_threshold=700)
    run = drive(config, requests_of([(3000, 5), (12_000, 3), (150, 8), (9000, 2)], spacing=0.05))
    chunks = [tokens for batch in run.batches for _, _, tokens in batch.prefills]
    assert 700 in chunks
    # A prompt alone in the engine is not capped (vLLM): a chunk over the threshold is the step's only work.
    uncapped = [b for b in run.batches if any(tokens > 700 for _, _, tokens in b.prefills)]
    assert uncapped and all(len(b.prefills) == 1 and not b.decodes for b in uncapped)
    assert len(run.finished) == 4


def test_max_num_seqs_bounds_the_running_set() -> None:
    config = EngineConfig(max_num_seqs=3)
    run = drive(config, requests_of([(64, 30)] * 10))
    assert len(run.finished) == 10
    assert max(len(b.decodes) + len(b.prefills) for b in run.batches) == 3
    assert run.max_waiting == 7


def test_prefix_cache_hits_are_whole_blocks_and_skip_compute() -> None:
    scheduler = Scheduler(EngineConfig())
    scheduler.add(Request("half", 0.0, 1000, 4, cached_fraction=0.5))
    scheduler.add(Request("full", 0.0, 1024, 4, cached_fraction=1.0))
    batch = scheduler.schedule(0.0)
    # 500 cached tokens round down to 31 blocks; a full hit still recomputes the last block.
    assert [(r.request_id, start, tokens) for r, start, tokens in batch.prefills] == [
        ("half", 496, 504),
        ("full", 1008, 16),
    ]
    assert (batch.prefix_cache_queries, batch.prefix_cache_hits) == (2024, 1504)


def test_short_kv_preempts_the_most_recently_admitted_request() -> None:
    # Room for 6 blocks (96 tokens): both 32-token prompts fit, their decodes do not.
    config = EngineConfig(num_gpu_blocks=6, max_num_batched_tokens=64)
    first, second = Request("first", 0.0, 32, 40), Request("second", 0.0, 32, 40)
    scheduler = Scheduler(config)
    scheduler.add(first)
    scheduler.add(second)
    now, preempted_at = 0.0, None
    while scheduler.has_work():
        batch = scheduler.schedule(now)
        if batch.num_preempted and preempted_at is None:
            preempted_at = now
            assert scheduler.waiting[0] is second, "a preempted request goes back to the front"
            assert second.computed == 0 and second.blocks == 0
        now += 0.01
        scheduler.complete(batch, now)
    assert preempted_at is not None
    assert first.num_preemptions == 0 and second.num_preemptions >= 1
    assert scheduler.num_preemptions == second.num_preemptions
    assert first.generated == second.generated == 40


def test_preemption_under_pressure_still_drains() -> None:
    config = EngineConfig(num_gpu_blocks=64, max_num_batched_tokens=256)
    run = drive(config, requests_of([(200, 150)] * 6, spacing=0.001))
    assert sum(b.num_preempted for b in run.batches) > 0
    assert all(r.generated == r.output_tokens for r in run.finished)
    assert len(run.finished) == 6


sizes = st.lists(st.tuples(st.integers(1, 3000), st.integers(1, 80)), min_size=1, max_size=25)


@settings(max_examples=60, deadline=None, database=None)
@given(
    sizes=sizes,
    budget=st.integers(32, 4096),
    seqs=st.integers(1, 16),
    threshold=st.sampled_from([0, 16, 100, 1000]),
    extra_blocks=st.integers(0, 300),
    cached=st.floats(0.0, 1.0),
)
@example(sizes=[(1, 4), (31, 3)], budget=32, seqs=2, threshold=0, extra_blocks=0, cached=0.0)
def test_invariants_hold_for_arbitrary_traffic(
    sizes: list[tuple[int, int]], budget: int, seqs: int, threshold: int, extra_blocks: int, cached: float
) -> None:
    largest = max(-(-(prompt + output) // 16) for prompt, output in sizes)
    config = EngineConfig(
        max_num_batched_tokens=budget,
        max_num_seqs=seqs,
        long_prefill_token_threshold=threshold,
        num_gpu_blocks=largest + extra_blocks,
    )
    requests = requests_of(sizes, cached=cached, spacing=0.003)
    run = drive(config, requests)
    assert sorted(r.request_id for r in run.finished) == sorted(r.request_id for r in requests)
    assert all(r.generated == r.output_tokens for r in run.finished)


def test_leaked_slots_wedge_the_engine_until_released() -> None:
    config = EngineConfig(max_num_seqs=2, leak_aborted_slots=True)
    scheduler = Scheduler(config)
    for i in range(2):
        scheduler.add(Request(f"a{i}", 0.0, 16, 2, 0.0, "abort", 2))
    scheduler.add(Request("w", 0.0, 16, 2, 0.0, "length", 2))
    now = 0.0
    for _ in range(10):
        batch = scheduler.schedule(now)
        now += 0.01
        scheduler.complete(batch, now)
    assert [r.request_id for r in scheduler.waiting] == ["w"] and all(r.leaked for r in scheduler.running)
    assert scheduler.schedule(now).is_empty  # wedged: nothing can run
    assert scheduler.release_leaked() == 2 and scheduler.running == []
    assert scheduler.free_blocks == config.num_gpu_blocks
    assert not scheduler.schedule(now).is_empty  # the waiting request runs again
