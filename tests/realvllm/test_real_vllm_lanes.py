"""Two real vLLM engines (the CPU build) as a size router's two lanes, named as the README's attach section names
engines (`--engine heavy=URL --engine fast=URL`), behind the real LiteLLM proxy running a home-made router with the
incident's three bugs (tests/gateway/seed_router.py): a bar in characters set from a token estimate, a catch-all
that fails open, heavy-lane slots that leak on a client's disconnect. The same engines serve two runs, one collector
each: the router annotated (it says what it measured, as docs/gateway.md asks), then the same router silent, its bar
declared to the collector instead (`--lane-bar heavy=TOKENS`). In each, every failure the test causes must be the
`stepline diagnose` finding that names it, with counts that match what the test sent.

What each run sends, in order: prose over the bar (the heavy lane, served); heavy streams whose clients leave after
the first chunk (the router's heavy slots, all of them, leak); heavy prompts the leaked lane refuses (429) while its
engine holds nothing, over more than the finding's patience; ordinary prose and dense JSON (JSON measures under the
bar in characters and counts over it in the engine's tokens: lane_leak); prose over the bar sent to the legacy
completions API, which the router cannot read (KeyError('messages')) and lets go on to the fast lane. The fast
lane's traffic takes at least as long as everything before it, so that the silent router's baseline (the earlier
half of its decisions, diagnosis/gateway.py `_shifts`) is the heavy lane's own routing and its refusals, and the
legacy prompts fall in the later half.
The same skip rule as test_real_vllm.py, for the gateway's environment too (.ci/run makes both).
"""

from __future__ import annotations

import json
import math
import statistics
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import pytest

from stepline.diagnosis.gateway import MIN_FAILED_OPEN, MIN_REFUSED, REFUSAL_PATIENCE_S
from stepline.testing.alertstack import free_port
from tests.gateway import proxy
from tests.realvllm import harness
from tests.realvllm.test_real_vllm_gateway import counters, dense_json, prose, tokenize

SEED_ROUTER = Path(proxy.__file__).with_name("seed_router.py")
HEAVY_SLOTS = 2  # the router's heavy lane: both leak
HEAVY = 3  # prose over the bar, served by the heavy lane before anything leaks
DROPPED = HEAVY_SLOTS  # heavy streams whose clients leave after the first chunk
REFUSED = 6  # heavy prompts the leaked lane refuses, paced over more than REFUSAL_PATIENCE_S
PROSE = 6  # ordinary prose under the bar
DENSE = 3  # dense JSON under the bar in characters, over it in tokens
LEGACY = 3  # prose over the bar through the completions API: the router fails open on each
PAUSE_S = 1.0  # between one request and the next
STREAM_TOKENS = 1000  # a dropped stream runs this long if the engine is not told: long past the client's leaving
BAR_MARGIN_CHARS = 40  # the router's bar is this far over the largest dense prompt: "just under"
# The tiny model has no chat template of its own; vLLM's chat API takes one from a file (--chat-template).
CHAT_TEMPLATE = "{% for message in messages %}{{ message['content'] }}\n{% endfor %}"
assert DROPPED >= 1 and REFUSED >= MIN_REFUSED and LEGACY >= MIN_FAILED_OPEN


@dataclass
class Lanes:
    """The two engines and what the test measured of its prompts."""

    fast: harness.Setup
    heavy: harness.Setup
    bar_chars: int  # the router's bar, in characters
    bar_tokens: int  # the operator's bar in tokens, which the router's characters were estimated from
    dense: list[str]


@dataclass
class Variant:
    """One run of the router (`annotated` or `plain`): what went through it and what stepline made of it."""

    bar_chars: int  # the router's bar
    sent: dict[str, int]  # per kind, how many
    statuses: dict[str, list[int]]  # per kind, the proxy's answers
    window: tuple[float, float]
    decisions: list[list[str]]
    findings: list[dict[str, Any]]

    def found(self, kind: str) -> list[dict[str, Any]]:
        return [f for f in self.findings if f["kind"] == kind]


def _over(tag: str, chars: int) -> str:
    """Prose of at least `chars` characters."""
    sentences = 1
    while len(text := prose(tag, sentences)) < chars:
        sentences += 1
    return text


def _held(setup: harness.Setup) -> float:
    series = counters(setup)
    return sum(v for k, v in series.items()
               if k.split("{", 1)[0] in ("vllm:num_requests_running", "vllm:num_requests_waiting"))


def _until_idle(setup: harness.Setup, timeout_s: float = 90) -> None:
    """Until the engine holds no request (it aborted the dropped streams, or ran them out)."""
    deadline = time.monotonic() + timeout_s
    while _held(setup) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not _held(setup), "the engine still holds requests"


