"""The OpenAI-style requests the simulated vLLM server takes, parsed and refused as vLLM does, and the pieces of
its answers.

The simulator has no tokenizer: a string prompt counts as ceil(characters / 4) tokens (prose runs ~4 characters per
token, code ~3: send a list of token ids for an exact count), and generated tokens cycle through a few words.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any

CHARS_PER_TOKEN = 4
DEFAULT_MAX_TOKENS = 16  # vLLM's default for /v1/completions
_TOKEN_TEXTS = (" the", " engine", " steps", " on", " one", " timeline", ".")


class ApiError(Exception):
    """A request the API refuses: HTTP status and vLLM's error type."""

    def __init__(self, status: int, kind: str, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.kind = kind


@dataclass(frozen=True, slots=True)
class Completion:
    """A parsed /v1/completions request."""

    prompt_tokens: int
    prompt_key: str
    max_tokens: int
    stream: bool
    include_usage: bool
    cached_prompt_tokens: int | None
    continuous_usage: bool = False


def parse_completion(body: bytes, model: str, max_model_len: int | None = None) -> Completion:
    """Validate a /v1/completions body; raise ApiError naming what is wrong."""
    raw = _parse_body(body, model)
    tokens, key = _prompt(raw)
    max_tokens = raw.get("max_tokens", DEFAULT_MAX_TOKENS)
    if type(max_tokens) is not int or max_tokens < 1:
        raise ApiError(400, "BadRequestError", f"max_tokens must be a positive integer, got {max_tokens!r}")
    if max_model_len is not None and tokens + max_tokens > max_model_len:
        raise ApiError(400, "BadRequestError",
                       f"This model's maximum context length is {max_model_len} tokens. However, you requested "
                       f"{tokens + max_tokens} tokens ({tokens} in the messages, {max_tokens} in the completion). "
                       "Please reduce the length of the messages or completion.")
    cached = raw.get("cached_prompt_tokens")
    if cached is not None and (type(cached) is not int or cached < 0):
        raise ApiError(400, "BadRequestError", f"cached_prompt_tokens must be a non-negative integer, got {cached!r}")
    options = raw.get("stream_options")
    include_usage = isinstance(options, dict) and bool(options.get("include_usage"))
    continuous = isinstance(options, dict) and bool(options.get("continuous_usage_stats"))
    return Completion(tokens, key, max_tokens, bool(raw.get("stream", False)), include_usage, cached, continuous)


def parse_tokenize(body: bytes, model: str) -> int:
    """The prompt's token count for a /tokenize body (the simulator's rule: ceil(characters / 4))."""
    return _prompt(_parse_body(body, model))[0]


def _parse_body(body: bytes, model: str) -> dict[str, Any]:
    try:
        raw = json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ApiError(400, "BadRequestError", f"the body is not JSON: {exc}") from None
    if not isinstance(raw, dict):
        raise ApiError(400, "BadRequestError", "the body must be a JSON object")
    if raw.get("model") not in (None, model):
        raise ApiError(404, "NotFoundError", f"The model `{raw['model']}` does not exist.")
    return raw


def _prompt(raw: dict[str, Any]) -> tuple[int, str]:
    prompt = raw.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str) and prompt:
        tokens = -(-len(prompt) // CHARS_PER_TOKEN)
        key = hashlib.sha256(prompt.encode()).hexdigest()
    elif isinstance(prompt, list) and prompt and all(type(t) is int and t >= 0 for t in prompt):
        tokens = len(prompt)
        key = hashlib.sha256(json.dumps(prompt).encode()).hexdigest()
    else:
        raise ApiError(400, "BadRequestError", "prompt must be a non-empty string or list of token ids")
    return tokens, key


def token_text(index: int) -> str:
    """The text of a request's `index`th generated token (from 1): the simulator has no tokenizer."""
    return _TOKEN_TEXTS[(index - 1) % len(_TOKEN_TEXTS)]


def usage(completion: Completion, cached: int, generated: int | None = None) -> dict[str, Any]:
    """A response's `usage`, as vLLM's: `generated` tokens so far, or all of them."""
    done = completion.max_tokens if generated is None else generated
    return {"prompt_tokens": completion.prompt_tokens, "completion_tokens": done,
            "total_tokens": completion.prompt_tokens + done,
            "prompt_tokens_details": {"cached_tokens": cached}}
