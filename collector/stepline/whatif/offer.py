"""What `whatif` adds to a diagnosis: for a finding with a lever, what the best of its levers would buy."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import replace

from stepline.config.slo import Slo
from stepline.diagnosis.findings import Finding, Window
from stepline.store.reads import Reads
from stepline.whatif.core import Priced, WhatIf, whatif
from stepline.whatif.figures import Objectives
from stepline.whatif.render import seconds
from stepline.whatif.trace import load

# The lever families that answer each finding kind (diagnosis/causes.py names the kinds).
FAMILIES = {
    "prefill_interference": ("long_prefill_token_threshold", "max_num_batched_tokens", "deadline_chunk", "shard"),
    "head_of_line_blocking": ("shard", "policy", "long_prefill_token_threshold", "max_num_batched_tokens"),
    "overload": ("max_num_seqs", "max_num_batched_tokens", "policy", "shard"),
    "kv_pressure": ("max_num_seqs", "max_num_batched_tokens"),
}


# diagnose --whatif and report price the window beside everything else they do: 1 + 4 replays a plan (intervals of
# nominal coverage 67%, which they print), half the time of `stepline whatif`'s own 1 + 9. Each replay costs ~4 s per
# 1,000 requests of the window (benchmarks/RESULTS.md, whatif speed), so a busy hour is minutes at 10.
OFFER_REPLAYS = 4


def price_window(reader: Reads, window: Window) -> WhatIf:
    """`whatif` over the window with the alert configuration's objectives, as diagnose and report offer it;
    WhatIfError when the window cannot be replayed."""
    slo = Slo()
    return whatif(load(reader, window), Objectives(slo.ttft_p99_seconds, slo.tpot_seconds), replays=OFFER_REPLAYS)


def best_for(result: WhatIf, kind: str) -> Priced | None:
    """The best-ranked available lever of the families that answer `kind`, or None."""
    families = FAMILIES.get(kind)
    if not families:
        return None
    return next((p for p in result.ranked() if p.replay is not None and p.lever.family in families), None)


def summary(result: WhatIf, priced: Priced) -> str:
    """One line: what the lever buys against the replayed baseline, and how far to trust it."""
    assert priced.replay is not None
    base, f = result.baseline.figures, priced.replay.figures
    delta = priced.delta(base)
    bands = priced.bands() if priced.spread else {}
    sure = ""
    if "goodput_rps" in bands and base.goodput_rps > 0:
        band = bands["goodput_rps"]
        sure = f" [{band.low / base.goodput_rps - 1:+.0%}..{band.high / base.goodput_rps - 1:+.0%}]"
    gain = "" if math.isnan(delta) else (f"goodput {delta:+.0%}{sure} ({base.goodput_rps:.2f} -> "
                                         f"{f.goodput_rps:.2f}/s), ")
    trust = ("the replay reproduces the recording" if result.reproduces else
             "the replay does not reproduce the recording: a direction, not an amount")
    if priced.knife_edge:
        trust += f"; knife-edge: {priced.knife_edge}"
    return (f"whatif: {priced.lever.name} gives {gain}ITL p99 {seconds(base.itl_p99_s)} -> {seconds(f.itl_p99_s)}, "
            f"TTFT p99 {seconds(base.ttft_p99_s)} -> {seconds(f.ttft_p99_s)} ({trust})")


def annotate(findings: Sequence[Finding], result: WhatIf) -> list[Finding]:
    """The findings, those with a lever family extended by what its best lever would buy (evidence['whatif'])."""
    out = []
    for f in findings:
        priced = best_for(result, f.kind) if f.lever else None
        if priced is None or (f.engine and f.engine not in result.engines):
            out.append(f)
            continue
        line = summary(result, priced)
        assert priced.replay is not None
        evidence = {**f.evidence, "whatif": {"lever": priced.lever.name, "goodput_delta": round(
            priced.delta(result.baseline.figures), 4), "itl_p99_s": round(priced.replay.figures.itl_p99_s, 4),
            "ttft_p99_s": round(priced.replay.figures.ttft_p99_s, 4), "reproduces": result.reproduces,
            "knife_edge": bool(priced.knife_edge),
            "intervals": {k: b.as_json() for k, b in priced.bands().items()} if priced.spread else None}}
        out.append(replace(f, lever=f"{f.lever}. {line}", evidence=evidence))
    return out
