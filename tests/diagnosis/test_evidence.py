"""A finding's evidence in words: named lines, rounded figures with units, folded findings, whatif intervals."""

from __future__ import annotations

import math
from datetime import UTC, datetime

import pytest

from stepline.diagnosis.evidence import Line, evidence_of, figure, interval

# The shape of a merged finding's evidence as the detectors, causes.merge and whatif/offer.annotate make it (the
# figures of `stepline demo`'s monster prefill).
EVIDENCE = {
    "request_id": "burst-000646", "uncached_tokens": 359000, "step_p50_inside_ms": 1151.4,
    "itl_p99_inside_s": 1.397, "itl_p99_outside_s": 0.04, "step_slowdown": "122.2x (interference from 5x)",
    "own_steps_share": 0.977, "first_chunk_after_queue_end_s": -0.271,
    "symptoms": [{"kind": "head_of_line_blocking", "severity": "warning", "title": "131 requests queued",
                  "request_s": 4878.0, "queue_max_s": 49.6, "longest_queued": ["a 49.6s", "b 49.4s"]}],
    "whatif": {"lever": "long_prefill_token_threshold=512", "goodput_delta": 0.1643, "itl_p99_s": 0.2896,
               "ttft_p99_s": 13.6633, "reproduces": True, "knife_edge": False,
               "intervals": {"ttft_p50_s": {"value": 0.1163412086196646, "low": 0.0926999802578763,
                                            "high": 0.783583077846103},
                             "goodput_rps": {"value": 0.7975683989294919, "low": 0.6654558420516007,
                                             "high": None},
                             "decode_p50 1k-8k": {"value": 9.963600685109267, "low": 8.466473019805239,
                                                  "high": 11.90816267613319}}},
}


def test_each_figure_is_a_named_line_rounded_with_its_unit() -> None:
    said = evidence_of(EVIDENCE)
    assert said.lines == (
        Line("request_id", "burst-000646"), Line("uncached_tokens", "359,000"),
        Line("step_p50_inside_ms", "1,151 ms"), Line("itl_p99_inside_s", "1.4 s"),
        Line("itl_p99_outside_s", "40 ms"), Line("step_slowdown", "122.2x (interference from 5x)"),
        Line("own_steps_share", "97.7%"), Line("first_chunk_after_queue_end_s", "-271 ms"))


def test_a_folded_finding_keeps_its_title_and_figures_as_lines_of_its_own() -> None:
    (folded,) = evidence_of(EVIDENCE).folded
    assert (folded.kind, folded.severity, folded.title) == ("head_of_line_blocking", "warning", "131 requests queued")
    assert folded.lines == (Line("request_s", "4,878 s"), Line("queue_max_s", "49.6 s"),
                            Line("longest_queued", "a 49.6s, b 49.4s"))


def test_whatif_is_its_lever_then_each_figure_as_value_low_high() -> None:
    assert evidence_of(EVIDENCE).whatif == (
        Line("lever", "long_prefill_token_threshold=512"), Line("goodput_delta", "+16.4%"),
        Line("reproduces", "yes (the replay reproduces the recording)"),
        Line("ttft_p50_s", "116 ms [92.7-784]"), Line("goodput_rps", "0.798/s [0.665/s-open]"),
        Line("decode_p50 1k-8k", "9.96 tok/s [8.47-11.9]"))
    # Without replays' intervals (--replays 0), the bare figures.
    bare = evidence_of({"whatif": {"lever": "max_num_seqs=128", "itl_p99_s": 0.7767, "ttft_p99_s": 49.6,
                                   "reproduces": False, "knife_edge": True, "intervals": None}}).whatif
    assert [line.text for line in bare[1:]] == [
        "no (the replay does not reproduce the recording: a direction, not an amount)", "yes (at a capacity cliff)",
        "49.6 s", "777 ms"]


@pytest.mark.parametrize(("name", "value", "text"), [
    ("sm_mhz_max", 1980, "1,980 MHz"), ("gpu_util_pct", 5.0, "5%"), ("power_w", 700.0, "700 W"),
    ("alone_tok_s", 106.93, "107 tok/s"), ("served_rate_per_s", 2.5, "2.5/s"), ("hit_rate_usual", 0.974, "97.4%"),
    ("kv_usage_max", 0.993, "99.3%"), ("waiting", 12, "12"), ("itl_over_step_inside", 0.72, "0.72"),
    ("bucket_s", 120, "120 s"), ("reasons", ["sw_power_cap", "hw_slowdown"], "sw_power_cap, hw_slowdown"),
    ("under_load_by_band", {"< 1k": "2.3..4.7 tok/s", ">= 100k": "3.0..6.9 tok/s"},
     "< 1k: 2.3..4.7 tok/s; >= 100k: 3.0..6.9 tok/s"),
    ("legitimately_slow", True, "yes"), ("acceptance_min", math.nan, "-"), ("seconds_since_last_step", 0.0, "0 s"),
    ("first", datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC), "2026-01-02 03:04:05 UTC"), ("missing", None, "-"),
])
def test_figures(name: str, value: object, text: str) -> None:
    assert figure(name, value) == text


def test_an_interval_says_its_unit_once_unless_its_ends_change_unit() -> None:
    assert interval("ttft_p99_s", 13.66, 12.99, 14.07) == "13.7 s [13-14.1]"
    assert interval("itl_p99_s", 0.9, 0.5, 1.2) == "900 ms [500 ms-1.2 s]"
    assert interval("itl_p99_s", 0.9, 0.5, math.inf) == "900 ms [500 ms-open]"
