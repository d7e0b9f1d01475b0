"""The real LiteLLM proxy in front of the real vLLM engine (its CPU build): each gateway failure the test causes is the
matching `stepline diagnose` finding, with counts that match what the test sent.

Two lanes behind the test's own size hook (tests/gateway/proxy.py SIZE_LANES, a bar in characters): "fast", the real
engine, and "heavy", a simulated engine. The bar is set from the tiny model's tokenizer, measured through the engine's
/tokenize: just over the dense-JSON prompts' characters, while their tokens are well over the bar's worth of tokens at
the prose's characters per token (what lane_leak takes as the baseline). Through the proxy go ordinary prose, dense
JSON under the bar (lane_leak), prompts that make the hook raise (gateway_fail_open), prose over the bar (the heavy
lane) first, prose over the bar that makes the hook fail open without a word near the end (gateway_fail_open again:
the gateway's routing changed while the sizes did not), and last a stream whose client leaves after two chunks: vLLM
aborts it (no request row: the finding must be absent) or runs it on (orphaned_engine_work). LiteLLM forwards no
X-Request-Id, so every decision is joined to its engine request by time and size; the engine ids each response names
check the join. The requests are paced a second apart, so that no two fit a decision's time window equally well.
The same skip rule as test_real_vllm.py, for the gateway's environment too (tests/gateway/install.sh; .ci/run
makes both).
"""

from __future__ import annotations

import json
import statistics
import time
import urllib.request
from dataclasses import dataclass
from typing import Any

import pytest

from stepline.sim.config import EngineConfig
from stepline.sim.vllm_server import idle_workload, serve
from tests.gateway import proxy
from tests.realvllm import harness

GATEWAY = "lanes"
PAUSE_S = 1.0  # between one response and the next request: a decision's nearest arrival is its own by far
PROSE = 6  # ordinary prose under the bar: with the dense JSON, the joined pairs lane_leak takes its baseline from
DENSE = 3  # dense JSON under the bar in characters, over it in tokens
RAISED = 3  # prompts holding the hook's RAISE marker (gateway_fail_open counts from 3)
HEAVY = 2  # prose over the bar, to the simulated lane
SILENT = 3  # prose over the bar holding the hook's SILENT marker: failed open to the fast lane, nothing recorded
BAR_MARGIN_CHARS = 40  # the bar is this far over the largest dense prompt: "just under"
STREAM_TOKENS = 1000  # the stream the client leaves: long enough to run on well past the disconnect
# Prose of the tiny model's own corpus (tests/realvllm/build_model.py): ~4 characters per token, as English runs.
_SENTENCES = ("the engine is in the prefill step and the scheduler is at the next batch of the queue.",
              "each request is a prompt in the queue, and the cache is full of old blocks.",
              "a short answer is a stream of tokens from the model, one token at a time.",
              "the first chunk of a long prompt is one step of the budget, and the decode waits for it.")
_WORDS = ("engine", "step", "prefill", "decode", "token", "request", "queue", "cache", "block", "batch", "chunk",
          "latency", "throughput", "scheduler", "model", "layer", "attention", "kernel", "memory", "bandwidth")


def prose(tag: str, sentences: int) -> str:
    return f"{tag}: " + " ".join(_SENTENCES[(i * 3) % len(_SENTENCES)] for i in range(sentences))


def dense_json(seed: int, items: int = 66) -> str:
    """Records as a tool call returns them: short strings between keys, quotes and brackets (~3 characters per
    token with the tiny model's tokenizer, as JSON runs; ~1,000 tokens)."""
    return json.dumps([{"stream": " ".join(_WORDS[(i * k + 3 * k + seed) % len(_WORDS)] for k in range(1, 5))}
                       for i in range(items)])


def tokenize(setup: harness.Setup, text: str) -> int:
    """The prompt's tokens as the engine counts them (its /tokenize: no request)."""
    body = json.dumps({"model": harness.SERVED_NAME, "prompt": text}).encode()
    request = urllib.request.Request(f"{setup.engine_url}/tokenize", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=30) as response:
        return int(json.loads(response.read())["count"])