def _drive(url: str, lanes: Lanes) -> tuple[dict[str, int], dict[str, list[int]]]:
    statuses: dict[str, list[int]] = {}

    def send(kind: str, prompt: str, chat: bool = True) -> None:
        statuses.setdefault(kind, []).append(proxy.send(url, prompt, chat=chat)[0])
        time.sleep(PAUSE_S)

    began = time.monotonic()
    for i in range(HEAVY):
        send("heavy", _over(f"heavy {i}", int(lanes.bar_chars * 1.1)))
    for i in range(DROPPED):
        proxy.leave_mid_stream(url, _over(f"dropped {i}", int(lanes.bar_chars * 1.1)), STREAM_TOKENS, chunks=1,
                               chat=True, ignore_eos=True)
        time.sleep(PAUSE_S)
    _until_idle(lanes.heavy)
    pace = REFUSAL_PATIENCE_S * 1.3 / (REFUSED - 1)
    for i in range(REFUSED):
        statuses.setdefault("refused", []).append(
            proxy.send(url, _over(f"refused {i}", int(lanes.bar_chars * 1.1)), chat=True)[0])
        time.sleep(pace)
    # The fast lane's traffic, prose with the dense JSON among it, over at least as long as all of the above.
    fast = [("prose", prose(f"note {i}", 4 + i % 3)) for i in range(PROSE)]
    fast[1:1] = [("dense", d) for d in lanes.dense]
    spacing = max(PAUSE_S, (time.monotonic() - began + 2) / len(fast))
    for kind, prompt in fast:
        statuses.setdefault(kind, []).append(proxy.send(url, prompt, chat=True)[0])
        time.sleep(spacing)
    for i in range(LEGACY):
        send("legacy", _over(f"legacy {i}", int(lanes.bar_chars * 1.3)), chat=False)
    sent = {kind: len(s) for kind, s in statuses.items()} | {"dropped": DROPPED}
    return sent, statuses


def _run(lanes: Lanes, work: Path, annotated: bool) -> Variant:
    gateway = "annotated" if annotated else "plain"
    declared = () if annotated else ("--lane-bar", f"heavy={lanes.bar_tokens}")
    backends = {"fast": f"{lanes.fast.engine_url}/v1", "heavy": f"{lanes.heavy.engine_url}/v1"}
    hook_env = {"SEED_ROUTER_BAR_CHARS": str(lanes.bar_chars), "SEED_ROUTER_HEAVY_SLOTS": str(HEAVY_SLOTS),
                "SEED_ROUTER_ANNOTATE": "1" if annotated else "0"}
    (work / gateway).mkdir()
    with harness.collector(lanes.fast, *declared, engines=(lanes.heavy, lanes.fast)):
        time.sleep(6)  # the plugins reconnect to the new collector (their outbox retries every 5 s)
        start = time.time()
        with proxy.litellm_proxy(work / gateway, backends, harness.SERVED_NAME, lanes.fast.otlp_url,
                                 lanes.bar_chars, gateway, hook=SEED_ROUTER, hook_env=hook_env) as url:
            sent, statuses = _drive(url, lanes)
            time.sleep(3)  # the callback's and the engines' reports reach the collector
        end = time.time()
    diagnose = harness.stepline(lanes.fast, "diagnose", "--store", lanes.fast.store, "--from", f"{start:.3f}",
                                "--to", f"{end:.3f}", "--json")
    assert diagnose.stdout.strip(), diagnose.stderr[-2000:]
    decisions = harness.query(lanes.fast, (
        "SELECT lane, engine, status, client_disconnected, swallowed_exception, size_chars, ifNull(threshold, -1) "
        f"FROM gateway_decisions WHERE gateway = '{gateway}' ORDER BY ts"))
    variant = Variant(lanes.bar_chars, sent, statuses, (start, end), decisions, json.loads(diagnose.stdout))
    shown = [{k: f[k] for k in ("kind", "severity", "title", "evidence")} for f in variant.findings
             if f["kind"] in ("lane_leak", "gateway_fail_open", "gateway_slot_leak")]
    print(f"\n{gateway}: sent {sent}; statuses {statuses}\n{json.dumps(shown, indent=1)}")
    return variant


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Variant]:
    setup = harness.setup_or_skip(tmp_path_factory, "realvllm-lanes")
    proxy.ready_or_skip()  # the callback under test is this checkout's
    fast = replace(setup, engine_name="fast")
    heavy = replace(setup, engine_name="heavy", engine_port=free_port())
    template = setup.work / "chat.jinja"
    template.write_text(CHAT_TEMPLATE)
    args = ("--chat-template", str(template))
    with harness.engine(fast, args, log_name="vllm-fast.log"), \
            harness.engine(heavy, args, log_name="vllm-heavy.log"):
        prose_cpt = statistics.median(len(p) / tokenize(fast, p) for p in (prose(f"measure {i}", 5)
                                                                           for i in range(3)))
        dense = [dense_json(seed) for seed in range(DENSE)]
        measured = [(len(d), tokenize(fast, d)) for d in dense]
        bar_chars = max(chars for chars, _ in measured) + BAR_MARGIN_CHARS
        bar_tokens = math.ceil(bar_chars / prose_cpt)  # the estimate the router's bar in characters came from
        # What makes each dense prompt a leak: well over the bar's tokens, though under its characters.
        assert min(tokens for _, tokens in measured) > 1.2 * bar_tokens, (measured, bar_tokens)
        lanes = Lanes(fast, heavy, bar_chars, bar_tokens, dense)
        print(f"\nbar {bar_chars} chars = {bar_tokens} tokens at {prose_cpt:.2f} chars/token; dense {measured}")
        return {"annotated": _run(lanes, setup.work, annotated=True),
                "plain": _run(lanes, setup.work, annotated=False)}


