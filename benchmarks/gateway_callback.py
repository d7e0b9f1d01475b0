#!/usr/bin/env python3
"""What stepline's LiteLLM callback costs the proxy per request, against LiteLLM's own Prometheus callback.

The real LiteLLM proxy (its own environment, tests/gateway/install.sh; one worker, a master key, as deployed) runs
four ways in the same run, each a process of its own in front of the same backend (keep-alive 300 s):

    baseline    no callback
    noop        a CustomLogger that does nothing: what LiteLLM itself spends calling any callback
    prometheus  `callbacks: ["prometheus"]` (LiteLLM's integration; 1.108.7 asks no enterprise licence for it)
    stepline    `callbacks: ["stepline.gateway.litellm.proxy_handler"]`, from this working tree (collector/ first on
                the proxy's PYTHONPATH), posting OTLP/JSON to a real `stepline collect` (embedded chDB store)

The backend is a trivial OpenAI-compatible server (one fixed completion, asyncio, a process of its own), so what is
measured is the proxy's own work. The client (this process, asyncio, keep-alive connections) sends non-streaming
/v1/completions open loop at `--cost-rate` req/s to each of the four proxies at once, so that the shared machine's
noise falls on all four alike, in `--rounds` rounds. Two figures per request:

- end to end: the proxy's CPU (psutil, user + system of the process and its children, over the round / requests
  answered), less the baseline's in the same round (mean and standard error of the rounds); client latency p50/p99
  (write to last byte, rounds pooled). What the issue asks; on 2 shared cores its noise is a few hundred us.
- the callback's own code, timed inside the proxy by a probe (below): the CPU time of its CustomLogger methods per
  request (p50, p99), less the no-op's (the probe's own price), plus stepline's recorder thread (CPU clock of the
  thread / requests). Precise, but blind to what LiteLLM spends around a callback (the noop row end to end).

The ratio is stepline's cost over prometheus's; target <= 0.5x.

Then the rate run: a fresh stepline proxy at `--rate` req/s for `--seconds` s. Decisions the client had answered
against what the callback's DecisionRecorder counted inside the proxy (the probe writes its `stats()` twice a
second) against spans the collector's OTLP receiver accepted against rows in gateway_decisions after a clean stop.
lost = answered - stored; target 0. A request that finds all `--concurrency` connections busy when due is skipped
and counted: the rate was not sustained. Then the sustained rate (0.9x the answered rate, to 5 req/s) runs for
`--seconds` as well, and is printed as such. Everything listens on 127.0.0.1.

Prints figures; always exits 0 (2 when the proxy's environment is missing). Missed targets print "TARGET MISSED".
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil  # type: ignore[import-untyped]
from prometheus_client.parser import text_string_to_metric_families

from stepline.store.discovery import read_beside_store
from stepline.testing.alertstack import free_port

REPO = Path(__file__).resolve().parents[1]
VENV = Path(os.environ.get("STEPLINE_GATEWAY_VENV", Path.home() / ".cache" / "stepline" / "gateway"))
KEY = "sk-stepline-bench"
MODEL = "bench/model"
MODES: dict[str, list[str]] = {"baseline": [], "noop": ["noop_logger.handler"], "prometheus": ["prometheus"],
                               "stepline": ["stepline.gateway.litellm.proxy_handler"]}
# LiteLLM's own price for calling any callback: a CustomLogger that does nothing, loaded from the config directory.
NOOP = "from litellm.integrations.custom_logger import CustomLogger\n\nhandler = CustomLogger()\n"
# Longer than any idle gap of the client's pooled connections: uvicorn's 5 s default closes them under the client,
# and a request written as the close comes is reset (a gateway's own clients pool connections the same way).
KEEPALIVE_S = 300
PROMPT = "the quick brown fox jumps over the lazy dog " * 8
COMPLETION = json.dumps({"id": "cmpl-bench", "object": "text_completion", "created": 1_800_000_000, "model": MODEL,
                         "choices": [{"index": 0, "text": " ok ok ok ok", "finish_reason": "length",
                                      "logprobs": None}],
                         "usage": {"prompt_tokens": 72, "completion_tokens": 4, "total_tokens": 76}}).encode()
# The probe, the proxy's sitecustomize: no callback or endpoint of its own. Twice a second it writes the stepline
# recorder's stats() and its thread's CPU; once it finds a callback (stepline's, prometheus's, the no-op) it wraps
# that instance's CustomLogger methods (LiteLLM's interface to it; the class is untouched) to take the CPU time
# of their thread while they run (a coroutine's awaits excluded; a call made inside another timed call is not timed
# again), summed per request (litellm_call_id), written when the benchmark asks (the file `ask`).
PROBE = '''\
import functools, inspect, json, os, sys, threading, time, types

OUT = os.environ.get("STEPLINE_BENCH_PROBE", "")
local, lock = threading.local(), threading.Lock()
per_request, calls = {}, {}


def _key(args, kwargs):
    for value in (*args, *kwargs.values()):
        if isinstance(value, dict) and value.get("litellm_call_id"):
            return str(value["litellm_call_id"])
    return ""


def _add(name, key, ns):
    with lock:
        per_request[key] = per_request.get(key, 0) + ns
        calls[name] = calls.get(name, 0) + 1


def _step(run):
    local.depth = getattr(local, "depth", 0) + 1
    started = time.thread_time_ns()
    try:
        return run()
    finally:
        local.depth -= 1
        if local.depth == 0:
            local.spent = getattr(local, "spent", 0) + time.thread_time_ns() - started


@types.coroutine
def _stepped(coro, name, key):
    value, error, spent = None, None, 0
    try:
        while True:
            local.spent = 0
            try:
                future = _step(lambda: coro.send(value) if error is None else coro.throw(error))
            finally:
                spent += local.spent
            try:
                value, error = (yield future), None
            except BaseException as exc:
                value, error = None, exc
    except StopIteration as stop:
        return stop.value
    finally:
        if spent:
            _add(name, key, spent)


def _timed(name, method):
    if inspect.iscoroutinefunction(method):
        @functools.wraps(method)
        async def timed(*args, **kwargs):
            return await _stepped(method(*args, **kwargs), name, _key(args, kwargs))
    else:
        @functools.wraps(method)
        def timed(*args, **kwargs):
            local.spent = 0
            try:
                return _step(lambda: method(*args, **kwargs))
            finally:
                if local.spent:
                    _add(name, _key(args, kwargs), local.spent)
    return timed


def _callbacks():
    import litellm
    from litellm.integrations.custom_logger import CustomLogger
    found = {"stepline": getattr(sys.modules.get("stepline.gateway.litellm"), "proxy_handler", None)}
    for cb in [*litellm.callbacks, *litellm._async_success_callback, *litellm._async_failure_callback]:
        if type(cb).__name__ == "PrometheusLogger":
            found["prometheus"] = cb
        elif type(cb) is CustomLogger:  # the no-op, loaded from its file (not in sys.modules)
            found["noop"] = cb
    hooks = [n for n, f in vars(CustomLogger).items() if inspect.isfunction(f) and not n.startswith("__")
             and not inspect.isasyncgenfunction(f)]
    return {label: cb for label, cb in found.items() if cb is not None}, hooks


def _run():
    wrapped = set()
    while True:
        time.sleep(0.5)
        found, hooks = _callbacks() if "litellm.proxy.proxy_server" in sys.modules else ({}, [])
        for label, cb in found.items():
            if label not in wrapped:
                wrapped.add(label)
                for hook in hooks:
                    setattr(cb, hook, _timed(f"{label}.{hook}", getattr(cb, hook)))
        stats, step = {"wrapped": sorted(wrapped)}, found.get("stepline")
        if step is not None:
            thread = step.recorder._thread
            stats.update(step.recorder.stats(), callback_errors=step.errors,
                         thread_cpu_ns=time.clock_gettime_ns(time.pthread_getcpuclockid(thread.ident)))
        _write("stats.json", stats)
        if os.path.exists(os.path.join(OUT, "ask")):
            with lock:
                timings = {"per_request": dict(per_request), "calls": dict(calls)}
            _write("timings.json", timings)
            os.remove(os.path.join(OUT, "ask"))


def _write(name, value):
    path = os.path.join(OUT, name)
    with open(path + ".tmp", "w") as fh:
        json.dump(value, fh)
    os.replace(path + ".tmp", path)


if OUT:
    threading.Thread(target=_run, name="stepline-bench-probe", daemon=True).start()
'''


# -- the backend: one fixed completion, as fast as asyncio answers ---------------------------------------------


class _Backend(asyncio.Protocol):
    response = (b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n"
                % len(COMPLETION)) + COMPLETION

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport, self.buffer = transport, b""

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        while (head := self.buffer.find(b"\r\n\r\n")) >= 0:
            length = 0
            for line in self.buffer[:head].split(b"\r\n")[1:]:
                name, _, value = line.partition(b":")
                if name.strip().lower() == b"content-length":
                    length = int(value)
            if len(self.buffer) < head + 4 + length:
                return
            self.buffer = self.buffer[head + 4 + length:]
            self.transport.write(self.response)


def serve_backend(port: int) -> None:
    loop = asyncio.new_event_loop()
    loop.run_until_complete(loop.create_server(_Backend, "127.0.0.1", port))
    loop.run_forever()


# -- the processes ---------------------------------------------------------------------------------------------


def _wait(url: str, process: subprocess.Popen[bytes], log: Path, what: str, timeout_s: float = 180) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with urllib.request.urlopen(url, timeout=2):
                return
        except OSError as exc:
            if process.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"{what} did not start: {log.read_text()[-3000:]}") from exc
            time.sleep(0.5)


def _stop(process: subprocess.Popen[bytes]) -> int:
    process.send_signal(signal.SIGTERM)
    try:
        return process.wait(60)
    except subprocess.TimeoutExpired:
        process.kill()
        return process.wait()


class Proxy:
    """One LiteLLM proxy with the given callbacks, its log, config and the probe in a directory of its own."""

    def __init__(self, name: str, callbacks: list[str], work: Path, backend: str, otlp_url: str) -> None:
        self.name, self.dir = name, work / name
        self.dir.mkdir()
        config: dict[str, Any] = {"model_list": [{"model_name": "bench", "litellm_params": {
            "model": f"hosted_vllm/{MODEL}", "api_base": f"{backend}/v1", "api_key": "none"}}]}
        if callbacks:
            config["litellm_settings"] = {"callbacks": callbacks}
        (self.dir / "config.yaml").write_text(json.dumps(config))  # JSON is YAML
        (self.dir / "sitecustomize.py").write_text(PROBE)
        (self.dir / "noop_logger.py").write_text(NOOP)
        self.env = {**os.environ, "LITELLM_MASTER_KEY": KEY, "LITELLM_LOCAL_MODEL_COST_MAP": "true",
                    "STEPLINE_OTLP_URL": otlp_url, "STEPLINE_GATEWAY_NAME": f"bench-{name}",
                    "STEPLINE_BENCH_PROBE": str(self.dir),
                    "PYTHONPATH": os.pathsep.join([str(self.dir), str(REPO / "collector")])}
        self.log = self.dir / "proxy.log"
        self._launch()

    def _launch(self) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        with self.log.open("wb") as log:
            self.process = subprocess.Popen([str(VENV / "bin" / "litellm"), "--config", str(self.dir / "config.yaml"),
                                             "--host", "127.0.0.1", "--port", str(self.port),
                                             "--keepalive_timeout", str(KEEPALIVE_S)], env=self.env, stdout=log,
                                            stderr=subprocess.STDOUT, cwd=self.dir)
        self.ps = psutil.Process(self.process.pid)

    def ready(self, attempts: int = 3) -> None:
        """Until the proxy answers its liveness check. A proxy that exits while starting is started again on another
        port (at most `attempts` times): on a busy machine another process can take the port free_port() found
        before the proxy binds it, and the proxy then exits (code 3)."""
        for attempt in range(1, attempts + 1):
            try:
                _wait(f"{self.url}/health/liveliness", self.process, self.log, f"the LiteLLM proxy ({self.name})")
                return
            except SystemExit:
                if self.process.poll() is None or attempt == attempts:
                    raise
                self._launch()

    def cpu_s(self) -> float:
        total = 0.0
        for process in [self.ps, *self.ps.children(recursive=True)]:
            try:
                times = process.cpu_times()
            except psutil.Error:
                continue
            total += times.user + times.system
        return total

    def stats(self) -> dict[str, Any]:
        try:
            return dict(json.loads((self.dir / "stats.json").read_text()))
        except (OSError, ValueError):
            return {}

    def timings(self) -> Timings:
        """The probe's per-request times of the callback's own methods, so far."""
        (self.dir / "timings.json").unlink(missing_ok=True)
        (self.dir / "ask").touch()
        deadline = time.monotonic() + 10
        while (self.dir / "ask").exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        try:
            got = json.loads((self.dir / "timings.json").read_text())
        except (OSError, ValueError):
            return Timings({}, {})
        return Timings({k: int(v) for k, v in got["per_request"].items()}, dict(got["calls"]))

    def settle(self, answered: int, timeout_s: float = 60.0) -> dict[str, Any]:
        """The probe's counts once the recorder has every answered decision and nothing is pending."""
        deadline = time.monotonic() + timeout_s
        while True:
            s = self.stats()
            done = s.get("sent", 0) + s.get("dropped_unsent", 0)
            if (s.get("recorded", 0) + s.get("dropped_full", 0) >= answered and done >= s.get("recorded", 0)) \
                    or time.monotonic() > deadline:
                return s
            time.sleep(0.25)

    def metrics(self) -> str:
        request = urllib.request.Request(f"{self.url}/metrics/", headers={"Authorization": f"Bearer {KEY}"})
        with urllib.request.urlopen(request, timeout=10) as response:
            return str(response.read().decode())

    def stop(self) -> int:
        return _stop(self.process)


