"""Decision spans: the attributes a gateway sends, the row they become, and the one-line reasons a span is refused."""

from __future__ import annotations

import time
from typing import Any

import pytest

from stepline.core.clock import ManualClock
from stepline.gateway import decisions as d
from stepline.gateway.decisions import DecisionRejected, backend_engine, to_decision
from stepline.model.rows import GatewayDecision, Row
from stepline.sources.addresses import EngineAddresses
from stepline.sources.base import SourceContext
from stepline.sources.otlp import OtlpReceiver
from stepline.sources.vllm_metrics import VllmMetricsSource
from stepline.store.store import Store
from tests.sources.test_otlp import ARRIVAL_NS, FINISH_NS, drain, export, make_receiver, receiver  # noqa: F401

# What the seed's router knew about one monster: 340,112 characters, under a 400,000-character bar, so the fast lane.
MONSTER = {d.REQUEST_ID: "req-7", d.LANE: "fast", d.BACKEND: "http://10.0.0.5:8000/v1",
           d.CANDIDATES: ["http://10.0.0.5:8000/v1", "http://10.0.0.6:8000/v1"], d.SIZE_CHARS: 340_112,
           d.SIZE_BYTES: 340_200, d.THRESHOLD: 400_000, d.THRESHOLD_UNIT: "chars", d.HEALTH: "healthy",
           d.IN_FLIGHT: 3, d.STATUS: 200, d.FIRST_BYTE: ARRIVAL_NS + 900_000_000, d.ATTEMPT: 1}


