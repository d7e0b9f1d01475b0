"""A minimal OpenAI-compatible streaming client for the diagnosis matrix: stdlib only, one thread per stream."""

from __future__ import annotations

import http.client
import json
import random
import socket
import time
import urllib.parse
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

# Common three-letter words: " the" is four characters and, in the usual BPE vocabularies, one token,
# so a prompt of N words is about N tokens for a real engine and exactly N for the simulator's 4-chars rule.
_WORDS = ("the", "and", "for", "are", "but", "not", "you", "all", "any", "can", "had", "her", "was", "one",
          "our", "out", "day", "get", "has", "him", "his", "how", "man", "new", "now", "old", "see", "two",
          "way", "who", "boy", "did", "its", "let", "put", "say", "she", "too", "use", "big", "far", "few",
          "got", "hot", "job", "key", "law", "low", "map", "mix", "net", "oil", "pay", "red", "run", "sun",
          "top", "war", "win", "yes", "yet")


class MatrixError(RuntimeError):
    """The engine could not be measured; the message is one line."""


@dataclass(slots=True)
class StreamResult:
    """One streamed completion as the client saw it: when it was sent and when each token arrived."""

    sent_ns: int
    token_ns: list[int] = field(default_factory=list)
    finish_reason: str | None = None

    @property
    def ttft_s(self) -> float | None:
        """Seconds from sending to the first token."""
        return (self.token_ns[0] - self.sent_ns) / 1e9 if self.token_ns else None

    @property
    def itls_s(self) -> list[float]:
        """Seconds between consecutive tokens."""
        return [(b - a) / 1e9 for a, b in zip(self.token_ns, self.token_ns[1:], strict=False)]


def prompt_text(tokens: int, nonce: str) -> str:
    """About `tokens` tokens of text that begins with `nonce`, so no two nonces share a cached prefix."""
    rng = random.Random(nonce)
    head = f"{nonce}:"
    words = [rng.choice(_WORDS) for _ in range(max(0, tokens - -(-len(head) // 4)))]
    return head + "".join(" " + w for w in words)


class Endpoint:
    """An OpenAI-compatible server at `base_url` (with or without a trailing /v1)."""

    def __init__(self, base_url: str, timeout_s: float) -> None:
        parts = urllib.parse.urlsplit(base_url.strip())
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise MatrixError(f"engine URL {base_url!r} must be http(s)://host:port")
        self.url = base_url.strip().rstrip("/")
        self._scheme = parts.scheme
        self._host = parts.hostname
        self._port = parts.port
        self._prefix = parts.path.rstrip("/").removesuffix("/v1")
        self.timeout_s = timeout_s

    @property
    def host_port(self) -> str:
        """host:port, the engine's default name."""
        return f"{self._host}:{self._port or (443 if self._scheme == 'https' else 80)}"

    def _connect(self) -> http.client.HTTPConnection:
        cls = http.client.HTTPSConnection if self._scheme == "https" else http.client.HTTPConnection
        return cls(self._host, self._port, timeout=self.timeout_s)

    def _request(self, method: str, path: str, body: dict[str, Any] | None = None) -> tuple[
            http.client.HTTPConnection, http.client.HTTPResponse]:
        conn = self._connect()
        data = json.dumps(body).encode() if body is not None else None
        headers = {"Content-Type": "application/json", "Accept": "text/event-stream, application/json"}
        try:
            conn.request(method, self._prefix + path, body=data, headers=headers)
            response = conn.getresponse()
        except (OSError, http.client.HTTPException) as exc:
            conn.close()
            raise MatrixError(f"cannot reach {self.url}: {_reason(exc)}") from None
        if response.status != 200:
            detail = _error_detail(response)
            conn.close()
            raise MatrixError(f"{self.url}{path} answered HTTP {response.status}: {detail}")
        return conn, response

    def first_model(self) -> str:
        """The first model the server lists at /v1/models."""
        conn, response = self._request("GET", "/v1/models")
        try:
            models = json.loads(response.read())["data"]
            return str(models[0]["id"])
        except (OSError, ValueError, KeyError, IndexError, TypeError):
            raise MatrixError(f"{self.url}/v1/models is not an OpenAI model list") from None
        finally:
            conn.close()

    def stream(self, model: str, prompt: str, max_tokens: int,
               on_token: Callable[[int], None] | None = None) -> StreamResult:
        """Stream one completion, stamping every SSE data line that carries text on arrival."""
        body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "stream": True, "ignore_eos": True,
                "temperature": 0.0}
        result = StreamResult(time.monotonic_ns())
        conn, response = self._request("POST", "/v1/completions", body)
        try:
            content_type = response.getheader("Content-Type", "")
            if not content_type.startswith("text/event-stream"):
                raise MatrixError(f"{self.url}/v1/completions did not stream (Content-Type {content_type!r}): "
                                  "is this an OpenAI-compatible server?")
            self._read_events(response, result, on_token)
        except (OSError, http.client.HTTPException) as exc:
            raise MatrixError(f"the stream from {self.url} broke after {len(result.token_ns)} tokens: "
                              f"{_reason(exc)}") from None
        finally:
            conn.close()
        return result

    def _read_events(self, response: http.client.HTTPResponse, result: StreamResult,
                     on_token: Callable[[int], None] | None) -> None:
        while True:
            line = response.readline()
            now = time.monotonic_ns()
            if not line:
                raise MatrixError(f"the stream from {self.url} ended without data: [DONE]")
            text = line.strip()
            if not text or text.startswith(b":") or not text.startswith(b"data:"):
                continue  # blank separators, comments, event:/id: fields
            data = text[5:].strip()
            if data == b"[DONE]":
                return
            try:
                chunk = json.loads(data)
                if isinstance(chunk, dict) and "error" in chunk:
                    raise MatrixError(f"{self.url} reported an error mid-stream: {chunk['error']}")
                choices = chunk["choices"]
            except (ValueError, KeyError, TypeError):
                raise MatrixError(f"{self.url} sent an event that is not a completion chunk: {data[:80]!r}") from None
            for choice in choices:
                if choice.get("text") or choice.get("finish_reason") is None:
                    result.token_ns.append(now)
                    if on_token is not None:
                        on_token(len(result.token_ns))
                if choice.get("finish_reason") is not None:
                    result.finish_reason = str(choice["finish_reason"])


def _reason(exc: BaseException) -> str:
    if isinstance(exc, socket.timeout | TimeoutError):
        return "timed out"
    return " ".join(str(exc).split()) or type(exc).__name__


def _error_detail(response: http.client.HTTPResponse) -> str:
    try:
        raw = response.read(4096)
        parsed = json.loads(raw)
        message = parsed.get("message") or parsed.get("detail") or parsed.get("error", {}).get("message")
        if message:
            return " ".join(str(message).split())[:300]
        return raw.decode(errors="replace")[:200]
    except (OSError, ValueError, AttributeError, http.client.HTTPException):
        return response.reason or "no detail"