def counters(setup: harness.Setup) -> dict[str, float]:
    """vLLM's own series, by their full name and labels."""
    with urllib.request.urlopen(f"{setup.engine_url}/metrics", timeout=10) as response:
        lines = response.read().decode().splitlines()
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in lines
            if line.startswith("vllm:") and not line.startswith("#")}


def _sum(series: dict[str, float], name: str, label: str = "") -> float:
    return sum(v for k, v in series.items() if k.split("{", 1)[0] == name and label in k)


@dataclass
class Run:
    setup: harness.Setup
    threshold_chars: int
    prose_chars_per_token: float  # the prose's median, measured through /tokenize
    sent: dict[str, list[str]]  # per kind, the ids the responses named (vLLM's request: cmpl-<id>-0)
    dense: list[tuple[int, int]]  # each dense prompt's characters and its tokens (/tokenize)
    pairs: list[tuple[int, int]]  # characters and engine-counted tokens of each prose and dense prompt sent
    finished: float  # requests vLLM counted finished, over its life
    stream: dict[str, float]  # vLLM's counters' rise over the stream the client left
    decisions: list[list[str]]
    findings: list[dict[str, Any]]

    @property
    def stream_ran_on(self) -> bool:
        """vLLM counted the stream finished (it ran on for nobody), else it aborted it."""
        return self.stream["vllm:request_success_total"] > 0

    def found(self, kind: str) -> list[dict[str, Any]]:
        return [f for f in self.findings if f["kind"] == kind]


