"""Is `stepline whatif` right? Its predictions against the simulator's ground truth.

    python benchmarks/whatif_validation.py [--cases short-burst,steady-hot,burst,two-engines] [--tpot 0.1]

For each case: record a run under settings A through the normal path (plugin datagrams, OTLP spans, /metrics
into the embedded store), run `whatif` on the recording (the fit, the calibration, every lever), then run the
same workload again under each of a set of levers, for real, through the same path, and read it back with the
same code. Prints, per lever, the predicted and the measured TTFT p99, ITL p99 and goodput with the error; per
case, whether the levers rank the same; then the share of figures within 15% (the target) and the worst.
Always exits 0: a report, not a gate.
"""

from __future__ import annotations

import argparse
import math
import tempfile
import time
import uuid
from dataclasses import replace
from datetime import UTC, datetime, timedelta

import clickhouse_connect

from stepline.core.texttable import render_table
from stepline.diagnosis.findings import Window
from stepline.drills.scenarios import Scenario, run_engines
from stepline.sim.config import EngineConfig
from stepline.sim.workloads import Workload, make_workload, short_burst, steady
from stepline.store.reader import open_reader
from stepline.whatif.core import Priced, lanes, whatif
from stepline.whatif.figures import Figures, Objectives
from stepline.whatif.levers import Lever
from stepline.whatif.trace import EngineTrace, Steps, TracedRequest, load

TOLERANCE = 0.15
FIGURES = (("ttft_p99_s", "TTFT p99"), ("itl_p99_s", "ITL p99"), ("goodput_rps", "goodput"))
# The levers run for real in each case (by family; the first of each family whatif offers, and every shard).
TRUTH = ("long_prefill_token_threshold", "max_num_batched_tokens", "max_num_seqs", "prefill_schedule_interval",
         "policy", "deadline_chunk", "shard")
PER_FAMILY = 2

Case = list[tuple[str, Workload, EngineConfig]]


def cases() -> dict[str, Case]:
    return {
        "short-burst": [("e0", short_burst(seed=1), EngineConfig())],
        # chat at ~3x the load steady() is written for, on a small KV cache: queueing and preemption
        "steady-hot": [("e0", steady(seed=2, duration_s=90.0, rate_per_s=12.0),
                        EngineConfig(num_gpu_blocks=12_000, max_num_seqs=64))],
        "burst": [("e0", make_workload("burst"), EngineConfig())],
        # Both 30 s of arrivals and 45 s of drain: the recording aligns engines by their end (run_engines), the
        # truth below by their start, and equal spans make the two the same.
        "two-engines": [("e0", short_burst(seed=3), EngineConfig()),
                        ("e1", replace(steady(seed=4, duration_s=30.0, rate_per_s=8.0), drain_s=45.0),
                         EngineConfig())],
    }


def record(base: str, engines: list[tuple[str, Scenario]]) -> list[EngineTrace]:
    url = f"{base}?database=v_{uuid.uuid4().hex[:10]}"
    runs, window = run_engines(engines, url)
    del runs
    reader = open_reader(url)
    try:
        wide = Window(window.start - timedelta(seconds=1), window.end + timedelta(seconds=1))
        return load(reader.client, wide)
    finally:
        reader.close()


def _pseudo_traces(case: Case, t0: float) -> list[EngineTrace]:
    """The case's own workloads as traces, so a routing lever re-routes the true arrivals."""
    out = []
    for engine, workload, _ in case:
        requests = [TracedRequest(a.request_id, t0 + a.offset_s, t0 + a.offset_s, 0.0, 0.0, 0.0, a.prompt_tokens,
                                  int(a.prompt_tokens * a.cached_fraction), a.output_tokens, a.finish_reason,
                                  a.max_tokens) for a in workload.arrivals]
        out.append(EngineTrace(engine, {}, requests, Steps()))
    return out


def truth(base: str, case: Case, lever: Lever) -> Figures:
    t0 = 0.0
    plan = lanes(_pseudo_traces(case, t0), [c for _, _, c in case], lever, t0)
    engines = []
    for (engine, workload, _), lane in zip(case, plan, strict=True):
        w = Workload(workload.name, workload.duration_s, workload.drain_s, lane.arrivals)
        engines.append((engine, Scenario(f"truth-{engine}", None, w, lane.config)))
    traces = record(base, engines)
    return whatif(traces, OBJECTIVES, levers=[], jobs=1).recorded