# -- the client --------------------------------------------------------------------------------------------------


@dataclass
class Load:
    """One open-loop run against one proxy."""

    rate: float
    offered: int
    ok: int = 0
    failed: int = 0  # answered, not 200
    errors: int = 0  # no answer (connection error, timeout)
    skipped: int = 0  # due while every connection was busy
    reconnects: int = 0  # connections the proxy had closed while idle, opened again before a request
    latencies_s: list[float] = field(default_factory=list)
    elapsed_s: float = 0.0
    cpu_s: float = 0.0
    first_failure: str = ""

    @property
    def answered(self) -> int:
        return self.ok + self.failed

    @property
    def sustained(self) -> bool:
        return self.skipped == 0 and self.errors == 0 and self.answered >= 0.97 * self.offered


async def _answer(reader: asyncio.StreamReader) -> tuple[int, bytes]:
    head = await reader.readuntil(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:] if line)}
    if headers.get("transfer-encoding", "").lower() == "chunked":
        body = b""
        while size := int((await reader.readuntil(b"\r\n")).strip(), 16):
            body += (await reader.readexactly(size + 2))[:-2]
        await reader.readuntil(b"\r\n")
    else:
        body = await reader.readexactly(int(headers.get("content-length", "0")))
    return int(lines[0].split()[1]), body


