"""The figures a lever is judged by: quantiles, prompt bands, decode rates and goodput, from requests served."""

from __future__ import annotations

import json
import math

import pytest

from stepline.whatif.figures import BANDS, Objectives, Served, band, figures, quantile

OBJECTIVES = Objectives(ttft_s=1.0, tpot_s=0.05)


def test_a_request_falls_in_the_last_band_its_prompt_reaches() -> None:
    assert [band(n) for n in (0, 999, 1_000, 8_000, 31_999, 32_000, 128_000, 10**6)] == [
        "<1k", "<1k", "1k-8k", "8k-32k", "8k-32k", "32k-128k", ">=128k", ">=128k"]
    assert [name for name, _ in BANDS] == ["<1k", "1k-8k", "8k-32k", "32k-128k", ">=128k"]


def test_quantiles_interpolate_and_nothing_is_nan_not_zero() -> None:
    assert quantile([1.0, 2.0, 3.0, 4.0, 5.0], 0.5) == 3.0
    assert quantile([0.0, 10.0], 0.9) == pytest.approx(9.0)
    assert math.isnan(quantile([], 0.5))


def test_tpot_and_decode_rate_count_the_tokens_after_the_first() -> None:
    served = Served(100, 11, 0.2, 0.5)
    assert served.tpot_s == pytest.approx(0.05) and served.decode_rate == pytest.approx(20.0)
    one = Served(100, 1, 0.2, 0.0)
    assert one.tpot_s == 0.0 and one.decode_rate is None


def test_goodput_counts_requests_meeting_both_objectives_over_the_span() -> None:
    served = [Served(500, 11, 0.5, 0.4),  # good: 0.5 s to first token, 40 ms a token
              Served(500, 11, 1.5, 0.4),  # TTFT missed
              Served(20_000, 11, 0.5, 1.0),  # TPOT missed (100 ms a token)
              Served(2_000, 1, 0.9, 0.0)]  # one token: no decode to miss
    f = figures(served, [0.01, 0.02, 0.5], OBJECTIVES, span_s=2.0, unfinished=3)
    assert (f.requests, f.unfinished, f.good, f.goodput_rps) == (4, 3, 2, 1.0)
    assert f.ttft_p50_s == pytest.approx(0.7) and f.itl_p99_s == pytest.approx(0.4904)
    assert set(f.decode_rates) == {"<1k", "8k-32k"} and f.decode_rates["8k-32k"] == (10.0, 10.0, 10.0)


def test_as_json_rounds_and_says_null_for_a_figure_with_nothing_behind_it() -> None:
    f = figures([], [], OBJECTIVES, span_s=0.5)
    answer = json.loads(json.dumps(f.as_json()))
    assert answer == {"requests": 0, "unfinished": 0, "ttft_p50_s": None, "ttft_p99_s": None, "itl_p99_s": None,
                      "decode_tok_s_p10_p50_p90": {}, "good_requests": 0, "goodput_rps": 0.0}