def _err(predicted: float, actual: float) -> float:
    if actual == 0:
        return 0.0 if predicted == 0 else math.inf
    return predicted / actual - 1.0


TIE = 0.02  # goodputs this close (relative) rank as equals: a pair of them is in order either way


def _kendall(a: list[float], b: list[float]) -> float:
    """Share of lever pairs the prediction orders as the runs do (ties either side count as in order)."""
    def tied(x: float, y: float) -> bool:
        return abs(x - y) <= TIE * max(abs(x), abs(y), 1e-9)

    pairs = concordant = 0
    for i in range(len(a)):
        for j in range(i + 1, len(a)):
            pairs += 1
            concordant += tied(a[i], a[j]) or tied(b[i], b[j]) or (a[i] - a[j]) * (b[i] - b[j]) > 0
    return concordant / pairs if pairs else 1.0


OBJECTIVES = Objectives(10.0, 0.1)


def main() -> int:
    global OBJECTIVES
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", default=",".join(cases()))
    parser.add_argument("--ttft", type=float, default=10.0)
    parser.add_argument("--tpot", type=float, default=0.1)
    args = parser.parse_args()
    OBJECTIVES = Objectives(args.ttft, args.tpot)
    chosen = [c.strip() for c in args.cases.split(",") if c.strip()]
    all_errors: list[float] = []
    rankings: list[str] = []
    with tempfile.TemporaryDirectory(prefix="stepline-whatif-") as directory:
        base = f"chdb://{directory}"
        anchor = clickhouse_connect.get_client(dsn=base)
        for name in chosen:
            case = cases()[name]
            started = time.monotonic()
            recorded = record(base, [(e, Scenario(f"a-{e}", None, w, c)) for e, w, c in case])
            result = whatif(recorded, OBJECTIVES)
            predicted_s = time.monotonic() - started
            families: dict[str, int] = {}
            tested: list[Priced] = []
            for p in result.levers:
                if p.replay is None or p.lever.family not in TRUTH:
                    continue
                if families.get(p.lever.family, 0) >= PER_FAMILY:
                    continue
                families[p.lever.family] = families.get(p.lever.family, 0) + 1
                tested.append(p)
            rows = []
            predicted_goodput, actual_goodput = [], []
            errors = result.calibration_errors
            print(f"\n== {name}: {result.recorded.requests} requests on {len(case)} engine(s); fit median error "
                  + ", ".join(f"{f.median_error:.1%}" for f in result.fits.values())
                  + "; calibration " + ", ".join(f"{k} {v:+.1%}" for k, v in errors.items())
                  + f" (recorded and priced in {predicted_s:.0f} s)")
            for p in tested:
                assert p.replay is not None
                actual = truth(base, case, p.lever)
                pf = p.replay.figures
                row = [p.lever.name]
                for attr, _ in FIGURES:
                    e = _err(getattr(pf, attr), getattr(actual, attr))
                    all_errors.append(e)
                    row += [f"{getattr(pf, attr):.3f}", f"{getattr(actual, attr):.3f}", f"{e:+.1%}"]
                rows.append(row)
                predicted_goodput.append(pf.goodput_rps)
                actual_goodput.append(actual.goodput_rps)
            header = ["lever"] + [f"{label} {k}" for _, label in FIGURES for k in ("pred", "run", "err")]
            print(render_table(header, rows, max_width=40))
            tau = _kendall(predicted_goodput, actual_goodput)
            order_p = sorted(range(len(tested)), key=lambda i: -predicted_goodput[i])
            order_a = sorted(range(len(tested)), key=lambda i: -actual_goodput[i])
            same = tau == 1.0
            rankings.append(f"{name}: {'same ranking' if same else 'ranking differs'} (pairs concordant "
                            f"{tau:.0%}; best predicted {tested[order_p[0]].lever.name if tested else '-'}, "
                            f"best run {tested[order_a[0]].lever.name if tested else '-'})")
            print(rankings[-1])
        anchor.close()
    within = sum(1 for e in all_errors if abs(e) <= TOLERANCE)
    print(f"\n{datetime.now(UTC):%Y-%m-%d}: {within}/{len(all_errors)} predicted figures within "
          f"{TOLERANCE:.0%} of the run ({within / max(1, len(all_errors)):.0%}); worst "
          f"{max(all_errors, key=abs):+.1%}" if all_errors else "no figures")
    for line in rankings:
        print(line)
    if all_errors and within < len(all_errors):
        print(f"TARGET MISSED: {len(all_errors) - within} figures outside {TOLERANCE:.0%}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