def _plan(threshold: int, dense: list[str]) -> list[tuple[str, str]]:
    """What goes through the proxy, in order, by kind: prose over the bar (the heavy lane: the earlier half's
    routing), prose with the dense JSON and the raises among it, then prose over the bar that the hook fails on
    silently (the later half's)."""
    plan = [("prose", prose(f"note {i}", 4 + i % 3)) for i in range(PROSE)]
    plan[1:1] = [("dense", d) for d in dense[:1]]
    plan[4:4] = [("raised", f"{proxy.RAISE} " + prose(f"raise {i}", 4)) for i in range(RAISED)]
    heavy = [("heavy", prose(f"heavy {i}", threshold // 80)) for i in range(HEAVY)]
    silent = [("silent", f"{proxy.SILENT} " + prose(f"silent {i}", threshold // 80)) for i in range(SILENT)]
    return heavy + plan + [("dense", d) for d in dense[1:]] + silent


def _leave_mid_stream(setup: harness.Setup, url: str) -> dict[str, float]:
    """The stream the client leaves after two chunks, and how vLLM's counters rose until the engine held nothing."""
    before = counters(setup)
    proxy.leave_mid_stream(url, prose("a stream", 4), STREAM_TOKENS, chunks=2, ignore_eos=True)
    deadline = time.monotonic() + 60
    while _sum(after := counters(setup), "vllm:num_requests_running") and time.monotonic() < deadline:
        time.sleep(0.5)
    rose = {name: _sum(after, name) - _sum(before, name)
            for name in ("vllm:request_success_total", "vllm:generation_tokens_total")}
    abort = 'finished_reason="abort"'
    rose["abort"] = _sum(after, "vllm:request_success_total", abort) - _sum(before, "vllm:request_success_total", abort)
    return rose


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Run:
    setup = harness.setup_or_skip(tmp_path_factory, "realvllm-gateway")
    proxy.ready_or_skip()  # the callback under test is this checkout's
    # The engine keeps the harness's name (`--engine NAME=URL`, as the README attaches one): the collector names the
    # decisions for LiteLLM's api_base (127.0.0.1:PORT/v1) after the engine it watches there, and they join.
    began = time.monotonic()
    heavy = serve(idle_workload(600), EngineConfig(model=harness.SERVED_NAME), port=0, speed=20.0)
    sent: dict[str, list[str]] = {k: [] for k in ("prose", "dense", "raised", "heavy", "silent")}
    pairs: list[tuple[int, int]] = []
    try:
        with harness.collector(setup), harness.engine(setup):
            prose_cpt = statistics.median(len(p) / tokenize(setup, p) for p in (prose(f"measure {i}", 5)
                                                                                 for i in range(3)))
            dense = [dense_json(seed) for seed in range(DENSE)]
            measured = [(len(d), tokenize(setup, d)) for d in dense]
            threshold = max(chars for chars, _ in measured) + BAR_MARGIN_CHARS
            # What makes each of them a leak: over the bar's worth of tokens at the prose's characters per token.
            assert min(tokens for _, tokens in measured) > 1.2 * threshold / prose_cpt, (measured, prose_cpt)
            (setup.work / "proxy").mkdir()
            lanes = {"fast": f"{setup.engine_url}/v1", "heavy": f"{heavy.url}/v1"}
            with proxy.litellm_proxy(setup.work / "proxy", lanes, harness.SERVED_NAME, setup.otlp_url, threshold,
                                     GATEWAY) as url:
                for kind, prompt in _plan(threshold, dense):
                    response = proxy.complete(url, prompt)
                    sent[kind].append(str(response["id"]) + "-0")
                    if kind in ("prose", "dense"):
                        pairs.append((len(prompt), int(response["usage"]["prompt_tokens"])))
                    time.sleep(PAUSE_S)
                stream = _leave_mid_stream(setup, url)
                time.sleep(3)  # the callback's and the engine's reports reach the collector
            finished = _sum(counters(setup), "vllm:request_success_total")
            time.sleep(1)
    finally:
        heavy.stop()
    wall_s = time.monotonic() - began
    diagnose = harness.stepline(setup, "diagnose", "--store", setup.store, "--since", "1h", "--json")
    assert diagnose.stdout.strip(), diagnose.stderr[-2000:]
    decisions = harness.query(setup, (
        "SELECT lane, engine, status, client_disconnected, swallowed_exception, size_chars, ifNull(threshold, -1) "
        "FROM gateway_decisions ORDER BY ts"))
    result = Run(setup, threshold, prose_cpt, sent, measured, pairs, finished, stream, decisions,
                 json.loads(diagnose.stdout))
    shown = [{k: f[k] for k in ("kind", "title", "evidence")} for f in result.findings if f["kind"] in _GATEWAY_KINDS]
    print(f"\nthreshold {threshold} chars; prose {prose_cpt:.2f} chars/token; dense {measured}; stream {stream}; "
          f"engine, collector and proxy up {wall_s:.0f} s\n{json.dumps(shown, indent=1)}")
    return result


_GATEWAY_KINDS = ("lane_leak", "gateway_fail_open", "gateway_slot_leak", "orphaned_engine_work")


def test_every_attempt_is_one_decision_on_the_lane_the_hook_chose(run: Run) -> None:
    sent = sum(len(ids) for ids in run.sent.values()) + 1  # the stream the client left
    assert len(run.decisions) == sent, run.decisions
    by_lane = {lane: sum(1 for d in run.decisions if d[0] == lane) for lane in ("fast", "heavy")}
    assert by_lane == {"fast": sent - len(run.sent["heavy"]), "heavy": len(run.sent["heavy"])}
    assert {d[1] for d in run.decisions if d[0] == "fast"} == {run.setup.engine_name}
    # vLLM finished what went to the fast lane, the stream only if it ran on.
    assert run.finished == len(run.sent["prose"] + run.sent["dense"] + run.sent["raised"] + run.sent["silent"]) + (
        run.stream_ran_on)
    raised = [d for d in run.decisions if d[4]]
    assert len(raised) == len(run.sent["raised"])
    assert all(d[4].replace("\\'", "'") == "KeyError: 'content'" and d[6] == "-1" for d in raised), raised


def test_the_client_that_left_mid_stream_is_a_499_and_what_vllm_did_is_the_finding(run: Run) -> None:
    [gone] = [d for d in run.decisions if d[3] == "true"]
    assert gone[0] == "fast" and gone[2] == "499", gone
    orphans = run.found("orphaned_engine_work")
    if run.stream_ran_on:  # the engine finished it for nobody
        assert run.stream["vllm:request_success_total"] == 1
        [orphan] = orphans
        assert orphan["evidence"]["orphaned_requests"] == 1, orphan
        assert orphan["evidence"]["tokens_generated"] == run.stream["vllm:generation_tokens_total"]
        assert orphan["evidence"]["joined_by_time_and_size"] == 1
    else:  # aborted: vLLM 0.32 reports no finished request for an abort (shared/DESIGN.md), so nothing ran on
        assert run.stream["vllm:generation_tokens_total"] < STREAM_TOKENS / 2, run.stream
        assert run.stream["abort"] == 0  # not even under finished_reason="abort"
        assert orphans == [], orphans


def test_dense_json_under_the_char_bar_is_a_lane_leak_of_exactly_what_was_sent(run: Run) -> None:
    [leak] = run.found("lane_leak")
    evidence = leak["evidence"]
    joined = len(run.pairs) + (1 if run.stream_ran_on else 0)
    assert evidence["leaked_requests"] == evidence["monsters"] == DENSE, evidence
    assert sorted(evidence["request_ids"]) == sorted(run.sent["dense"])  # the time-and-size join chose each right
    assert evidence["lanes_leaked_onto"] == ["fast"] and evidence["threshold"] == f"{run.threshold_chars} chars"
    assert (evidence["joined_requests"], evidence["joined_by_time_and_size"], evidence["joined_by_id"]) == (
        joined, joined, 0)
    # Unjoined: the heavy lane's requests (its simulator is not collected) and a stream vLLM aborted (no row).
    unjoined = len(run.sent["heavy"]) + (0 if run.stream_ran_on else 1)
    assert evidence["time_matches_refused"] == {"ambiguous": 0, "taken": 0, "unjoined": unjoined}
    typical = statistics.median_high(chars / tokens for chars, tokens in run.pairs)
    if not run.stream_ran_on:  # else the stream's prompt is one more pair of the median
        assert f"at the median {typical:.2f} chars/token of {joined} requests" in evidence["threshold_in_tokens"]
    assert abs(typical - run.prose_chars_per_token) < 0.5  # prose sets the baseline, not the dense JSON
    assert all(chars < run.threshold_chars and tokens > run.threshold_chars / typical for chars, tokens in run.dense)


def test_a_hook_that_raises_or_fails_silently_is_gateway_fail_open_counting_each(run: Run) -> None:
    [failed] = run.found("gateway_fail_open")
    evidence = failed["evidence"]
    assert (evidence["failed_open"], evidence["swallowed_exceptions"], evidence["unmeasured_decisions"],
            evidence["routed_against_its_measure"], evidence["routed_against_its_earlier_rule"]) == (
        RAISED + SILENT, RAISED, 0, 0, SILENT), evidence
    assert evidence["decisions"] == len(run.decisions)
    assert evidence["exceptions"] == ["KeyError: 'content'"]
    assert evidence["lanes_they_went_to"] == {"fast": RAISED + SILENT}
    # The silent ones are found from the routing alone: the earlier half sent everything this large heavy.
    assert evidence["went_to_instead"] == {"fast": SILENT}
    least_heavy = min(len(p) for kind, p in _plan(run.threshold_chars, []) if kind == "heavy")
    assert evidence["bar_as_routed"].startswith(f"{least_heavy:,} (the least size heavy took before "), evidence
    assert sorted(evidence["request_ids"]) == sorted(run.sent["raised"] + run.sent["silent"])
    assert evidence["joined_by_time_and_size"] == RAISED + SILENT


def test_no_slot_leak_is_found_where_the_gateway_reports_no_slots(run: Run) -> None:
    assert run.found("gateway_slot_leak") == []  # LiteLLM's decisions carry no in_flight, and no /metrics is scraped