async def _drive(port: int, rate: float, seconds: float, concurrency: int) -> Load:
    body = json.dumps({"model": "bench", "prompt": PROMPT, "max_tokens": 4}).encode()
    request = (f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nAuthorization: Bearer {KEY}\r\n"
               f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n").encode() + body
    idle = [await asyncio.open_connection("127.0.0.1", port) for _ in range(concurrency)]
    load = Load(rate, round(rate * seconds))
    loop = asyncio.get_running_loop()

    async def one(conn: tuple[asyncio.StreamReader, asyncio.StreamWriter]) -> None:
        sent = loop.time()
        try:
            if conn[0].at_eof():  # the proxy closed it while idle
                conn[1].close()
                conn = await asyncio.open_connection("127.0.0.1", port)
                load.reconnects += 1
            conn[1].write(request)
            status, answer = await asyncio.wait_for(_answer(conn[0]), 30)
        except (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ValueError, TimeoutError) as exc:
            load.errors += 1
            load.first_failure = load.first_failure or f"{type(exc).__name__}: {exc}"
            conn[1].close()
            conn = await asyncio.open_connection("127.0.0.1", port)
        else:
            load.latencies_s.append(loop.time() - sent)
            if status == 200:
                load.ok += 1
            else:
                load.failed += 1
                load.first_failure = load.first_failure or f"HTTP {status}: {answer[:200]!r}"
        idle.append(conn)

    tasks = []
    start = loop.time() + 0.05
    for i in range(load.offered):
        delay = start + i / rate - loop.time()
        if delay > 0:
            await asyncio.sleep(delay)
        if not idle:
            load.skipped += 1
            continue
        tasks.append(asyncio.create_task(one(idle.pop())))
    await asyncio.gather(*tasks)
    load.elapsed_s = loop.time() - start
    for _, writer in idle:
        writer.close()
    return load


def drive(proxies: Sequence[Proxy], rate: float, seconds: float, concurrency: int) -> list[Load]:
    """Open-loop runs against every proxy at once (the machine's noise then falls on all alike); each one's CPU."""
    async def together() -> list[Load]:
        return list(await asyncio.gather(*(_drive(p.port, rate, seconds, concurrency) for p in proxies)))

    cpu = [p.cpu_s() for p in proxies]
    loads = asyncio.run(together())
    for load, proxy, before in zip(loads, proxies, cpu, strict=True):
        load.cpu_s = proxy.cpu_s() - before
    return loads


@dataclass
class Timings:
    """The probe's figures: ns of the callback's own methods per litellm_call_id ("" unattributed), calls per hook."""

    per_request: dict[str, int]
    calls: dict[str, int]

    def since(self, mark: Timings) -> Timings:
        return Timings({k: v - mark.per_request.get(k, 0) for k, v in self.per_request.items()
                        if k == "" or k not in mark.per_request},
                       {k: v - mark.calls.get(k, 0) for k, v in self.calls.items()})


def percentile(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, math.ceil(q * len(ordered)) - 1)] if ordered else math.nan


