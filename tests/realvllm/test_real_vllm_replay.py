"""`stepline replay` and `stepline matrix --sweep --launch --replay` against real vLLM engines (the CPU build).

A small load is recorded through the collector (short streams, and one prompt sent twice so that its second
run is a prefix-cache hit), on the engine test_real_vllm.py checks (tests/realvllm/conftest.py: one engine's life
runs both files' loads); `stepline replay` then sends the recorded window to the same engine (its prompts are
token ids the recording never sent, so nothing it sends was cached before), and the sweep replays it against
freshly launched engines, RUNS times on each at the recorded pace, after whatif priced each value: vLLM's own
counters must show the recorded prompt and generation tokens and prefix-cache hits on every run, and each
figure's mean over the runs stands beside whatif's interval. Three engine starts in all, for both files. The
same skip rule as test_real_vllm.py: skipped without the vLLM environment, failed without it in CI (CI=true).
"""

from __future__ import annotations

import json
import re
import shlex
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.realvllm import harness


@dataclass
class Recording:
    setup: harness.Setup
    window: tuple[str, ...]  # --from T --to T
    vocab: str  # --vocab: the tiny model's vocabulary is smaller than the default 1000 ids
    requests: int
    prompt_tokens: int
    generation_tokens: int
    cached_tokens: int
    replay: dict[str, object]  # `stepline replay --json`'s report, sent to the recording engine
    replayed: dict[str, float]  # vLLM's counters' increase over that replay


@pytest.fixture(scope="module")
def recording(life: harness.Life) -> Recording:
    setup, (start, end) = life.setup, life.recorded
    assert life.replay.returncode == 0, life.replay.stderr[-2000:]
    count, prompt_tokens, generation, cached = map(int, harness.one(setup, (
        "SELECT count(), sum(prompt_tokens), sum(generation_tokens), sum(cached_tokens) FROM requests FINAL "
        f"WHERE arrival_ts >= fromUnixTimestamp64Milli({round((start - 1) * 1e3)}) "
        f"AND arrival_ts <= fromUnixTimestamp64Milli({round((end + 1) * 1e3)})")))
    counted = life.recording
    assert (count, prompt_tokens, generation) == (counted["vllm:request_success_total"],
                                                  counted["vllm:prompt_tokens_total"],
                                                  counted["vllm:generation_tokens_total"])
    assert count == 8 and cached > 0
    return Recording(setup, harness.window(start, end), str(harness.vocab(setup)), count, prompt_tokens, generation,
                     cached, json.loads(life.replay.stdout), life.replayed)


def test_replay_makes_the_engine_count_the_recorded_tokens_and_hits(recording: Recording) -> None:
    report = recording.replay
    metrics = recording.replayed
    print(f"\n{json.dumps(report, indent=1)}")
    assert (report["sent"], report["completed"], report["failed"]) == (recording.requests,) * 2 + (0,)
    assert report["prompt_tokens_sent"] == report["prompt_tokens_received"] == recording.prompt_tokens
    assert report["generation_tokens_received"] == recording.generation_tokens
    warmup = report["warmup_prompt_tokens"]
    assert isinstance(warmup, int) and warmup > 0
    # vLLM's own counters: the recording's tokens, plus the one warm-up request (one output token).
    assert metrics["vllm:prompt_tokens_total"] == recording.prompt_tokens + warmup
    assert metrics["vllm:generation_tokens_total"] == recording.generation_tokens + 1
    assert metrics["vllm:request_success_total"] == recording.requests + 1
    hits = metrics["vllm:prefix_cache_hits_total"]
    assert hits == recording.cached_tokens > 0, (hits, recording.cached_tokens)  # the recorded hits, no others


RUNS = 4  # --repeat: replays of the window on each launched engine (each about a second here)


