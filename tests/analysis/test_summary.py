"""The demo's per-minute summary: quantiles of vLLM's histograms exactly as Prometheus computes them, marked when
a figure is only a bucket bound or lies in a coarse bucket."""

from __future__ import annotations

import math
from datetime import UTC, datetime
from typing import Any

import pytest

from stepline.analysis.summary import MinuteSummary, Quantile, bucket_quantile, histogram_quantile, per_minute, render

INF = math.inf
TTFT = "vllm:time_to_first_token_seconds_bucket"
ITL = "vllm:inter_token_latency_seconds_bucket"
MINUTE = datetime(2026, 1, 2, 3, 4, tzinfo=UTC)


@pytest.mark.parametrize(
    ("q", "buckets", "expected"),
    [
        # Without a +Inf bucket Prometheus has no answer (the total is unknown).
        (0.5, [(1, 5), (2, 10)], None),
        # Only the +Inf bucket: fewer than two buckets, no answer.
        (0.5, [(INF, 5)], None),
        # Buckets of one bound are merged before the search.
        (0.5, [(1, 2), (1, 3), (INF, 5)], 0.5),
        # Counts made monotonic (the envelope): the dip at 3 counts as 6, so rank 7 lies in (3, 4].
        (0.875, [(1, 2), (2, 6), (3, 4), (4, 8), (INF, 8)], 3.5),
        # A first bucket bounded at or below 0 answers its bound.
        (0.2, [(-1, 5), (1, 10), (INF, 10)], -1.0),
    ],
)
def test_histogram_quantile_is_prometheus_bucket_quantile(q: float, buckets: list[tuple[float, float]],
                                                          expected: float | None) -> None:
    found = histogram_quantile(q, buckets)
    if expected is None:
        assert found is None
    else:
        assert found == pytest.approx(expected)


def test_a_quantile_knows_its_bucket() -> None:
    # Linear inside the bucket: rank 61.38 of 62, 51 of them in (40, 80].
    inside = bucket_quantile(0.99, [(20, 0), (40, 11), (80, 62), (160, 62), (INF, 62)])
    assert inside is not None and inside.value == pytest.approx(40 + 40 * (61.38 - 11) / 51)
    assert (inside.lower, inside.upper) == (40, 80) and inside.coarse and not inside.capped
    first = bucket_quantile(0.5, [(1, 10), (2, 10), (INF, 10)])  # the first bucket starts at 0
    assert first == Quantile(0.5, 0.0, 1) and first.coarse
    fine = bucket_quantile(0.5, [(0.075, 0), (0.1, 10), (INF, 10)])
    assert fine is not None and fine.value == pytest.approx(0.0875) and not fine.coarse
    past = bucket_quantile(0.99, [(10, 5), (2560, 80), (INF, 100)])
    assert past == Quantile(2560, 2560, INF) and past.capped and not past.coarse
    assert bucket_quantile(0.5, [(1, 0), (INF, 0)]) is None and bucket_quantile(1.5, [(1, 5), (INF, 5)]) is None


def _minute(itl: Quantile | None, ttft: Quantile | None) -> MinuteSummary:
    return MinuteSummary(MINUTE, 12.0, 100.0, 3, itl, ttft, 1.0, 2.0, 0.5, 0)


def test_render_marks_a_coarse_bucket_and_a_bound() -> None:
    text = render([_minute(Quantile(0.0875, 0.075, 0.1), Quantile(79.5, 40, 80)),
                   _minute(Quantile(0.5, 0.5, INF), Quantile(2560, 2560, INF))])
    lines = text.splitlines()
    assert lines[1].split()[3:5] == ["88ms", "79.5s*"]  # ITL within (75, 100] ms stands alone; TTFT does not
    assert lines[2].split()[3:5] == [">500ms", ">2560.0s"]
    notes = " ".join(lines[3:])
    assert "in its bucket (TTFT 40-80s)" in notes
    assert "past the histogram's last finite bucket" in notes and "(03:04 ITL, 03:04 TTFT)" in notes
    assert all(len(line) <= 80 for line in lines)
    plain = render([_minute(Quantile(0.0875, 0.075, 0.1), None)])
    assert len(plain.splitlines()) == 2 and "*" not in plain and plain.splitlines()[1].split()[4] == "-"


class _Rows:
    def __init__(self, columns: tuple[str, ...], rows: list[tuple[Any, ...]]) -> None:
        self.column_names, self.result_rows = columns, rows


class _Reader:
    """Answers the two summary queries with hand-made rows, under the columns' names the queries give them."""

    def __init__(self, buckets: list[tuple[Any, ...]], minutes: list[tuple[Any, ...]]) -> None:
        self._buckets, self._minutes = buckets, minutes

    def query(self, sql: str, parameters: dict[str, Any] | None = None) -> _Rows:
        if "labels['le']" in sql:
            return _Rows(("minute", "metric", "le", "n"), self._buckets)
        return _Rows(("minute", "gen", "prompt", "finished", "waiting", "running", "kv", "preempted", "covered_s"),
                     self._minutes)


def test_per_minute_reads_the_quantiles_from_the_buckets() -> None:
    ttft = [(20.0, 0), (40.0, 11), (80.0, 62), (160.0, 62), (INF, 62)]
    reader = _Reader([(MINUTE, TTFT, le, n) for le, n in ttft] + [(MINUTE, ITL, 0.01, 3)],
                     [(MINUTE, 600.0, 6000.0, 62, 0.0, 48.0, 0.75, 0, 59.0)])
    (minute,) = per_minute(reader, "e")
    assert minute.ttft_p99 is not None and minute.ttft_p99.value == pytest.approx(79.51, abs=0.01)
    assert minute.itl_p99 is None  # no +Inf bucket: no answer rather than a made-up one
    assert "79.5s*" in render([minute])