# -- the collector -----------------------------------------------------------------------------------------------


class Collector:
    """`stepline collect` with only its OTLP receiver (no engine, no GPU, no host, no plugin socket)."""

    def __init__(self, work: Path) -> None:
        self.store_dir = work / "store"
        port = free_port()
        self.otlp_url = f"http://127.0.0.1:{port}/v1/traces"
        self.log = work / "collector.log"
        command = [sys.executable, "-m", "stepline", "collect", "--store", f"chdb://{self.store_dir}",
                   "--otlp-port", str(port), "--metrics-port", "0",
                   "--query-port", "0", "--host-name", "gateway-bench", "--disable-source", "gpu",
                   "--disable-source", "host", "--disable-source", "plugin"]
        with self.log.open("wb") as log:
            self.process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)

    def ready(self) -> None:
        deadline = time.monotonic() + 120
        while read_beside_store(str(self.store_dir)) is None:
            if self.process.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"the collector did not start: {self.log.read_text()[-3000:]}")
            time.sleep(0.2)
        info = read_beside_store(str(self.store_dir))
        assert info is not None
        self.metrics_url = info.metrics_url
        _wait(self.metrics_url, self.process, self.log, "the collector")

    def otlp_counts(self) -> dict[str, float]:
        text = urllib.request.urlopen(self.metrics_url, timeout=10).read().decode()
        return {s.labels["counter"]: s.value for f in text_string_to_metric_families(text) for s in f.samples
                if s.name == "stepline_source_counts_total" and s.labels.get("source") == "otlp"}

    def stop_and_count(self) -> tuple[int, dict[str, int]]:
        """Stop cleanly (the writers drain), then the decision rows per gateway, counted by `stepline query` in a
        process of its own (chDB opens one embedded store per process, and the caller may hold another)."""
        code = _stop(self.process)
        out = subprocess.run([sys.executable, "-m", "stepline", "query", "--store", f"chdb://{self.store_dir}",
                              "SELECT gateway, count() FROM gateway_decisions GROUP BY gateway",
                              "--format", "TabSeparated"], capture_output=True, text=True, timeout=120, check=True)
        rows = [line.split("\t") for line in out.stdout.splitlines() if line.strip()]
        return code, {g: int(n) for g, n in rows}


