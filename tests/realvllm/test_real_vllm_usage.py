"""Who used the GPUs, on the real engine: the real LiteLLM proxy with two virtual keys of two teams
(tests/gateway/team_auth.py) in front of the real vLLM engine (its CPU build), watched as the README attaches one.
`stepline usage --by team` must count exactly the requests and tokens each team sent (as the responses' usage says),
and the teams' GPU-seconds with the unattributed line must be the engine's busy time: every step's time is on one
line, none spread over the idle.

The same skip rule as test_real_vllm.py, for the gateway's environment too (.ci/run makes both).
"""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.gateway import proxy
from tests.gateway.team_auth import KEYS
from tests.realvllm import harness
from tests.realvllm.test_real_vllm_gateway import prose

TEAM_AUTH = Path(proxy.__file__).with_name("team_auth.py")
# Per key: how many requests, of how many sentences, with how many tokens to generate (unequal on purpose). The
# teams' prompts differ in size 3-4x, so that the join tells them apart by size while they run side by side.
SENT = {"sk-alpha-1": (6, 3, 24), "sk-beta-1": (3, 12, 8)}
# Between one team's requests: LiteLLM forwards no request id, so each decision is joined to its engine request by
# time and size (queries/gateway.py), and two of one size that arrive within 0.5 s of each other are refused as
# ambiguous (docs/usage.md says so); each team sends one at a time, a second apart.
PAUSE_S = 1.0


@dataclass
class Sent:
    requests: int = 0
    prompt_tokens: int = 0
    generation_tokens: int = 0


def _team_of(key: str) -> str:
    return KEYS[key][2]


def _send(url: str, key: str, sent: dict[str, Sent], lock: threading.Lock) -> None:
    n, sentences, tokens = SENT[key]
    for i in range(n):
        response = proxy.complete(url, prose(f"{_team_of(key)} {i}", sentences), key=key, max_tokens=tokens,
                                  ignore_eos=True)
        with lock:
            team = sent.setdefault(_team_of(key), Sent())
            team.requests += 1
            team.prompt_tokens += int(response["usage"]["prompt_tokens"])
            team.generation_tokens += int(response["usage"]["completion_tokens"])
        time.sleep(PAUSE_S)


@pytest.fixture(scope="module")
def usage(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Sent], dict[str, Any]]:
    setup = harness.setup_or_skip(tmp_path_factory, "realvllm-usage")
    proxy.ready_or_skip()  # the callback under test is this checkout's
    sent: dict[str, Sent] = {}
    lock = threading.Lock()
    (setup.work / "proxy").mkdir()
    with harness.collector(setup), harness.engine(setup):
        start = time.time()
        with proxy.litellm_proxy(setup.work / "proxy", {"fast": f"{setup.engine_url}/v1"}, harness.SERVED_NAME,
                                 setup.otlp_url, 10**9, "edge", auth=TEAM_AUTH) as url:
            # The two teams side by side: their requests share steps, and each step is split between them.
            teams = [threading.Thread(target=_send, args=(url, key, sent, lock)) for key in SENT]
            for t in teams:
                t.start()
            for t in teams:
                t.join()
            time.sleep(3)  # the callback's and the engine's reports reach the collector
        end = time.time() + 1
    out = harness.stepline(setup, "usage", "--store", setup.store, "--by", "team", "--format", "json",
                           "--from", f"{start - 1:.3f}", "--to", f"{end:.3f}")
    assert out.returncode == 0, out.stderr[-2000:]
    report = json.loads(out.stdout)
    print(f"\nsent {sent}\n{json.dumps(report, indent=1)}")
    return sent, report


def test_usage_by_team_counts_exactly_what_each_team_sent(usage: tuple[dict[str, Sent], dict[str, Any]]) -> None:
    sent, report = usage
    rows = {row["team"]: row for row in report["rows"]}
    assert set(rows) == {"alpha", "beta", "(idle)", "(unattributed)"}, rows
    for team, s in sent.items():
        got = rows[team]
        assert (got["requests"], got["prompt_tokens"], got["generation_tokens"]) == (
            s.requests, s.prompt_tokens, s.generation_tokens), (team, got, s)
        assert got["gpu_seconds"] > 0


def test_the_teams_gpu_seconds_are_the_engines_busy_time(usage: tuple[dict[str, Sent], dict[str, Any]]) -> None:
    _, report = usage
    rows = {row["team"]: row for row in report["rows"]}
    [engine] = report["engines"]
    assert engine["gpus"] == 0  # a CPU engine: one "GPU" per rank, and no energy
    busy_s = engine["busy_us"] / 1e6
    teams = rows["alpha"]["gpu_seconds"] + rows["beta"]["gpu_seconds"]
    # Each figure is rounded to the millisecond in the report.
    assert teams + rows["(unattributed)"]["gpu_seconds"] == pytest.approx(busy_s, abs=0.005)
    assert rows["(idle)"]["gpu_seconds"] == pytest.approx(engine["idle_us"] / 1e6, abs=0.001)
    # Every request was reported: little of the busy time can be nobody's (a warm-up step, a step at the edge).
    assert rows["(unattributed)"]["gpu_seconds"] <= 0.1 * busy_s, rows