def test_a_decision_span_is_one_row_with_the_threshold_in_its_unit() -> None:
    row = to_decision(MONSTER, ARRIVAL_NS, FINISH_NS, "router", "h1")
    assert row == GatewayDecision(
        ts=(ARRIVAL_NS + 500) // 1000, host="h1", engine="10.0.0.5:8000", gateway="router", request_id="req-7",
        attempt=1, lane="fast", candidates=["10.0.0.5:8000", "10.0.0.6:8000"], size_chars=340_112,
        size_bytes=340_200, size_tokens=None, threshold=400_000.0, threshold_unit="chars", health="healthy",
        in_flight=3, status=200, error_type="", client_disconnected=False,
        first_byte_ts=(ARRIVAL_NS + 900_000_500) // 1000, end_ts=(FINISH_NS + 500) // 1000, swallowed_exception="")


def test_who_sent_it_is_bounded_as_every_name_is() -> None:
    row = to_decision({**MONSTER, d.KEY: "alpha-key", d.TEAM: "alpha", d.END_USER: "customer-7"}, ARRIVAL_NS,
                      FINISH_NS, "router", "h1")
    assert (row.key, row.team, row.user, row.end_user, row.model) == ("alpha-key", "alpha", "", "customer-7", "")
    with pytest.raises(DecisionRejected, match=f"{d.TEAM} is over the 1024-byte limit"):
        to_decision({**MONSTER, d.TEAM: "t" * 2000}, ARRIVAL_NS, FINISH_NS, "router", "h1")


def test_a_hook_that_failed_open_leaves_no_size_and_says_what_it_swallowed() -> None:
    row = to_decision({d.LANE: "fast", d.SWALLOWED: "KeyError: 'messages'"}, ARRIVAL_NS, ARRIVAL_NS, "r", "h")
    assert (row.size_chars, row.size_bytes, row.size_tokens, row.threshold) == (None, None, None, None)
    assert row.swallowed_exception == "KeyError: 'messages'" and row.attempt == 1 and row.engine == ""


@pytest.mark.parametrize(("attrs", "reason"), [
    ({d.THRESHOLD_UNIT: "words"}, "stepline.gateway.threshold.unit is 'words', not one of chars, bytes, tokens"),
    ({d.SIZE_CHARS: -3}, "stepline.gateway.size.chars is '-3', not a whole number"),
    ({d.SIZE_TOKENS: 1.5}, "stepline.gateway.size.tokens is '1.5', not a whole number"),
    ({d.THRESHOLD: "lots"}, "stepline.gateway.threshold is 'lots', not a number"),
    ({d.CLIENT_DISCONNECTED: "yes"}, "stepline.gateway.client_disconnected is 'yes', not a boolean"),
    ({d.CANDIDATES: [1, 2]}, "stepline.gateway.candidates is not an array of strings"),
    ({d.SIZE_CHARS: "²"}, "stepline.gateway.size.chars is '²', not a whole number"),  # isdigit() yet not int()
    ({d.IN_FLIGHT: "٣"}, "stepline.gateway.in_flight is '٣', not a whole number"),
    ({d.SIZE_BYTES: "9" * 5000}, "stepline.gateway.size.bytes is '99999"),  # more digits than int() converts
    ({d.LANE: "x" * 1025}, "stepline.gateway.lane is over the 1024-byte limit for ids and names (1025 characters)"),
    ({d.CANDIDATES: ["a", "é" * 513]}, "stepline.gateway.candidates is over the 1024-byte limit"),  # 1026 bytes
])
def test_a_bad_attribute_is_refused_naming_it(attrs: dict[str, Any], reason: str) -> None:
    with pytest.raises(DecisionRejected, match=reason.replace("(", r"\(").replace(")", r"\)")):
        to_decision({d.REQUEST_ID: "r1", **attrs}, ARRIVAL_NS, FINISH_NS, "g", "h")


def test_whole_numbers_may_come_as_ascii_digit_strings() -> None:
    row = to_decision({d.SIZE_CHARS: " 340112 ", d.FIRST_BYTE: "0" * 30 + str(FINISH_NS), d.REQUEST_ID: "é" * 512},
                      ARRIVAL_NS, FINISH_NS, "g", "h")
    assert (row.size_chars, row.first_byte_ts, row.request_id) == (340_112, (FINISH_NS + 500) // 1000, "é" * 512)


def test_an_over_long_id_or_gateway_name_refuses_the_span_rather_than_merge_it() -> None:
    with pytest.raises(DecisionRejected, match=r"^decision 'r{64}': stepline.gateway.request_id is over the 1024-byte "
                                               r"limit for ids and names \(7000000 characters\)$"):
        to_decision({d.REQUEST_ID: "r" * 7_000_000}, ARRIVAL_NS, FINISH_NS, "g", "h")
    with pytest.raises(DecisionRejected, match=r"the resource's gateway name is over the 1024-byte limit for ids and "
                                               r"names \(2000 characters\)"):
        to_decision({}, ARRIVAL_NS, FINISH_NS, "g" * 2000, "h")
    assert to_decision({d.GATEWAY: "router"}, ARRIVAL_NS, FINISH_NS, "g" * 2000, "h").gateway == "router"


def test_backends_are_named_as_engines_are() -> None:
    assert backend_engine("http://127.0.0.1:8000/v1") == "127.0.0.1:8000"
    assert backend_engine("https://vllm.internal/v1") == "vllm.internal:443"
    # As the engine scraped from that URL is named, so that a decision joins its engine (IPv6 too).
    for url in ("http://[::1]:9000/v1", "http://127.0.0.1:8000", "https://vllm.internal/v1"):
        assert backend_engine(url) == VllmMetricsSource(url, SourceContext("h", ManualClock())).engine
    assert backend_engine("heavy-0") == "heavy-0"


def test_the_real_sdk_sends_decisions_beside_vllm_spans(receiver: OtlpReceiver) -> None:  # noqa: F811
    bad = {**MONSTER, d.REQUEST_ID: "req-8", d.THRESHOLD_UNIT: "words"}
    export(receiver.url, [(d.DECISION_SPAN, MONSTER), (d.DECISION_SPAN, bad), ("other", {})],
           resource={"service.name": "router-a"})
    rows: list[Row] = drain(receiver)
    assert rows == [to_decision(MONSTER, ARRIVAL_NS, FINISH_NS, "router-a", "h1")]
    stats = receiver.stats()
    assert (stats["spans_accepted"], stats["spans_rejected"], stats["spans_ignored"]) == (1, 1, 1)


def _received(addresses: EngineAddresses) -> GatewayDecision:
    """MONSTER's decision as a collector that knows these engine addresses stores it."""
    named = OtlpReceiver(SourceContext("h1", ManualClock(), engine_addresses=addresses), port=0)
    named.start()
    try:
        export(named.url, [(d.DECISION_SPAN, MONSTER)], resource={"service.name": "router-a"})
        [row] = drain(named)
    finally:
        named.stop()
    assert isinstance(row, GatewayDecision)
    return row


def test_a_backend_is_named_as_the_collector_names_the_engine_there() -> None:
    """`--engine fast=http://10.0.0.5:8000`: the router's decisions for http://10.0.0.5:8000/v1 are fast's, and join
    fast's requests (queries/gateway.py joins on the engine's name)."""
    row = _received(EngineAddresses(("fast=http://10.0.0.5:8000/metrics",)))
    assert (row.engine, row.candidates, row.backend_engines) == ("fast", ["fast", "10.0.0.6:8000"], ())


def test_a_backend_that_stands_for_several_engines_keeps_its_name_and_says_who_is_behind_it() -> None:
    """`--backend 10.0.0.5:8000=fast-0 --backend 10.0.0.5:8000=fast-1`: a service in front of two replicas."""
    row = _received(EngineAddresses((), {("10.0.0.5", 8000): ("fast-0", "fast-1")}))
    assert (row.engine, row.backend_engines) == ("10.0.0.5:8000", ("fast-0", "fast-1"))


def test_one_bad_decision_in_a_batch_rejects_only_itself(receiver: OtlpReceiver) -> None:  # noqa: F811
    unicode_digit = {**MONSTER, d.REQUEST_ID: "req-8", d.SIZE_CHARS: "²"}
    huge_id = {**MONSTER, d.REQUEST_ID: "r" * 7_000_000}
    long_text = {**MONSTER, d.REQUEST_ID: "req-9", d.SWALLOWED: "E" * 5000}
    export(receiver.url, [(d.DECISION_SPAN, MONSTER), (d.DECISION_SPAN, unicode_digit), (d.DECISION_SPAN, huge_id),
                          (d.DECISION_SPAN, long_text)], resource={"service.name": "router-a"}, batched=True)
    rows = drain(receiver)
    assert [r.request_id for r in rows if isinstance(r, GatewayDecision)] == ["req-7", "req-9"]
    assert rows[1] == to_decision(long_text, ARRIVAL_NS, FINISH_NS, "router-a", "h1")
    assert len(rows[1].swallowed_exception) == 2000  # free text is cut, and counted
    stats = receiver.stats()
    assert (stats["spans_accepted"], stats["spans_rejected"], stats["spans_truncated"]) == (2, 2, 1)
    assert stats["requests_accepted"] == 1


def test_decisions_are_stored_and_read_back(store: Store) -> None:
    now_ns = time.time_ns()
    rows = [to_decision({**MONSTER, d.FIRST_BYTE: now_ns + 1}, now_ns, now_ns + 5, "router", "h1"),
            to_decision({d.LANE: "fast", d.SWALLOWED: "ValueError: x"}, now_ns, now_ns, "router", "h1")]
    rows[0] = rows[0]._replace(backend_engines=("fast-0", "fast-1"))
    store.insert("gateway_decisions", rows, GatewayDecision._fields)
    got = store.query("SELECT engine, lane, size_chars, threshold_unit, swallowed_exception, first_byte_ts IS NULL, "
                      "backend_engines FROM gateway_decisions ORDER BY lane, size_chars").result_rows
    assert [tuple(r) for r in got] == [("10.0.0.5:8000", "fast", 340_112, "chars", "", 0, ["fast-0", "fast-1"]),
                                       ("", "fast", None, "", "ValueError: x", 1, [])]  # NULL sizes sort last