# -- the phases ----------------------------------------------------------------------------------------------------


def cost_rounds(proxies: dict[str, Proxy], args: argparse.Namespace) -> dict[str, list[Load]]:
    rounds: dict[str, list[Load]] = {name: [] for name in proxies}
    for _ in range(args.rounds):
        for name, load in zip(proxies, drive(list(proxies.values()), args.cost_rate, args.round_seconds,
                                             args.concurrency), strict=True):
            rounds[name].append(load)
    return rounds


def _mean_err(values: Sequence[float]) -> tuple[float, float]:
    """The mean and its standard error."""
    return statistics.fmean(values), statistics.stdev(values) / math.sqrt(len(values)) if len(values) > 1 else math.nan


def print_cost(rounds: dict[str, list[Load]]) -> tuple[float, float]:
    """The end-to-end table; returns stepline's cost over prometheus's, and stepline's cost (s of CPU a request)."""
    per_round = {name: [x.cpu_s / max(1, x.answered) for x in loads] for name, loads in rounds.items()}
    lat = {name: [v for x in loads for v in x.latencies_s] for name, loads in rounds.items()}
    p99 = {name: percentile(values, 0.99) for name, values in lat.items()}
    cost = {name: _mean_err([v - b for v, b in zip(values, per_round["baseline"], strict=True)])
            for name, values in per_round.items()}
    print(f"{'mode':<11} {'answered':>8} {'failed':>6}  {'CPU ms/req':>10}  {'each round':<30} {'cost us/req':>14} "
          f"{'p50 ms':>7} {'p99 ms':>7} {'p99 +ms':>7}")
    for name, loads in rounds.items():
        cpu = sum(x.cpu_s for x in loads) / max(1, sum(x.answered for x in loads))
        each = ", ".join(f"{1e3 * v:.1f}" for v in per_round[name])
        mean, err = cost[name]
        print(f"{name:<11} {sum(x.answered for x in loads):>8,} {sum(x.failed + x.errors for x in loads):>6}  "
              f"{1e3 * cpu:>10.3f}  {each[:30]:<30} {1e6 * mean:>7.0f} +-{1e6 * err:>4.0f} "
              f"{1e3 * percentile(lat[name], 0.5):>7.2f} {1e3 * p99[name]:>7.2f} "
              f"{1e3 * (p99[name] - p99['baseline']):>7.2f}")
        if any(x.first_failure for x in loads):
            print(f"  first failure: {next(x.first_failure for x in loads if x.first_failure)}")
    (step, step_err), (prom, prom_err) = cost["stepline"], cost["prometheus"]
    ratio = step / prom if prom > 0 else math.nan
    print(f"cost: each round's CPU per request less the baseline's in the same round, mean +- standard error\n"
          f"ratio stepline/prometheus, proxy CPU over baseline: {1e6 * step:.0f} +-{1e6 * step_err:.0f} / "
          f"{1e6 * prom:.0f} +-{1e6 * prom_err:.0f} us = "
          f"{ratio:.2f}x; p99 latency over baseline: {1e3 * (p99['stepline'] - p99['baseline']):+.2f} / "
          f"{1e3 * (p99['prometheus'] - p99['baseline']):+.2f} ms")
    return ratio, step


