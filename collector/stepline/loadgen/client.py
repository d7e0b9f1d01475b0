"""The engine as the diagnosis matrix sees it (stdlib only): its models and context lengths, its token counts, and
one thread per stream."""

from __future__ import annotations

import http.client
import json
import random
import socket
import time
import urllib.parse
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from stepline.core.oneline import one_line

# Common three-letter words: " the" is four characters and, in the usual BPE vocabularies, one token,
# so a prompt of N words is about N tokens for a real engine and exactly N for the simulator's 4-chars rule.
_WORDS = ("the", "and", "for", "are", "but", "not", "you", "all", "any", "can", "had", "her", "was", "one",
          "our", "out", "day", "get", "has", "him", "his", "how", "man", "new", "now", "old", "see", "two",
          "way", "who", "boy", "did", "its", "let", "put", "say", "she", "too", "use", "big", "far", "few",
          "got", "hot", "job", "key", "law", "low", "map", "mix", "net", "oil", "pay", "red", "run", "sun",
          "top", "war", "win", "yes", "yet")


LONG_MAX_TOKENS = 8  # the long prompt's output
DEFAULT_LONG_PROMPT_TOKENS = 100_000
# Without the engine's /tokenize the prompt's length is an estimate (one token per common word): keep a tenth spare.
UNCOUNTED_SHARE = 0.9

class MatrixError(RuntimeError):
    """The engine could not be measured; the message is one line."""


