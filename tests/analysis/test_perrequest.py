"""Per-request figures from joining requests with steps."""

from __future__ import annotations

import time

from stepline.analysis import perrequest
from stepline.model.rows import Event, Request, Step, micros
from stepline.store.store import Store

T0 = time.time() - 600


def _step(t: float, elapsed_ms: float, ctx_tokens: int, engine: str = "e") -> Step:
    return Step(micros(t), "h", engine, 0, "m", round(t * 100), elapsed_ms, 1 if ctx_tokens else 0, ctx_tokens,
                4, 4, 5, 0, 0, 0.5, 0, 0, 0, 0, 0, 0, [], [], False)


def _request(rid: str, arrival: float, queue: float, ttft: float, e2e: float, engine: str = "e",
             source: str = "plugin") -> Request:
    decode = e2e - ttft
    return Request(micros(arrival + e2e), "h", engine, 0, "m", rid, source, "length", micros(arrival), queue,
                   ttft - queue, decode, e2e - queue, e2e, ttft, decode / 9, 1000, 0, 10, 10, 0)


def test_slowest_requests_carry_what_the_steps_around_them_say(store: Store) -> None:
    steps = []
    t = T0
    # 10 s of 20 ms decode steps, then 5 s of 500 ms steps carrying 8192-token chunks, then 10 s decode again.
    while t < T0 + 10:
        steps.append(_step(t, 20, 0))
        t += 0.02
    while t < T0 + 15:
        steps.append(_step(t, 500, 8192))
        t += 0.5
    while t < T0 + 25:
        steps.append(_step(t, 20, 0))
        t += 0.02
    steps.append(_step(T0 + 12, 700, 8192, engine="other"))  # another engine's steps never count
    store.insert("steps", steps, Step._fields)
    # "victim" arrives at T0+9.5, waits 1 s, gets its first token at T0+11 and decodes through the chunked prefill.
    # "calm" lives entirely in the decode-only stretch after it.
    store.insert("requests", [_request("victim", T0 + 9.5, 1.0, 1.5, 6.0),
                              _request("calm", T0 + 17, 0.1, 0.2, 2.0)], Request._fields)
    slow = perrequest.slowest(store, since=T0 - 60, limit=5)
    assert [r.request_id for r in slow] == ["victim", "calm"]
    victim, calm = slow
    # It queued from 9.5 to 10.5: the 500 ms prefill steps ending in (10.0, 10.5] took about 1 s of that.
    assert 0.4 <= victim.queued_during_prefill_s <= 1.0
    # It decoded from 11.0 to 15.5: the 500 ms steps ending in (11, 15] are its tokens beside a long prefill.
    assert 7 <= victim.tokens_beside_long_prefill <= 9
    assert victim.worst_step_ms == 500 and victim.step_p99_ms == 500
    assert calm.tokens_beside_long_prefill == 0 and calm.worst_step_ms == 20 and calm.queued_during_prefill_s == 0
    assert [r.request_id for r in perrequest.slowest(store, since=T0 - 60, limit=1, by="queue")] == ["victim"]
    assert perrequest.slowest(store, since=T0 - 60, engine="nobody") == []
    text = perrequest.render(slow)
    assert "victim" in text and "500ms" in text


def test_bands_and_the_largest_prefill(store: Store) -> None:
    store.insert("steps", [_step(T0 + i * 0.5, 400 if 4 <= i < 10 else 20, 8192 if 4 <= i < 10 else 0)
                           for i in range(20)], Step._fields)
    big = _request("monster", T0 + 1, 1.0, 4.0, 6.0)._replace(prompt_tokens=359_000)
    store.insert("requests", [big, _request("small", T0 + 2, 0.1, 0.3, 2.0)], Request._fields)
    bands = perrequest.by_prompt_band(store, "e", T0 - 60)
    assert ">= 100k" in bands and "< 1k" in bands and "1k-8k" not in bands
    around = perrequest.around_largest_prefill(store, "e", T0 - 60)
    assert "monster, 359000 prompt tokens" in around
    assert "400ms" in around


def test_a_long_chunk_is_long_for_the_engines_own_budget(store: Store) -> None:
    # An engine whose budget is 1,024 tokens (a real vLLM CPU engine): 7 ms decode steps, 230 ms 1,024-token chunks.
    store.insert("events", [Event(micros(T0 - 60), "h", "cpu", "plugin", "engine_config", "info", "configured",
                                  {"max_num_batched_tokens": "1024"})], Event._fields)
    steps = [_step(T0 + i * 0.007, 7, 0, engine="cpu") for i in range(300)]
    steps += [_step(T0 + 2.1 + i * 0.23, 230, 1024, engine="cpu") for i in range(10)]
    steps += [_step(T0 + 4.5 + i * 0.007, 7, 0, engine="cpu") for i in range(300)]
    store.insert("steps", steps, Step._fields)
    store.insert("requests", [_request("beside", T0 + 1.0, 0.1, 0.2, 5.0, engine="cpu")], Request._fields)
    beside, = perrequest.slowest(store, since=T0 - 60)
    assert beside.tokens_beside_long_prefill == 10
    text = perrequest.render([beside])
    assert "long prefill chunk on cpu: a step carrying >= 512 prefill tokens: 0.5 of its token budget 1024 " \
           "(engine_config)." in text
    # An explicit size still wins.
    assert perrequest.slowest(store, since=T0 - 60, long_prefill_tokens=2048)[0].tokens_beside_long_prefill == 0