def print_own(timings: dict[str, Timings], answered: dict[str, int], thread_ns: int) -> float:
    """The callbacks' own methods, timed in the proxy; returns stepline's cost over prometheus's (each less noop)."""
    print(f"\n{'callback':<11} {'requests':>8} {'timed calls/req':>15} {'mean us/req':>11} {'p50 us':>7} "
          f"{'p99 us':>7} {'max us':>7}  {'over noop us/req':>16}")
    means: dict[str, float] = {}
    for name, t in timings.items():
        ids = sorted(v for k, v in t.per_request.items() if k)
        means[name] = sum(t.per_request.values()) / max(1, answered[name]) / 1e3
        over = "" if name == "noop" else f"{means[name] - means['noop']:>16.1f}"
        print(f"{name:<11} {answered[name]:>8,} {sum(t.calls.values()) / max(1, answered[name]):>15.1f} "
              f"{means[name]:>11.1f} {percentile(ids, 0.5) / 1e3:>7.1f} {percentile(ids, 0.99) / 1e3:>7.1f} "
              f"{(ids[-1] if ids else math.nan) / 1e3:>7.1f}  {over}")
    step = means["stepline"] - means["noop"] + thread_ns / max(1, answered["stepline"]) / 1e3
    prom = means["prometheus"] - means["noop"]
    print(f"  + stepline's recorder thread (encodes and posts the batches): "
          f"{thread_ns / max(1, answered['stepline']) / 1e3:.1f} us of CPU a request")
    print(f"  noop: the probe's own price (a wrapper per hook); ratio stepline (hooks + thread) / prometheus, "
          f"each over noop: {step:.1f} / {prom:.1f} us = {step / prom:.2f}x")
    return step / prom if prom > 0 else math.nan


