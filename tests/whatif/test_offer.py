"""What `diagnose --whatif` and the report add to a finding: the best of its levers, replayed on the recorded window
(a short burst recorded through the normal path into the embedded store)."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from dataclasses import replace
from datetime import timedelta
from pathlib import Path

import pytest

from stepline.config.slo import Slo
from stepline.diagnosis.findings import Finding, Window
from stepline.sim.config import EngineConfig
from stepline.store.reader import open_reader
from stepline.whatif.core import WhatIf, WhatIfError
from stepline.whatif.figures import Objectives
from stepline.whatif.offer import FAMILIES, annotate, best_for, price_window, summary
from tests.whatif.test_core import Recorded, _record


@pytest.fixture(scope="module")
def recorded(chdb_dir: Path) -> Recorded:
    return _record(f"chdb://{chdb_dir}?database=t_offer_{uuid.uuid4().hex[:8]}", EngineConfig())


@pytest.fixture(scope="module")
def priced(recorded: Recorded) -> Iterator[WhatIf]:
    reader = open_reader(recorded.store_url)
    try:
        yield price_window(reader.client, recorded.window)
    finally:
        reader.close()


def test_the_window_is_priced_against_the_slo(priced: WhatIf) -> None:
    slo = Slo()
    assert priced.objectives == Objectives(slo.ttft_p99_seconds, slo.tpot_seconds)
    assert priced.engines == ["whatif"] and priced.reproduces


def test_a_window_with_nothing_to_replay_says_so(recorded: Recorded) -> None:
    earlier = Window(recorded.window.start - timedelta(days=1), recorded.window.start - timedelta(hours=23))
    reader = open_reader(recorded.store_url)
    try:
        with pytest.raises(WhatIfError, match="nothing to replay"):
            price_window(reader.client, earlier)
    finally:
        reader.close()


@pytest.mark.parametrize("kind", sorted(FAMILIES))
def test_the_best_lever_for_a_kind_is_the_best_ranked_of_its_families(priced: WhatIf, kind: str) -> None:
    best = best_for(priced, kind)
    candidates = [p for p in priced.ranked() if p.replay is not None and p.lever.family in FAMILIES[kind]]
    assert best is not None and best is candidates[0]


def test_a_kind_no_lever_answers_has_none(priced: WhatIf) -> None:
    assert best_for(priced, "gpu_xid") is None
    assert best_for(priced, "wedged_engine") is None


def test_the_summary_says_what_the_lever_buys_and_how_far_to_trust_it(priced: WhatIf) -> None:
    best = best_for(priced, "prefill_interference")
    assert best is not None and best.replay is not None
    line = summary(priced, best)
    base, after = priced.baseline.figures, best.replay.figures
    band = best.bands()["goodput_rps"]
    assert line.startswith(f"whatif: {best.lever.name} gives goodput {best.delta(base):+.0%} "
                           f"[{band.low / base.goodput_rps - 1:+.0%}..{band.high / base.goodput_rps - 1:+.0%}] "
                           f"({base.goodput_rps:.2f} -> {after.goodput_rps:.2f}/s), ITL p99 ")
    assert band.low <= after.goodput_rps <= band.high
    assert line.endswith("(the replay reproduces the recording)")
    stopped = replace(priced, baseline=replace(priced.baseline, stopped="step limit"))
    assert summary(stopped, best).endswith("(the replay does not reproduce the recording: a direction, not an amount)")
    no_goodput = replace(priced, baseline=replace(priced.baseline, figures=replace(base, goodput_rps=0.0)))
    assert "goodput" not in summary(no_goodput, best)  # no baseline goodput: no ratio to give


def test_annotate_extends_the_findings_a_lever_answers(priced: WhatIf, recorded: Recorded) -> None:
    w = recorded.window

    def finding(kind: str, engine: str = "whatif", lever: str = "bound the chunks") -> Finding:
        return Finding(kind, "warning", engine, w.start, w.end, f"{kind} title", {"figure": 1}, lever=lever)

    prefill, xid, elsewhere, bare = (finding("prefill_interference"), finding("gpu_xid"),
                                     finding("prefill_interference", engine="other"),
                                     finding("prefill_interference", lever=""))
    annotated = annotate([prefill, xid, elsewhere, bare], priced)
    best = best_for(priced, "prefill_interference")
    assert best is not None and best.replay is not None
    assert annotated[0].lever == f"bound the chunks. {summary(priced, best)}"
    assert annotated[0].evidence == {"figure": 1, "whatif": {
        "lever": best.lever.name, "goodput_delta": round(best.delta(priced.baseline.figures), 4),
        "itl_p99_s": round(best.replay.figures.itl_p99_s, 4), "ttft_p99_s": round(best.replay.figures.ttft_p99_s, 4),
        "reproduces": True, "knife_edge": False, "intervals": {k: b.as_json() for k, b in best.bands().items()}}}
    # No lever family for an XID, an engine the replay did not cover, a finding with no lever: left as they were.
    assert annotated[1:] == [xid, elsewhere, bare]
