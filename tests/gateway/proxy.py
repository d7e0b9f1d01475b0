"""The real LiteLLM proxy for the gateway tests: its environment (tests/gateway/install.sh), the tests' own size-routing
hook, a proxy started in front of named lanes with stepline's callback, and the clients the tests send through it."""

from __future__ import annotations

import functools
import json
import os
import socket
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from stepline.testing.alertstack import free_port

HERE = Path(__file__).resolve().parent
VENV = Path(os.environ.get("STEPLINE_GATEWAY_VENV", Path.home() / ".cache" / "stepline" / "gateway"))
KEY = "sk-stepline-test"
CALLBACK = "stepline.gateway.litellm"  # the module the proxy imports (in its own environment, not this one)
RAISE = "<make-the-hook-raise>"  # SIZE_LANES' marker: a prompt holding it makes the hook's measurement fail
SILENT = "<make-the-hook-fail-silently>"  # a prompt holding it makes the hook fail open and record nothing
REFUSE = "<make-the-hook-refuse>"  # a prompt holding it is refused by the hook (429), its lane full
# The size hook, written into the proxy's config directory (LiteLLM loads `module.instance` from there).
SIZE_LANES = '''\
"""The test's own size-routing hook, the seed's kind: characters against a bar set from a token estimate.

Loaded by the LiteLLM proxy from its config directory (`callbacks: ["size_lanes.hook"]`). It measures the prompt in
characters, sends it to the heavy lane at THRESHOLD_CHARS or more, and says what it measured and against what in the
request's metadata, where stepline's callback reads it. A prompt holding RAISE makes the measurement fail: the hook
goes on to the fast lane, as the seed's `except: return data` did, but reports what it swallowed. A prompt holding
SILENT makes it fail the way the seed's hook did before anyone logged it: it returns the request as it came (the
client's lane, fast) and records nothing at all. A prompt holding REFUSE is measured, given its lane, and refused
with a 429 as a lane whose slots are all held refuses: the lane in `stepline_lane`, as docs/gateway.md asks.
"""

from __future__ import annotations

import os
from typing import Any

from litellm.integrations.custom_logger import CustomLogger

THRESHOLD_CHARS = int(os.environ.get("SIZE_LANES_THRESHOLD_CHARS", "4000"))
RAISE = "<make-the-hook-raise>"
SILENT = "<make-the-hook-fail-silently>"
REFUSE = "<make-the-hook-refuse>"


class Unmeasurable(Exception):
    """What the silent failure raises: the hook's own except swallows it whole."""


def _measure(messages: Any) -> int:
    text = "".join(m["content"] for m in messages) if isinstance(messages, list) else str(messages)
    if RAISE in text:
        raise KeyError("content")
    if SILENT in text:
        raise Unmeasurable("silent")
    return len(text)


class SizeLanes(CustomLogger):
    async def async_pre_call_hook(self, user_api_key_dict: Any, cache: Any, data: dict, call_type: Any) -> dict:
        metadata = data.setdefault("metadata", {})
        prompt = data.get("prompt") if data.get("messages") is None else data.get("messages")
        try:
            chars = _measure(prompt)
        except Unmeasurable:  # fails open and says nothing: the request goes on as it came
            return data
        except Exception as exc:  # fails open to the fast lane, and says so
            data["model"] = "fast"
            metadata["stepline_swallowed"] = f"{type(exc).__name__}: {exc}"
            return data
        data["model"] = "heavy" if chars >= THRESHOLD_CHARS else "fast"
        metadata.update({"stepline_size_chars": chars, "stepline_threshold": THRESHOLD_CHARS,
                         "stepline_threshold_unit": "chars", "stepline_lane": data["model"]})
        if REFUSE in str(prompt):
            from fastapi import HTTPException

            raise HTTPException(status_code=429, detail=f"lane {data['model']} is full")
        return data


hook = SizeLanes()
'''


def available() -> bool:
    return (VENV / "bin" / "litellm").exists()


def ready_or_skip() -> None:
    """The proxy's environment refreshed with this checkout's callback; without it, a skip saying how to make it (a
    failure in CI, where .ci/run makes it)."""
    import pytest

    if not available():
        reason = f"no LiteLLM proxy at {VENV}: bash tests/gateway/install.sh makes it"
        if os.environ.get("CI"):
            pytest.fail(reason + " (.ci/run must)")
        pytest.skip(reason)
    install()


@functools.cache
def install() -> Path:
    """The proxy's environment, refreshed (stepline's wheel reinstalled once per process, so that the callback under
    test is this checkout's)."""
    out = subprocess.run(["bash", str(HERE / "install.sh")], capture_output=True, text=True, timeout=1500,
                         check=False)
    if out.returncode != 0:
        raise RuntimeError(f"installing the gateways failed: {out.stderr.strip()[-2000:]}")
    return Path(out.stdout.strip().splitlines()[-1])


