"""Usage by LoRA adapter, on the real engine: the real vLLM CPU engine serving the tiny model and a LoRA adapter of it
(build_lora.py, `--enable-lora --lora-modules tiny-lora=PATH`), the real LiteLLM proxy in front with one model group
per model (the base's, the adapter's), watched as the README attaches one. `stepline usage --by adapter` must count
exactly the requests and tokens sent to each (as the responses' usage says), and the groups' GPU-seconds with the
unattributed line must be the engine's busy time.

What happened on vLLM 0.32.0's CPU build: it serves the adapter (vllm/platforms/cpu.py:607, the Punica wrapper
vllm/lora/punica_wrapper/punica_cpu.py; cpu.py:379, LoRA turns torch.compile off), and the
adapter changes what the engine computes (its log-probabilities differ from the base's). The engine itself never
says which adapter a request used: the finished request its stat loggers get (vllm/v1/metrics/stats.py:288,
FinishedRequestStats) and its `llm_request` span (vllm/v1/engine/output_processor.py:877, do_tracing) carry no
model and no LoRA name, though the request's state has it (output_processor.py:166, RequestState.lora_name); only
per-step counts of running and waiting requests per adapter reach them (stats.py:250-251, SchedulerStats, the gauge
vllm:lora_requests_info). So the adapter comes from the gateway's decision (the model it asked the engine for), and
a request sent straight to the engine has no adapter (`(none)`): this test checks that too, with the two requests
that compare the adapter's log-probabilities with the base's.

Skipped, saying the engine's own error, only where this CPU build refuses to serve LoRA; otherwise the same skip
rule as test_real_vllm.py, for the gateway's environment too (.ci/run makes both).
"""

from __future__ import annotations

import json
import subprocess
import threading
import time
import urllib.error
import urllib.request
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from tests.gateway import proxy
from tests.realvllm import harness
from tests.realvllm.test_real_vllm_gateway import prose

ADAPTER = "tiny-lora"
RANK = 8  # build_lora.py's rank: --max-lora-rank must be at least it
LORA_ARGS = ("--enable-lora", "--lora-modules", f"{ADAPTER}=ADAPTER_PATH", "--max-lora-rank", str(RANK))
# Per model group: how many requests, of how many sentences, with how many tokens to generate. The prompts differ in
# size 4x, so that the join (by time and size: LiteLLM forwards no request id) tells them apart side by side.
SENT = {harness.SERVED_NAME: (6, 3, 32), ADAPTER: (4, 12, 16)}
PAUSE_S = 1.0  # between one group's requests: two of one size within 0.5 s are ambiguous (docs/usage.md)
# The proxy's routing hook: none. Each request goes to the model group it named (the size hook picks a lane).
CLIENT_MODEL = '''\
"""No routing: each request goes to the model group the client named."""

from litellm.integrations.custom_logger import CustomLogger

hook = CustomLogger()
'''
PROBE = "the engine step"  # sent straight to the engine, to the base and to the adapter
WARM_UP_GAP_S = 2.5  # from the warm-up to the window, which begins a second before the first request counted


@dataclass
class Sent:
    requests: int = 0
    prompt_tokens: int = 0
    generation_tokens: int = 0

    def add(self, usage: dict[str, Any]) -> None:
        self.requests += 1
        self.prompt_tokens += int(usage["prompt_tokens"])
        self.generation_tokens += int(usage["completion_tokens"])


@dataclass
class Run:
    sent: dict[str, Sent]  # through the proxy, by model group (= the model the engine was asked for)
    direct: Sent  # straight to the engine: the probe's two requests
    logprobs: dict[str, list[float]]  # the probe's, by model
    report: dict[str, Any] = field(default_factory=dict)  # `stepline usage --by adapter --format json`


def build_lora(setup: harness.Setup) -> Path:
    out = setup.work / "lora"
    subprocess.run([str(setup.venv / "bin" / "python"), str(harness.HERE / "build_lora.py"), str(setup.model),
                    str(out)], check=True, capture_output=True, timeout=300)
    return out


