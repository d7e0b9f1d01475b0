"""The engine as the matrix sees it: an OpenAI-compatible server's models, token counts and streams (against the
simulated vLLM server), what a stream's timings say, and the long prompt sized to the engine's max_model_len."""

from __future__ import annotations

import math
from collections.abc import Iterator

import pytest

from stepline.loadgen.client import (
    LONG_MAX_TOKENS,
    UNCOUNTED_SHARE,
    Endpoint,
    MatrixError,
    StreamResult,
    long_prompt,
    prompt_text,
    size_long_prompt,
)
from stepline.sim.config import EngineConfig
from stepline.sim.vllm_server import SimServer, idle_workload, serve

MODEL = "test/model"


@pytest.fixture(scope="module")
def server() -> Iterator[SimServer]:
    handle = serve(idle_workload(), EngineConfig(model=MODEL), port=0, speed=1.0, max_model_len=4096)
    yield handle
    handle.stop()


def test_the_endpoint_lists_the_model_counts_tokens_and_is_healthy(server: SimServer) -> None:
    endpoint = Endpoint(f"{server.url}/v1/", 10.0)
    assert endpoint.models() == {MODEL: 4096} and endpoint.first_model() == MODEL and endpoint.healthy()
    assert endpoint.count_tokens(MODEL, "x" * 40) == 10  # the simulator counts four characters a token
    assert endpoint.host_port == server.url.removeprefix("http://")


def test_a_stream_is_stamped_event_by_event(server: SimServer) -> None:
    seen: list[int] = []
    result = Endpoint(server.url, 10.0).stream(MODEL, prompt_text(32, "n1"), 5, seen.append)
    assert result.tokens == 5 and result.usage_tokens == 5 and result.counted
    assert result.ttft_s is not None and result.ttft_s > 0 and len(result.itls_s) == 4
    assert result.prompt_tokens is not None and result.finish_reason == "length"
    assert seen == [1, 2, 3, 4, 5]  # on_token hears the running count


def test_an_engine_that_is_not_there_or_no_url_is_one_line() -> None:
    with pytest.raises(MatrixError, match="must be http\\(s\\)://host:port"):
        Endpoint("localhost:8000", 1.0)
    gone = Endpoint("http://127.0.0.1:9", 1.0)
    assert not gone.healthy()
    with pytest.raises(MatrixError, match=r"cannot reach http://127\.0\.0\.1:9"):
        gone.models()


def test_a_streams_gaps_are_shared_by_the_tokens_each_event_carried() -> None:
    result = StreamResult(0, event_ns=[1_000_000_000, 1_100_000_000, 1_400_000_000], event_tokens=[1, 1, 3])
    assert result.ttft_s == 1.0 and result.event_gaps_s == pytest.approx([0.1, 0.3])
    assert result.itls_s == pytest.approx([0.1, 0.1, 0.1, 0.1]) and result.tokens == 5
    assert StreamResult(0).ttft_s is None and StreamResult(0, usage_tokens=7).tokens == 7


def test_prompts_are_about_their_tokens_and_no_two_nonces_share_a_prefix() -> None:
    text = prompt_text(100, "abc")
    assert text.startswith("abc:") and text == prompt_text(100, "abc")
    assert 95 <= len(text) // 4 <= 105 and prompt_text(100, "abd")[:3] != text[:3]
    assert long_prompt(10, "n").startswith("stepline-matrix-n-long:")


class _Counting(Endpoint):
    """An engine whose tokenizer makes `ratio` tokens of each estimated one; None: it has no /tokenize."""

    def __init__(self, ratio: float | None) -> None:
        super().__init__("http://127.0.0.1:9", 1.0)
        self.ratio = ratio

    def count_tokens(self, model: str, prompt: str) -> int | None:
        return None if self.ratio is None else math.ceil(len(prompt) / 4 * self.ratio)


def test_sizing_without_tokenize_or_with_a_tokenizer_that_splits_words() -> None:
    room = 32768 - LONG_MAX_TOKENS - 327
    estimated = size_long_prompt(_Counting(None), MODEL, None, 32768)
    assert estimated.size == estimated.tokens == int(room * UNCOUNTED_SHARE)
    assert estimated.note.endswith("estimated: the engine has no /tokenize")
    split = size_long_prompt(_Counting(1.7), MODEL, None, 32768)
    assert room * 0.95 < split.tokens <= room and split.size < room / 1.6
    fits = size_long_prompt(_Counting(1.0), MODEL, 1000, 32768)
    assert (fits.size, fits.note) == (1000, f"fits {MODEL}'s max_model_len 32768: --long-prompt-tokens 1000, 8 tokens "
                                            "kept for its output; counted by the engine's /tokenize")
    unknown = size_long_prompt(_Counting(1.0), MODEL, None, None)
    assert (unknown.size, unknown.note) == (100_000, "default 100000; the engine reports no max_model_len")
    with pytest.raises(MatrixError, match="max_model_len 24 leaves no room for a long prompt"):
        size_long_prompt(_Counting(1.0), MODEL, None, 24)