@contextmanager
def litellm_proxy(work: Path, lanes: Mapping[str, str], model: str | Mapping[str, str], otlp_url: str,
                  threshold_chars: int,
                  gateway: str = "lanes", router_settings: Mapping[str, Any] | None = None,
                  hook: Path | None = None, hook_env: Mapping[str, str] | None = None,
                  auth: Path | None = None) -> Iterator[str]:
    """The proxy, serving until the block ends (its URL): `lanes` maps each lane (a model group) to its backend's
    OpenAI base URL (`http://host:port/v1`), each serving `model` (or, a mapping, the lane's own: a LoRA
    adapter's name asks the engine for the adapter); SIZE_LANES routes between them at
    `threshold_chars` (or `hook`, a routing hook's file whose module-level `hook` the proxy loads, configured by
    `hook_env`); stepline's callback sends each attempt to `otlp_url` as gateway `gateway`. `router_settings`, where
    given, is the config's own (`fallbacks`, `num_retries`, ...). `auth`, where given, is a custom auth's file
    (its `user_api_key_auth` replaces the master key: tests/gateway/team_auth.py). Its config, hook and log
    (proxy.log) go to `work`."""
    module = hook.stem if hook is not None else "size_lanes"
    (work / f"{module}.py").write_text(hook.read_text() if hook is not None else SIZE_LANES)
    served = {lane: model if isinstance(model, str) else model[lane] for lane in lanes}
    models = [{"model_name": lane, "litellm_params": {"model": f"hosted_vllm/{served[lane]}", "api_base": api_base,
                                                       "api_key": "none"}} for lane, api_base in lanes.items()]
    config: dict[str, Any] = {"model_list": models, "litellm_settings": {
        "callbacks": [f"{module}.hook", f"{CALLBACK}.proxy_handler", "prometheus"]}}
    if router_settings is not None:
        config["router_settings"] = dict(router_settings)
    if auth is not None:
        (work / auth.name).write_text(auth.read_text())
        config["general_settings"] = {"custom_auth": f"{auth.stem}.user_api_key_auth"}
    (work / "config.yaml").write_text(json.dumps(config))  # JSON is YAML
    env = {**os.environ, "LITELLM_MASTER_KEY": KEY, "LITELLM_LOCAL_MODEL_COST_MAP": "true",
           "STEPLINE_OTLP_URL": otlp_url, "STEPLINE_GATEWAY_NAME": gateway,
           "SIZE_LANES_THRESHOLD_CHARS": str(threshold_chars), "PYTHONPATH": str(work), **(hook_env or {})}
    process, url, log = _start(work, env)
    try:
        yield url
    finally:
        process.terminate()
        try:
            process.wait(20)
        except subprocess.TimeoutExpired:
            process.kill()
        log.close()


def _start(work: Path, env: dict[str, str], attempts: int = 3) -> tuple[subprocess.Popen[bytes], str, Any]:
    """The proxy on a free port, answering its liveness check: its process, URL and log. A proxy that exits while
    starting is started again on another port (at most `attempts` times): on a busy machine another test's server
    can take the port free_port() found before the proxy binds it (a GET then answers 501, and the proxy exits)."""
    for attempt in range(1, attempts + 1):
        port = free_port()
        log = (work / "proxy.log").open("w")
        process = subprocess.Popen([str(VENV / "bin" / "litellm"), "--config", str(work / "config.yaml"),
                                    "--host", "127.0.0.1", "--port", str(port)], env=env, stdout=log,
                                   stderr=subprocess.STDOUT, cwd=work)
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 120
        while True:
            try:
                with urllib.request.urlopen(f"{url}/health/liveliness", timeout=2):
                    return process, url, log
            except OSError as exc:
                exited = process.poll() is not None
                if exited and attempt < attempts:
                    log.close()
                    break
                if exited or time.monotonic() > deadline:
                    process.kill()
                    log.close()
                    started = (work / "proxy.log").read_text()[-3000:]
                    raise AssertionError(f"the LiteLLM proxy did not start: {started}") from exc
                time.sleep(0.5)
    raise AssertionError("unreachable: the last attempt returns or raises")


def complete(url: str, prompt: str, chat: bool = False, *, key: str = KEY, **extra: Any) -> dict[str, Any]:
    """One completion (`chat`: a chat completion of one user message) through the proxy (its response); the hook
    chooses the lane."""
    path, body = _body(prompt, chat, {"max_tokens": 4, **extra})
    request = urllib.request.Request(f"{url}{path}", body, {"Authorization": f"Bearer {key}",
                                                            "Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as response:
        return dict(json.loads(response.read()))


def send(url: str, prompt: str, chat: bool = False, *, key: str = KEY, **extra: Any) -> tuple[int, str]:
    """One completion (`chat`: a chat completion of one user message) through the proxy, answered or not: its HTTP
    status and the proxy's request id (the `x-litellm-call-id` header, LiteLLM's litellm_call_id)."""
    path, body = _body(prompt, chat, {"max_tokens": 4, **extra})
    request = urllib.request.Request(f"{url}{path}", body, {"Authorization": f"Bearer {key}",
                                                            "Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            response.read()
            return response.status, response.headers.get("x-litellm-call-id", "")
    except urllib.error.HTTPError as exc:
        exc.read()
        return exc.code, exc.headers.get("x-litellm-call-id", "")


def _body(prompt: str, chat: bool, extra: Mapping[str, Any]) -> tuple[str, bytes]:
    """A request's path and body: a completion of `prompt`, or (`chat`) a chat completion of it as one message."""
    text: dict[str, Any] = {"messages": [{"role": "user", "content": prompt}]} if chat else {"prompt": prompt}
    return ("/v1/chat/completions" if chat else "/v1/completions",
            json.dumps({"model": "fast", **text, **extra}).encode())


def leave_mid_stream(url: str, prompt: str, max_tokens: int, chunks: int = 1, chat: bool = False,
                     **extra: Any) -> bytes:
    """A streaming completion (`chat`: a chat completion) whose client closes its socket once `chunks` chunks came
    (what it read)."""
    path, body = _body(prompt, chat, {"max_tokens": max_tokens, "stream": True, **extra})
    with socket.create_connection(("127.0.0.1", int(url.rsplit(":", 1)[1])), timeout=30) as conn:
        conn.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
                     f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body)
        seen = b""
        while seen.count(b"data:") < chunks:  # until the chunks came; then the client goes
            chunk = conn.recv(65536)
            assert chunk, seen
            seen += chunk
    return seen