@dataclass
class RateRun:
    """The rate run: a fresh stepline proxy (its own gateway name, so its rows count apart), 2 s of warm-up, then
    `rate` req/s; the recorder's counts once it has posted everything, and the probe's timings."""

    name: str
    rate: float
    load: Load
    warm_answered: int
    recorder: dict[str, Any]
    timings: Timings

    def report(self, stored: dict[str, int], concurrency: int) -> int:
        """Prints the run; returns the decisions lost."""
        load, stats = self.load, self.recorder
        sent = self.warm_answered + load.answered
        kept = stored.get(f"bench-{self.name}", 0)
        own = sorted(v for k, v in self.timings.per_request.items() if k)
        print(f"\nrate run {self.rate:g} req/s x {load.offered / self.rate:g} s: offered {load.offered:,}, answered "
              f"{load.answered:,} ({load.ok:,} ok, {load.failed} failed), no answer {load.errors}, skipped (all "
              f"{concurrency} connections busy) {load.skipped:,}; {load.answered / load.elapsed_s:.1f} req/s answered"
              f"; latency p50 {1e3 * percentile(load.latencies_s, 0.5):.1f} ms, p99 "
              f"{1e3 * percentile(load.latencies_s, 0.99):.1f} ms; proxy CPU {100 * load.cpu_s / load.elapsed_s:.0f}%"
              f" of a core, {1e3 * load.cpu_s / max(1, load.answered):.2f} ms/req; {load.reconnects} reconnects; "
              + ("sustained" if load.sustained else "NOT sustained"))
        if load.first_failure:
            print(f"  first failure: {load.first_failure}")
        print(f"  stepline's hooks, timed in the proxy: p50 {percentile(own, 0.5) / 1e3:.1f} us, p99 "
              f"{percentile(own, 0.99) / 1e3:.1f} us a request; recorder thread "
              f"{stats.get('thread_cpu_ns', 0) / max(1, sent) / 1e3:.1f} us of CPU a request")
        print(f"  decisions: answered {sent:,} (2 s of warm-up included), recorded in the proxy "
              f"{stats.get('recorded', 0):,}, posted {stats.get('sent', 0):,}, dropped (queue full "
              f"{stats.get('dropped_full', 0)}, unsent {stats.get('dropped_unsent', 0)}), callback errors "
              f"{stats.get('callback_errors', 0)}; stored {kept:,}; lost {sent - kept:,}")
        return sent - kept


def rate_run(work: Path, backend: str, collector: Collector, rate: float, args: argparse.Namespace) -> RateRun:
    name = f"rate-{rate:g}"
    proxy = Proxy(name, MODES["stepline"], work, backend, collector.otlp_url)
    try:
        proxy.ready()
        [warm] = drive([proxy], min(rate, 20.0), 2.0, args.concurrency)
        mark = proxy.timings()
        [load] = drive([proxy], rate, args.seconds, args.concurrency)
        stats = proxy.settle(warm.answered + load.answered)
        return RateRun(name, rate, load, warm.answered, stats, proxy.timings().since(mark))
    finally:
        proxy.stop()


