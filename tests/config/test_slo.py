"""The Slo: the thresholds dashboards draw and alerts page on, and the objectives, unique by name."""

from __future__ import annotations

import pytest

from stepline.config.objectives import DEFAULT_OBJECTIVES, Objective
from stepline.config.slo import Slo


def test_the_defaults_are_the_documented_starting_points() -> None:
    slo = Slo()
    assert (slo.itl_p99_seconds, slo.itl_p99_critical_seconds, slo.ttft_p99_seconds, slo.tpot_seconds) == (
        0.1, 1.0, 10.0, 0.1)
    assert slo.objectives == DEFAULT_OBJECTIVES


def test_latency_objectives_read_the_slo_thresholds_unless_they_name_their_own() -> None:
    slo = Slo(ttft_p99_seconds=2.0, tpot_seconds=0.04,
              objectives=(Objective("ttft", "ttft"), Objective("tight", "ttft", threshold_seconds=0.5),
                          Objective("tpot", "tpot"), Objective("up", "availability"),
                          Objective("first_byte", "gateway_first_byte", scope="tenant")))
    assert [slo.threshold(o) for o in slo.objectives] == [2.0, 0.5, 0.04, 0.0, 2.0]  # the first byte: TTFT's


def test_objective_names_are_unique() -> None:
    with pytest.raises(ValueError, match="objective names repeat: a, a, b"):
        Slo(objectives=(Objective("a", "ttft"), Objective("b", "ttft"), Objective("a", "tpot")))