@dataclass(slots=True)
class StreamResult:
    """One streamed completion as the client saw it: when it was sent, when each SSE event with tokens arrived and
    how many tokens each carried (from the engine's running usage; 1 where the engine did not say)."""

    sent_ns: int
    event_ns: list[int] = field(default_factory=list)
    event_tokens: list[int] = field(default_factory=list)
    counted: bool = True  # every event's token count came from the engine's usage
    usage_tokens: int | None = None  # the completion tokens the engine reported at the end
    finish_reason: str | None = None
    prompt_tokens: int | None = None  # the prompt's tokens as the engine counted them (its usage)
    cached_tokens: int | None = None  # of those, served from its prefix cache, where its usage says

    @property
    def tokens(self) -> int:
        """Tokens received: the events' counts, or the engine's final usage where it says more."""
        return max(sum(self.event_tokens), self.usage_tokens or 0)

    @property
    def ttft_s(self) -> float | None:
        """Seconds from sending to the first token."""
        return (self.event_ns[0] - self.sent_ns) / 1e9 if self.event_ns else None

    @property
    def event_gaps_s(self) -> list[float]:
        """Seconds between consecutive events."""
        return [(b - a) / 1e9 for a, b in zip(self.event_ns, self.event_ns[1:], strict=False)]

    @property
    def itls_s(self) -> list[float]:
        """Seconds between consecutive tokens: each event's gap shared by the tokens it carried, one value per token
        (the first event's tokens have no gap before them)."""
        return [gap / n for gap, n in zip(self.event_gaps_s, self.event_tokens[1:], strict=True) for _ in range(n)]


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
        self._usage_per_event = True

    @property
    def host_port(self) -> str:
        """host:port, the engine's default name."""
        return f"{self._host}:{self._port or (443 if self._scheme == 'https' else 80)}"

    def _connect(self) -> http.client.HTTPConnection:
        cls = http.client.HTTPSConnection if self._scheme == "https" else http.client.HTTPConnection
        return cls(self._host, self._port, timeout=self.timeout_s)

    def _request(self, method: str, path: str, body: dict[str, Any] | None = None, *,
                 passing: tuple[int, ...] = ()) -> tuple[http.client.HTTPConnection, http.client.HTTPResponse]:
        """Send a request; MatrixError unless it answered 200 or a status in `passing`."""
        conn = self._connect()
        data = json.dumps(body).encode() if body is not None else None
        headers = {"Content-Type": "application/json", "Accept": "text/event-stream, application/json"}
        try:
            conn.request(method, self._prefix + path, body=data, headers=headers)
            response = conn.getresponse()
        except (OSError, http.client.HTTPException) as exc:
            conn.close()
            raise MatrixError(f"cannot reach {self.url}: {_reason(exc)}") from None
        if response.status != 200 and response.status not in passing:
            detail = _error_detail(response)
            conn.close()
            raise MatrixError(f"{self.url}{path} answered HTTP {response.status}: {detail}")
        return conn, response

    def models(self) -> dict[str, int | None]:
        """The models /v1/models lists, in order, each with its max_model_len (None where not reported)."""
        conn, response = self._request("GET", "/v1/models")
        try:
            listed = json.loads(response.read())["data"]
            models = {str(m["id"]): m.get("max_model_len") for m in listed}
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            raise MatrixError(f"{self.url}/v1/models is not an OpenAI model list") from None
        finally:
            conn.close()
        if not models:
            raise MatrixError(f"{self.url}/v1/models lists no model")
        return {k: v if type(v) is int and v > 0 else None for k, v in models.items()}

    def healthy(self) -> bool:
        """True when GET /health answers 200 and /v1/models lists a model: the engine is up and serving."""
        try:
            conn, _ = self._request("GET", "/health")
            conn.close()
            self.models()
        except MatrixError:
            return False
        return True

    def first_model(self) -> str:
        """The first model the server lists at /v1/models."""
        return next(iter(self.models()))

    def count_tokens(self, model: str, prompt: str) -> int | None:
        """The prompt's length in the engine's own tokens (vLLM's POST /tokenize), or None where it has no such
        endpoint."""
        conn, response = self._request("POST", "/tokenize", {"model": model, "prompt": prompt},
                                       passing=(404, 405, 501))
        try:
            if response.status != 200:
                return None
            count = json.loads(response.read()).get("count")
        except (OSError, ValueError, AttributeError, http.client.HTTPException):
            return None
        finally:
            conn.close()
        return count if type(count) is int and count > 0 else None

    def stream(self, model: str, prompt: str | list[int], max_tokens: int,
               on_token: Callable[[int], None] | None = None, *,
               extra: Mapping[str, Any] | None = None) -> StreamResult:
        """Stream one completion, stamping every SSE event that carries tokens on arrival.

        `prompt` is text or token ids; `extra` adds fields to the request body (e.g. vLLM's `min_tokens`)."""
        body: dict[str, Any] = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "stream": True,
                                "ignore_eos": True, "temperature": 0.0, **(extra or {})}
        if self._usage_per_event:
            # vLLM's running usage in every event: how many tokens each event carried.
            body["stream_options"] = {"include_usage": True, "continuous_usage_stats": True}
        result = StreamResult(time.monotonic_ns())
        try:
            conn, response = self._request("POST", "/v1/completions", body)
        except MatrixError as exc:
            refused = str(exc)
            if not (self._usage_per_event and "HTTP 400" in refused
                    and ("stream_options" in refused or "continuous_usage_stats" in refused)):
                raise
            self._usage_per_event = False  # a server that refuses the option: count one token per event
            return self.stream(model, prompt, max_tokens, on_token, extra=extra)
        try:
            content_type = response.getheader("Content-Type", "")
            if not content_type.startswith("text/event-stream"):
                raise MatrixError(f"{self.url}/v1/completions did not stream (Content-Type {content_type!r}): "
                                  "is this an OpenAI-compatible server?")
            self._read_events(response, result, on_token)
        except (OSError, http.client.HTTPException) as exc:
            raise MatrixError(f"the stream from {self.url} broke after {result.tokens} tokens: "
                              f"{_reason(exc)}") from None
        finally:
            conn.close()
        return result

    def _read_events(self, response: http.client.HTTPResponse, result: StreamResult,
                     on_token: Callable[[int], None] | None) -> None:
        generated = 0  # the engine's running completion_tokens, where it reports them
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
                usage = chunk.get("usage")
                so_far = usage.get("completion_tokens") if isinstance(usage, dict) else None
            except (ValueError, KeyError, TypeError, AttributeError):
                raise MatrixError(f"{self.url} sent an event that is not a completion chunk: {data[:80]!r}") from None
            if type(so_far) is not int:
                so_far = None
            for choice in choices:
                if so_far is not None and result.counted:
                    carried = so_far - generated
                elif choice.get("text") or choice.get("finish_reason") is None:
                    carried = 1
                    result.counted = False
                else:
                    carried = 0
                if carried > 0:
                    result.event_ns.append(now)
                    result.event_tokens.append(carried)
                    if on_token is not None:
                        on_token(len(result.event_ns))
                if choice.get("finish_reason") is not None:
                    result.finish_reason = str(choice["finish_reason"])
            if so_far is not None:
                generated = max(generated, so_far)
                result.usage_tokens = generated
            if isinstance(usage, dict):
                _take_prompt_usage(usage, result)