def arguments(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--rate", type=float, default=200.0, help="req/s of the rate run (default 200)")
    parser.add_argument("--seconds", type=float, default=60.0, help="length of the rate run (default 60)")
    parser.add_argument("--cost-rate", type=float, default=8.0, help="req/s per proxy, cost rounds (default 8)")
    parser.add_argument("--rounds", type=int, default=6, help="cost rounds (default 6)")
    parser.add_argument("--round-seconds", type=float, default=15.0, help="length of a cost round (default 15)")
    parser.add_argument("--concurrency", type=int, default=64, help="client connections per proxy (default 64)")
    parser.add_argument("--quick", action="store_true", help="25 req/s for 10 s; two 4 s cost rounds at 8 req/s")
    parser.add_argument("--serve-backend", type=int, help=argparse.SUPPRESS)  # the backend process
    args = parser.parse_args(argv)
    if args.quick:  # 25, not 50: one LiteLLM worker answers about 50 req/s on this project's 2-core VM, in all
        args.rate, args.seconds, args.cost_rate, args.rounds, args.round_seconds = 25.0, 10.0, 8.0, 2, 4.0
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = arguments(argv)
    if args.serve_backend is not None:
        serve_backend(args.serve_backend)
        return 0
    if not (VENV / "bin" / "litellm").exists():
        print(f"gateway callback: no LiteLLM proxy at {VENV}: run tests/gateway/install.sh")
        return 2
    version = subprocess.run([str(VENV / "bin" / "python"), "-c", "import importlib.metadata as m; "
                              "print(m.version('litellm'))"], capture_output=True, text=True, check=False).stdout
    print(f"machine: {platform.platform()}; python {platform.python_version()}; cpu_count={os.cpu_count()}; "
          "load average before " + " ".join(f"{x:.2f}" for x in os.getloadavg()))
    print(f"proxy: LiteLLM {version.strip()} ({VENV}), 1 worker, master key, non-streaming /v1/completions "
          f"(hosted_vllm, {len(PROMPT)}-char prompt, max_tokens 4); the stepline callback from {REPO / 'collector'}")
    print("backend: a trivial OpenAI-compatible server (one fixed completion, asyncio, a process of its own): the "
          "proxy's own work, no engine")

    work = Path(tempfile.mkdtemp(prefix="stepline-gateway-bench-"))
    backend_port = free_port()
    backend_url = f"http://127.0.0.1:{backend_port}"
    backend = subprocess.Popen([sys.executable, __file__, "--serve-backend", str(backend_port)])
    collector = Collector(work)
    proxies = {name: Proxy(name, callbacks, work, backend_url, collector.otlp_url) for name, callbacks in MODES.items()}
    checks: list[tuple[bool, str]] = []
    try:
        collector.ready()
        for proxy in proxies.values():
            proxy.ready()
        warm = dict(zip(proxies, drive(list(proxies.values()), args.cost_rate, 2.0, args.concurrency), strict=True))
        marks = {name: p.timings() for name, p in proxies.items() if name != "baseline"}
        thread_mark = proxies["stepline"].stats().get("thread_cpu_ns", 0)
        print(f"\ncost rounds: {args.rounds} x {args.round_seconds:g} s, the {len(MODES)} proxies loaded at once, "
              f"{args.cost_rate:g} req/s each (after 2 s of warm-up); CPU: each proxy process\n")
        rounds = cost_rounds(proxies, args)
        ratio, step = print_cost(rounds)
        answered = warm["stepline"].answered + sum(x.answered for x in rounds["stepline"])
        cost_stats = proxies["stepline"].settle(answered)
        own = print_own({name: proxies[name].timings().since(mark) for name, mark in marks.items()},
                        {name: sum(x.answered for x in rounds[name]) for name in marks},
                        cost_stats.get("thread_cpu_ns", 0) - thread_mark)
        families = [f for f in text_string_to_metric_families(proxies["prometheus"].metrics())
                    if f.name.startswith("litellm_")]
        print(f"prometheus callback: ran (its /metrics/ has {len(families)} litellm_ families after the rounds); "
              f"the probe wrapped: " + ", ".join(f"{n} {proxies[n].stats().get('wrapped')}" for n in marks))
        checks.append((ratio <= 0.5, f"stepline's callback costs {ratio:.2f}x LiteLLM's prometheus callback in proxy "
                                     f"CPU per request ({1e6 * step:.0f} us) (target <= 0.5x)"))
        checks.append((own <= 0.5, f"stepline's callback's own code costs {own:.2f}x prometheus's, timed in the "
                                   f"proxy (target <= 0.5x)"))
        for proxy in proxies.values():
            proxy.stop()
        runs = [rate_run(work, backend_url, collector, args.rate, args)]
        if not runs[0].load.sustained:
            first = runs[0].load
            runs.append(rate_run(work, backend_url, collector,
                                 max(5.0, 5 * math.floor(0.9 * first.answered / first.elapsed_s / 5)), args))
        time.sleep(1.5)  # the receiver's last poll
        otlp = collector.otlp_counts()
        code, stored = collector.stop_and_count()
    finally:
        for process in [p.process for p in proxies.values()] + [collector.process, backend]:
            if process.poll() is None:
                process.kill()
                process.wait()

    print(f"\ndecisions (collector exit code {code}; its OTLP receiver accepted {otlp.get('spans_accepted', 0):.0f} "
          f"spans, rejected {otlp.get('spans_rejected', 0):.0f}):")
    kept = stored.get("bench-stepline", 0)
    print(f"  cost rounds: answered {answered:,}, recorded in the proxy {cost_stats.get('recorded', 0):,}, posted "
          f"{cost_stats.get('sent', 0):,}, dropped {cost_stats.get('dropped_full', 0)} + "
          f"{cost_stats.get('dropped_unsent', 0)}; stored {kept:,}; lost {answered - kept:,}")
    for run in runs:
        lost = run.report(stored, args.concurrency)
        checks.append((lost == 0, f"{lost} decisions lost at {run.rate:g} req/s for {args.seconds:g} s (target 0)"))
        if run.rate != args.rate:
            print(f"  (the second run: 0.9x what the proxy answered at {args.rate:g} req/s, which it did not sustain)")
        checks.append((run.load.sustained, f"the proxy sustained {run.rate:g} req/s" + (
            "" if run.load.sustained else f": {run.load.answered / run.load.elapsed_s:.0f} req/s answered, "
            f"{run.load.skipped:,} skipped, {run.load.errors} unanswered")))
    print()
    for ok, what in checks:
        print(f"{'ok           ' if ok else 'TARGET MISSED'}  {what}")
    shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