def test_a_sweep_launches_an_engine_per_value_and_replays_the_window_on_each(recording: Recording) -> None:
    """Each value's engine replays the window RUNS times, at the recorded pace; whatif priced each value first, and
    its intervals are set beside the runs' means."""
    setup = recording.setup
    command = shlex.join(harness.engine_command(setup, budget="{max_num_batched_tokens}", collected=False))
    out = harness.stepline(setup, "matrix", "--engine", setup.engine_url, "--sweep", "max_num_batched_tokens=512,2048",
                           "--launch", command, "--launch-timeout", "240", "--replay", *recording.window,
                           "--vocab", recording.vocab, "--speed", "1", "--repeat", str(RUNS), "--whatif",
                           "--store", setup.store, timeout_s=600, env=harness.engine_env(setup))
    print(f"\n{out.stdout}")
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    # whatif's prices come before the first launch.
    assert out.stdout.index("whatif, before the launches") < out.stdout.index("launching")
    logs = re.findall(r"max_num_batched_tokens=(\d+): the engine stopped \(exit code -?\d+\); its log: (\S+)",
                      out.stdout)
    assert [value for value, _ in logs] == ["512", "2048"]
    for value, log in logs:
        text = Path(log).read_text(errors="replace")
        assert f"'max_num_batched_tokens': {value}" in text  # vLLM's "non-default args" line: it took the value
    table = out.stdout[out.stdout.index("sweep of max_num_batched_tokens"):]
    for value in ("512", "2048"):
        for k in range(1, RUNS + 1):
            assert re.search(rf"^{value} #{k} ", table, re.M), table
    rows = harness.query(setup, (
        "SELECT attributes['sweep'], attributes['run'], attributes['completed'], attributes['prompt_tokens_sent'], "
        "attributes['warmup_prompt_tokens'], attributes['engine_prompt_tokens'], "
        "attributes['generation_tokens_received'], attributes['engine_generation_tokens'], "
        "attributes['engine_prefix_cache_hits'], attributes['ttft_p99_s'] FROM events WHERE kind = 'replay_run' "
        "ORDER BY ts"))
    assert [(r[0], r[1]) for r in rows] == [(f"max_num_batched_tokens={v}", f"{k}/{RUNS}") for v in ("512", "2048")
                                            for k in range(1, RUNS + 1)]
    for _, _, completed, sent, warmup, engine_prompt, received, engine_generated, hits, _ in rows:
        # vLLM's own counters, read around each run: what it sent, its warm-up, and exactly the recorded hits (each
        # run warms a shared prefix of its own, so none hits what the run before left in the cache).
        assert int(completed) == recording.requests
        assert int(sent) == recording.prompt_tokens and int(engine_prompt) == int(sent) + int(warmup)
        assert int(received) == recording.generation_tokens and int(engine_generated) == int(received) + 1
        assert int(hits) == recording.cached_tokens
    # whatif's interval beside the runs' mean for each value and figure; TTFT p99's mean is the runs' own.
    check = out.stdout[out.stdout.index("whatif against the runs"):]
    for value in ("512", "2048"):
        ttft_p99 = [float(r[9]) * 1e3 for r in rows if r[0] == f"max_num_batched_tokens={value}"]
        line = next(x for x in check.splitlines() if x.startswith(value) and "TTFT p99" in x)
        shown = re.findall(r"([\d.]+) \[[\d.]+-[\d.]+\]", line)  # whatif's, then the runs' mean [interval]
        assert len(shown) == 2 and abs(float(shown[1]) - sum(ttft_p99) / RUNS) <= 0.051, (line, ttft_p99)
        assert sum(1 for x in check.splitlines() if re.match(rf"{value}\s+(TTFT|ITL|goodput)", x)) == 4
    summary = re.search(r"^(\d+) of 8 runs' means inside whatif's intervals; (\d+) more overlap them; (\d+) apart$",
                        check, re.M)
    assert summary is not None, check
    # The recording ran at 1024, which the sweep leaves out: the check says what running it again would show.
    assert f"no value is the recorded setting (max_num_batched_tokens={harness.BUDGET_TOKENS})" in check, check
