"""`stepline whatif` as text: how a figure is printed, decode-rate ranges, the replays' envelope and the report's
section without a result (the whole table from a real recording: test_core.py)."""

from __future__ import annotations

import math

from stepline.whatif.figures import Objectives, Served, figures
from stepline.whatif.render import FIGURE_NAMES, envelope, html_section, rate_range, seconds


def test_seconds_print_as_milliseconds_under_one_and_say_what_is_unknown() -> None:
    assert [seconds(x) for x in (0.0421, 1.5, 12.345, 250.4)] == ["42ms", "1.50s", "12.35s", "250s"]
    assert seconds(math.nan) == "-" and seconds(math.inf) == "open"


def test_a_decode_rate_range_is_p10_to_p90_of_its_band() -> None:
    served = [Served(500, 11, 0.1, d) for d in (0.5, 1.0, 2.0)]  # 20, 10 and 5 tokens/s
    f = figures(served, [], Objectives(1.0, 0.1), span_s=1.0)
    assert rate_range(f, "<1k") == "6.0-18.0" and rate_range(f, ">=128k") == "-"


def test_the_envelope_is_the_lowest_and_highest_replay_in_each_bucket() -> None:
    low, high = envelope([[(0.0, 1.0), (10.0, 5.0)], [(0.0, 3.0), (20.0, 2.0)], []])
    assert low == [(0.0, 1.0), (10.0, 5.0), (20.0, 2.0)]
    assert high == [(0.0, 3.0), (10.0, 5.0), (20.0, 2.0)]
    assert envelope([]) == ([], [])


def test_the_reports_section_says_why_there_is_no_result_escaped() -> None:
    section = html_section(None, "no <steps> in the window")
    assert section == "<h2>What each lever would buy</h2><p>Not available: no &lt;steps&gt; in the window</p>"
    assert set(FIGURE_NAMES) == {"ttft_p50_s", "ttft_p99_s", "itl_p99_s", "goodput_rps"}