BOTH = pytest.mark.parametrize("variant", ["annotated", "plain"])


@BOTH
def test_every_request_is_one_decision_on_the_lane_the_router_chose_naming_its_engine(
        runs: dict[str, Variant], variant: str) -> None:
    run = runs[variant]
    assert run.statuses == {"heavy": [200] * HEAVY, "refused": [429] * REFUSED, "prose": [200] * PROSE,
                            "dense": [200] * DENSE, "legacy": [200] * LEGACY}, run.statuses
    assert len(run.decisions) == sum(run.sent.values()), run.decisions
    lane, engine, status, gone = 0, 1, 2, 3
    heavy = [d for d in run.decisions if d[lane] == "heavy"]
    assert len(heavy) == HEAVY + DROPPED + REFUSED
    # Served and dropped on the engine watched as `heavy`; refused before any deployment: no engine.
    assert sorted((d[engine], d[status], d[gone]) for d in heavy) == sorted(
        [("heavy", "200", "false")] * HEAVY + [("heavy", "499", "true")] * DROPPED + [("", "429", "false")] * REFUSED)
    assert {d[engine] for d in run.decisions if d[lane] == "fast"} == {"fast"}
    # A refusal is recorded at the size the request had, over the bar (the old record: the 21 characters of the
    # proxy's own message).
    assert all(int(d[5]) >= run.bar_chars for d in heavy if d[status] == "429"), heavy


@BOTH
def test_the_leaked_heavy_lane_refusing_while_its_engine_idles_is_a_critical_slot_leak(
        runs: dict[str, Variant], variant: str) -> None:
    [leak] = runs[variant].found("gateway_slot_leak")
    evidence = leak["evidence"]
    assert leak["severity"] == "critical" and leak["engine"] == "heavy", leak
    assert evidence["refused"] == REFUSED and evidence["statuses"] == [429], evidence
    assert evidence["engines_behind_lane"] == ["heavy"] and evidence["engine_busy_steps"] == 0
    assert evidence["client_disconnects_on_lane"] == DROPPED
    assert evidence["refusing_for_s"] >= REFUSAL_PATIENCE_S


def test_annotated_dense_json_under_the_char_bar_is_a_lane_leak_of_what_was_sent(runs: dict[str, Variant]) -> None:
    [leak] = runs["annotated"].found("lane_leak")
    evidence = leak["evidence"]
    assert evidence["leaked_requests"] == DENSE and evidence["lanes_leaked_onto"] == ["fast"], evidence
    assert evidence["threshold"] == f"{runs['annotated'].bar_chars} chars"
    # The legacy prompts the router failed open on carry no bar: counted, never judged against another's.
    assert evidence["joined_without_a_bar"] == LEGACY


def test_plain_router_with_a_declared_bar_leaks_the_dense_json_and_the_failed_open_prompts(
        runs: dict[str, Variant]) -> None:
    [leak] = runs["plain"].found("lane_leak")
    evidence = leak["evidence"]
    assert evidence["threshold_from"].startswith("declared by the operator"), evidence
    assert evidence["leaked_requests"] == DENSE + LEGACY and evidence["lanes_leaked_onto"] == ["fast"]
    assert list(evidence["declared_bars"]) == ["heavy"]


def test_annotated_swallowed_exceptions_are_a_fail_open_of_each(runs: dict[str, Variant]) -> None:
    [failed] = runs["annotated"].found("gateway_fail_open")
    evidence = failed["evidence"]
    assert failed["severity"] == "warning" and failed["engine"] == "fast", failed
    assert (evidence["failed_open"], evidence["swallowed_exceptions"]) == (LEGACY, LEGACY), evidence
    assert evidence["exceptions"] == ["KeyError: 'messages'"]
    assert evidence["lanes_they_went_to"] == {"fast": LEGACY}
    assert evidence["decisions"] == sum(runs["annotated"].sent.values())


def test_plain_router_failing_open_is_seen_from_its_routing_alone(runs: dict[str, Variant]) -> None:
    [failed] = runs["plain"].found("gateway_fail_open")
    evidence = failed["evidence"]
    assert failed["engine"] == "fast", failed
    assert (evidence["failed_open"], evidence["swallowed_exceptions"], evidence["routed_against_its_earlier_rule"]
            ) == (LEGACY, 0, LEGACY), evidence
    assert evidence["went_to_instead"] == {"fast": LEGACY}
