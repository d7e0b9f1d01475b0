"""The simulated server's requests: prompts counted by the simulator's rule, bodies refused with vLLM's error types
and messages, and the usage its answers carry."""

from __future__ import annotations

import json
from typing import Any

import pytest

from stepline.sim.completions import ApiError, parse_completion, parse_tokenize, token_text, usage


def _body(**fields: Any) -> bytes:
    return json.dumps(fields).encode()


def test_a_prompt_is_a_token_per_four_characters_or_one_per_token_id() -> None:
    assert parse_tokenize(_body(prompt="hello"), "m") == 2
    assert parse_tokenize(_body(prompt=["x" * 9]), "m") == 3  # a batch of one
    assert parse_tokenize(_body(prompt=[5, 6, 7], model="m"), "m") == 3
    same, again, other = (parse_completion(_body(prompt=p), "m") for p in ("abc", "abc", "abd"))
    assert same.prompt_key == again.prompt_key != other.prompt_key  # a prompt sent again is a prefix-cache hit


def test_a_completion_takes_vllms_defaults_and_stream_options() -> None:
    plain = parse_completion(_body(prompt=[1, 2]), "m")
    assert (plain.prompt_tokens, plain.max_tokens, plain.stream, plain.include_usage, plain.continuous_usage) == (
        2, 16, False, False, False)
    assert plain.cached_prompt_tokens is None  # the server decides from the prompts it has seen
    streamed = parse_completion(_body(prompt=[1], max_tokens=5, stream=True, cached_prompt_tokens=0,
                                      stream_options={"include_usage": True, "continuous_usage_stats": True}), "m")
    assert (streamed.max_tokens, streamed.stream, streamed.include_usage, streamed.continuous_usage) == (
        5, True, True, True)
    assert streamed.cached_prompt_tokens == 0


@pytest.mark.parametrize(("body", "status", "message"), [
    (b"{bad", 400, "the body is not JSON"),
    (b"[1]", 400, "the body must be a JSON object"),
    (_body(model="other", prompt="x"), 404, "The model `other` does not exist."),
    (_body(prompt=""), 400, "prompt must be a non-empty string or list of token ids"),
    (_body(prompt=[1, -1]), 400, "prompt must be a non-empty string or list of token ids"),
    (_body(prompt="x", max_tokens=0), 400, "max_tokens must be a positive integer, got 0"),
    (_body(prompt="x", max_tokens=True), 400, "max_tokens must be a positive integer, got True"),
    (_body(prompt="x", cached_prompt_tokens=-1), 400, "cached_prompt_tokens must be a non-negative integer, got -1"),
    (_body(prompt=[1] * 90, max_tokens=11), 400, "This model's maximum context length is 100 tokens. However, you "
                                                  "requested 101 tokens (90 in the messages, 11 in the completion)."),
])
def test_a_bad_body_is_refused_as_vllm_refuses_it(body: bytes, status: int, message: str) -> None:
    with pytest.raises(ApiError) as refused:
        parse_completion(body, "m", max_model_len=100)
    assert refused.value.status == status and str(refused.value).startswith(message)
    assert refused.value.kind == ("NotFoundError" if status == 404 else "BadRequestError")


def test_usage_counts_the_tokens_so_far_or_all_of_them() -> None:
    completion = parse_completion(_body(prompt=[1, 2, 3], max_tokens=4), "m")
    assert usage(completion, 2) == {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7,
                                    "prompt_tokens_details": {"cached_tokens": 2}}
    assert usage(completion, 0, 1)["completion_tokens"] == 1
    assert [token_text(i) for i in (1, 2, 8)] == [" the", " engine", " the"]
