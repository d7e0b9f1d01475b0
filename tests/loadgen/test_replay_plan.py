"""What a replay sends: the window's requests read from the store, and prompts whose shared prefixes make a
block cache hit what was recorded (checked against a small model of vLLM's block hashing)."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from stepline.analysis.window import window_from
from stepline.loadgen import replay_plan
from stepline.store.store import Store
from tests.loadgen.test_replay import SHAPE, T0, fill


def test_the_window_is_read_by_arrival_on_its_engine_alone(store: Store, store_url: str) -> None:
    fill(store)
    fill(store, [(0.1, 5000, 0, 50)], engine="other")
    recorded = replay_plan.load_window(store_url, window_from("30m", str(T0 - 1), str(T0 + 60), "rec"))
    assert [(r.request_id, r.prompt_tokens, r.cached_tokens, r.generation_tokens) for r in recorded] == [
        (f"rec-{i}", p, c, g) for i, (_, p, c, g) in enumerate(SHAPE)]
    assert recorded[0].arrival_ts == pytest.approx(T0, abs=1e-6)
    everyone = replay_plan.read_window(store.client, window_from("30m", str(T0 - 1), str(T0 + 60)), store.database)
    assert len(everyone) == len(SHAPE) + 1 and everyone[1].engine == "other"
    with pytest.raises(replay_plan.ReplayError, match=r"no finished request arrived in .* on engine nobody"):
        replay_plan.load_window(store_url, window_from("30m", str(T0 - 1), str(T0 + 60), "nobody"))


def _block_cache_hits(prompts: Sequence[list[int]], block: int) -> list[int]:
    """What a vLLM-like prefix cache serves of each prompt in turn: whole blocks, chained by hash, never the last
    token; every full block of a prompt is cached once it ran."""
    cached: set[tuple[int, ...]] = set()
    hits = []
    for prompt in prompts:
        n = 0
        while (n + 1) * block <= len(prompt) - 1 and tuple(prompt[:(n + 1) * block]) in cached:
            n += 1
        hits.append(n * block)
        cached.update(tuple(prompt[:(i + 1) * block]) for i in range(len(prompt) // block))
    return hits


@pytest.mark.parametrize("block", [16, 128])
def test_shared_prefixes_make_a_block_cache_hit_what_was_recorded(block: int) -> None:
    # Cached counts as vLLM reports them: whole blocks of the recording engine's size.
    shape = [(0, 200, 0), (1, 200, block), (2, 700, 5 * block), (3, 700, 0), (4, 1100, 8 * block), (5, 50, 0)]
    rows = [replay_plan.Recorded("e", f"r{i}", T0 + t, p, c, 4, "length") for i, (t, p, c) in enumerate(shape)]
    plan = replay_plan.plan(rows, nonce="fixed")
    prompts = [plan.prompt(p) for p in plan.requests]
    assert [len(p) for p in prompts] == [p for _, p, _ in shape]
    assert len(plan.corpus) == 8 * block and all(0 <= t < replay_plan.DEFAULT_VOCAB for p in prompts for t in p)
    hits = _block_cache_hits([list(plan.corpus), *prompts], block)[1:]  # the warm-up first
    assert hits == [c for _, _, c in shape]
    # The same nonce gives the same prompts; another replay's suffixes differ, its shared prefixes do not.
    assert [plan.prompt(p) for p in plan.requests] == prompts
    other = replay_plan.plan(rows, nonce="another")
    assert other.prompt(other.requests[2])[:5 * block] == prompts[2][:5 * block]
    assert other.prompt(other.requests[2])[5 * block:] != prompts[2][5 * block:]


def test_an_unaligned_cached_count_rounds_up_to_a_block_short_of_the_prompt() -> None:
    assert replay_plan.shared_prefix_tokens(0, 100) == 0
    assert replay_plan.shared_prefix_tokens(100, 1000) == 112
    assert replay_plan.shared_prefix_tokens(128, 1000) == 128
    assert replay_plan.shared_prefix_tokens(999, 1000) == 999
    assert replay_plan.shared_prefix_tokens(1000, 1000) == 999