def refusal(text: str) -> str:
    """The engine's own error about LoRA in `text` (its log, or a response's body): its last line naming LoRA with an
    error; '' when there is none."""
    lines = [line.strip() for line in text.splitlines() if "lora" in line.lower()
             and any(word in line.lower() for word in ("error", "not support", "unsupported", "notimplemented"))]
    return lines[-1][:500] if lines else ""


def serve(stack: ExitStack, setup: harness.Setup, adapter: Path) -> None:
    """The engine with the adapter, serving until `stack` closes; a skip naming the engine's error where it refuses
    LoRA."""
    args = [arg.replace("ADAPTER_PATH", str(adapter)) for arg in LORA_ARGS]
    try:
        stack.enter_context(harness.engine(setup, args))
    except RuntimeError as exc:
        said = refusal((setup.work / "vllm.log").read_text(errors="replace")) or refusal(str(exc))
        if said:
            pytest.skip(f"vLLM {harness.VLLM_VERSION}'s CPU build does not serve LoRA: {said}")
        raise


def probe(setup: harness.Setup, model: str) -> dict[str, Any]:
    """One completion of PROBE straight to the engine, with each token's log-probability; a skip naming the engine's
    error where it refuses the adapter."""
    body = json.dumps({"model": model, "prompt": PROBE, "max_tokens": 2, "ignore_eos": True, "temperature": 0,
                       "logprobs": 1}).encode()
    request = urllib.request.Request(f"{setup.engine_url}/v1/completions", data=body,
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            return dict(json.loads(response.read()))
    except urllib.error.HTTPError as exc:
        text = exc.read().decode(errors="replace")
        if model == ADAPTER and refusal(text):
            pytest.skip(f"vLLM {harness.VLLM_VERSION}'s CPU build does not serve LoRA: {refusal(text)}")
        raise AssertionError(f"{model}: HTTP {exc.code}: {text[:2000]}") from exc


def _send(url: str, model: str, sent: dict[str, Sent], lock: threading.Lock) -> None:
    n, sentences, tokens = SENT[model]
    for i in range(n):
        response = proxy.complete(url, prose(f"{model} {i}", sentences), model=model, max_tokens=tokens,
                                  ignore_eos=True)
        assert response["model"].rpartition("/")[2] == model, response["model"]
        with lock:
            sent.setdefault(model, Sent()).add(response["usage"])
        time.sleep(PAUSE_S)


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Run:
    setup = harness.setup_or_skip(tmp_path_factory, "realvllm-lora")
    proxy.ready_or_skip()  # the callback under test is this checkout's
    adapter = build_lora(setup)
    hook = setup.work / "client_model.py"
    hook.write_text(CLIENT_MODEL)
    (setup.work / "proxy").mkdir()
    lock = threading.Lock()
    result = Run({}, Sent(), {})
    with ExitStack() as stack:
        stack.enter_context(harness.collector(setup))
        serve(stack, setup, adapter)
        # The engine's first steps after start take seconds on the CPU build (3.9 s for a 3-token prompt here), and
        # are no part of what this test counts: a warm-up before the window, the probe's first run.
        for model in (harness.SERVED_NAME, ADAPTER):
            probe(setup, model)
        time.sleep(WARM_UP_GAP_S)
        start = time.time()
        for model in (harness.SERVED_NAME, ADAPTER):
            response = probe(setup, model)
            result.direct.add(response["usage"])
            result.logprobs[model] = [float(p) for p in response["choices"][0]["logprobs"]["token_logprobs"]]
        lanes = {model: f"{setup.engine_url}/v1" for model in SENT}
        with proxy.litellm_proxy(setup.work / "proxy", lanes, {m: m for m in SENT}, setup.otlp_url, 10**9, "edge",
                                 hook=hook) as url:
            # The base and the adapter side by side: their requests share steps, and each step is split.
            groups = [threading.Thread(target=_send, args=(url, model, result.sent, lock)) for model in SENT]
            for t in groups:
                t.start()
            for t in groups:
                t.join()
            time.sleep(3)  # the callback's and the engine's reports reach the collector
        end = time.time() + 1
    out = harness.stepline(setup, "usage", "--store", setup.store, "--by", "adapter", "--format", "json",
                           "--from", f"{start - 1:.3f}", "--to", f"{end:.3f}")
    assert out.returncode == 0, out.stderr[-2000:]
    result.report = json.loads(out.stdout)
    print(f"\nsent {result.sent}, direct {result.direct}, logprobs {result.logprobs}\n"
          f"{json.dumps(result.report, indent=1)}")
    return result


def test_the_cpu_engine_applies_the_adapter(run: Run) -> None:
    base, adapted = run.logprobs[harness.SERVED_NAME], run.logprobs[ADAPTER]
    assert len(base) == len(adapted) == 2
    assert base != adapted  # the same prompt, greedy: only the adapter's weights can move them


def test_usage_by_adapter_counts_exactly_what_each_model_was_sent(run: Run) -> None:
    rows = {row["adapter"]: row for row in run.report["rows"]}
    assert set(rows) == {harness.SERVED_NAME, ADAPTER, "(none)", "(idle)", "(unattributed)"}, rows
    for model, s in run.sent.items():
        got = rows[model]
        assert (got["requests"], got["prompt_tokens"], got["generation_tokens"]) == (
            s.requests, s.prompt_tokens, s.generation_tokens), (model, got, s)
        assert s.requests == SENT[model][0]
        assert got["gpu_seconds"] > 0
    # Sent straight to the engine: vLLM names no adapter in what it reports of a request (the docstring says where).
    none = rows["(none)"]
    assert (none["requests"], none["prompt_tokens"], none["generation_tokens"]) == (
        run.direct.requests, run.direct.prompt_tokens, run.direct.generation_tokens), none


def test_the_adapters_gpu_seconds_are_the_engines_busy_time(run: Run) -> None:
    rows = {row["adapter"]: row for row in run.report["rows"]}
    [engine] = run.report["engines"]
    assert engine["gpus"] == 0  # a CPU engine: one "GPU" per rank, and no energy
    busy_s = engine["busy_us"] / 1e6
    groups = sum(rows[name]["gpu_seconds"] for name in (harness.SERVED_NAME, ADAPTER, "(none)"))
    # Each figure is rounded to the millisecond in the report.
    assert groups + rows["(unattributed)"]["gpu_seconds"] == pytest.approx(busy_s, abs=0.005)
    assert rows["(idle)"]["gpu_seconds"] == pytest.approx(engine["idle_us"] / 1e6, abs=0.001)
    # Little of the busy time can be nobody's. Before the steps' TTFT samples placed each request's first token
    # (stepline.analysis.usage._first_token), 8.8%, 9.9% and 15.8% of it was in three runs: a request's first-token
    # moment (arrival plus the plugin's ttft, e2e less decode, which mixes the front-end's clock with the engine
    # core's) fell 3.5 ms before the end of the step that computed its prompt, that step counted as its decode, and
    # the step that computed another request's prompt went to nobody. Since: 0.0% of 1.2 s.
    assert rows["(unattributed)"]["gpu_seconds"] <= 0.1 * busy_s, rows


def test_the_skip_names_the_engines_own_refusal() -> None:
    # How vLLM 0.32 refuses LoRA for a model without it (vllm/v1/worker/lora_model_runner_mixin.py:48), as its log
    # prints it; an engine that fails for another reason is a failure, not a skip.
    log = ("(EngineCore pid=7) INFO 12-06 14:43:10 [cpu_model_runner.py:68] Starting to load model /m...\n"
           "(EngineCore pid=7) ValueError: LlamaForCausalLM does not support LoRA yet.\n")
    assert refusal(log) == "(EngineCore pid=7) ValueError: LlamaForCausalLM does not support LoRA yet."
    assert refusal("(EngineCore pid=7) RuntimeError: out of memory\n(APIServer pid=6) Loaded new LoRA adapter") == ""