@dataclass(frozen=True, slots=True)
class LongPrompt:
    """The long prompt's size: what prompt_text is asked for, its length in tokens and how that was chosen."""

    size: int
    tokens: int
    note: str


def long_prompt(size: int, nonce: str) -> str:
    """The matrix's long prompt of about `size` tokens, unique to `nonce`."""
    return prompt_text(size, f"stepline-matrix-{nonce}-long")


def size_long_prompt(endpoint: Endpoint, model: str, asked: int | None, max_model_len: int | None) -> LongPrompt:
    """The long prompt's size: as asked (or the default), cut to fit max_model_len with room for its output."""
    wanted = asked or DEFAULT_LONG_PROMPT_TOKENS
    how = f"--long-prompt-tokens {asked}" if asked else f"default {DEFAULT_LONG_PROMPT_TOKENS}"
    if max_model_len is None:
        return LongPrompt(wanted, wanted, f"{how}; the engine reports no max_model_len")
    # A few tokens spare: the nonce at its head tokenizes differently from one run to the next.
    room = max_model_len - LONG_MAX_TOKENS - max(16, max_model_len // 100)
    if room < 1:
        raise MatrixError(f"{model}'s max_model_len {max_model_len} leaves no room for a long prompt")
    size = min(wanted, room)
    counted = endpoint.count_tokens(model, long_prompt(size, uuid.uuid4().hex[:16]))
    if counted is None:
        size = min(size, int(room * UNCOUNTED_SHARE))
        tokens, by = size, "estimated: the engine has no /tokenize"
    else:
        for _ in range(5):  # a tokenizer that splits our words: shrink by the ratio it showed, and count again
            if counted is None or counted <= room:
                break
            size = max(1, size * room // counted - 1)
            counted = endpoint.count_tokens(model, long_prompt(size, uuid.uuid4().hex[:16]))
        if counted is None or counted > room:
            raise MatrixError(f"cannot make a long prompt of at most {room} tokens for {model} "
                              f"(max_model_len {max_model_len}): give --long-prompt-tokens")
        tokens, by = counted, "counted by the engine's /tokenize"
    fit = (f"cut to fit {model}'s max_model_len {max_model_len}" if size < wanted
           else f"fits {model}'s max_model_len {max_model_len}")
    return LongPrompt(size, tokens, f"{fit}: {how}, {LONG_MAX_TOKENS} tokens kept for its output; {by}")


def _take_prompt_usage(usage: dict[str, Any], result: StreamResult) -> None:
    prompt = usage.get("prompt_tokens")
    if type(prompt) is int:
        result.prompt_tokens = prompt
    details = usage.get("prompt_tokens_details")
    cached = details.get("cached_tokens") if isinstance(details, dict) else None
    if type(cached) is int:
        result.cached_tokens = cached


def _reason(exc: BaseException) -> str:
    if isinstance(exc, socket.timeout | TimeoutError):
        return "timed out"
    return one_line(exc) or type(exc).__name__


def _error_detail(response: http.client.HTTPResponse) -> str:
    try:
        raw = response.read(4096)
        parsed = json.loads(raw)
        message = parsed.get("message") or parsed.get("detail") or parsed.get("error", {}).get("message")
        if message:
            return one_line(message, 300)
        return raw.decode(errors="replace")[:200]
    except (OSError, ValueError, AttributeError, http.client.HTTPException):
        return response.reason or "no detail"
