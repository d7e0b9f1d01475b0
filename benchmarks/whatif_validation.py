"""Is `stepline whatif` right? Its predictions against the simulator's ground truth.

    python benchmarks/whatif_validation.py [--cases short-burst,steady-hot,burst,two-engines] [--tpot 0.1]
    python benchmarks/whatif_validation.py --family shaped [--seeds 6] [--seed0 0]
    python benchmarks/whatif_validation.py --family cliff [--seeds 2] [--seed0 0]

`--family shaped`: truths whose step cost is not of the fit's linear form (sim.costmodel.ShapedCostModel: tile
quantisation of prefill, a per-chunk cost, decode batching that is not linear, a context term that grows
faster than linear, multiplicative step jitter; drawn per seed, on a drawn workload). Reports the coverage of
whatif's intervals (the share of true figures inside their predicted [low, high]) against their nominal
coverage, the median interval width, and whether pairs of levers whose goodput intervals separate run in the
predicted order.

`--family cliff`: two engines under such a cost (one fixed shape, its jitter seeded), each serving cached chat and
uncached documents, so many that the shard lever's long lane, which takes every document over the bar, sits near
its capacity: the case where a cost a little off tips a lane from draining to queueing without end.

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
import random
import statistics
import tempfile
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime, timedelta

from stepline.core.texttable import render_table
from stepline.diagnosis.findings import Window
from stepline.drills.scenarios import Scenario, run_engines
from stepline.sim.config import EngineConfig
from stepline.sim.costmodel import ShapedCostModel
from stepline.sim.workloads import Workload, chat_arrivals, compose, make_workload, short_burst, steady
from stepline.store.chdb import open_client
from stepline.store.reader import open_reader
from stepline.whatif.core import Priced, lanes, whatif
from stepline.whatif.figures import Figures, Objectives
from stepline.whatif.intervals import INTERVAL_REPLAYS, Band, bands, nominal_coverage
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


def shaped_cases(seeds: Sequence[int]) -> dict[str, Case]:
    """One case per seed: a drawn workload on an engine whose step cost is drawn off the linear form."""
    out: dict[str, Case] = {}
    for seed in seeds:
        rng = random.Random(seed)
        cost = ShapedCostModel(prefill_tile=rng.choice((0, 256, 512, 2048)), chunk_overhead_s=rng.uniform(0.0, 0.03),
                               decode_batch_exponent=rng.uniform(0.7, 1.3),
                               context_knee_tokens=rng.choice((0, 65_536, 262_144)),
                               jitter=rng.choice((0.0, 0.1, 0.25)), seed=seed)
        workload = rng.choice([short_burst(seed=seed),
                               steady(seed=seed, duration_s=60.0, rate_per_s=rng.uniform(6.0, 14.0))])
        config = EngineConfig(cost=cost, num_gpu_blocks=rng.choice((12_000, 40_000)),
                              max_num_seqs=rng.choice((64, 256)))
        out[f"shaped-{seed}"] = [("e0", workload, config)]
    return out


# The cliff family's truth: a step cost the fit's linear form misses (a 512-token prefill tile, 20 ms per step
# carrying prefill, a context knee at 64k, 10% jitter), under which the long lane's steps cost more than the fit of
# the mixed recording says; and documents at CLIFF_DOCS_PER_S on each engine, which put that lane near its capacity.
CLIFF_DOCS_PER_S = 1.2
CLIFF_CHAT_PER_S = 4.0
CLIFF_DURATION_S = 60.0


def cliff_cases(seeds: Sequence[int]) -> dict[str, Case]:
    """One two-engine case per seed: chat and documents on each, the shard lever's long lane near its capacity."""
    out: dict[str, Case] = {}
    for seed in seeds:
        cost = ShapedCostModel(prefill_tile=512, chunk_overhead_s=0.02, context_knee_tokens=65_536, jitter=0.1,
                               seed=seed)
        engines: Case = []
        for k in range(2):
            chat = chat_arrivals(f"chat{k}", 0.0, CLIFF_DURATION_S, CLIFF_CHAT_PER_S, seed=seed, prompt_median=1200,
                                 output_median=150, cached=(0.85, 0.95), max_prompt=8000)
            docs = chat_arrivals(f"doc{k}", 0.0, CLIFF_DURATION_S, CLIFF_DOCS_PER_S, seed=seed, prompt_median=6000,
                                 output_median=60, cached=(0.0, 0.05), max_prompt=32_768)
            # Equal spans on both engines: the recording aligns engines by their end, the truth by their start.
            engines.append((f"e{k}", compose("cliff", CLIFF_DURATION_S, 60.0, chat, docs), EngineConfig(cost=cost)))
        out[f"cliff-{seed}"] = engines
    return out


def describe(case: Case) -> str:
    cost = case[0][2].cost
    if not isinstance(cost, ShapedCostModel):
        return "linear cost"
    return (f"tile {cost.prefill_tile}, chunk +{cost.chunk_overhead_s * 1e3:.0f} ms, decode n^"
            f"{cost.decode_batch_exponent:.2f}, context knee {cost.context_knee_tokens or '-'}, jitter "
            f"{cost.jitter:g}")


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


def _lane(p: Priced) -> str:
    """The busiest lane of the lever's central replay and its load; where its headroom is short of its fit's error,
    that error, and whether the interval is open-ended."""
    assert p.replay is not None
    busiest = p.replay.busiest
    if busiest is None:
        return "-"
    text = f"{busiest[0]} {busiest[1]:.0%}"
    for h in p.headroom:
        text += f"; {h.engine} x{1 + h.error:.2f}: {h.load * (1 + h.error):.0%}"  # the load at the fit's error
    if p.dearer is not None and any(math.isinf(b.high) for b in p.bands().values()):
        text += ", open"
    return text


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


@dataclass
class Coverage:
    """Over every tested lever (and the recorded settings) of every case: true figures inside their interval."""

    inside: dict[str, int] = field(default_factory=dict)
    total: dict[str, int] = field(default_factory=dict)
    widths: list[float] = field(default_factory=list)
    separated: int = 0
    separated_agree: int = 0
    misses: list[str] = field(default_factory=list)

    def add(self, label: str, predicted: dict[str, Band], actual: Figures) -> str:
        marks = []
        for name in INTERVAL_FIGURES:
            band, true = predicted[name], float(getattr(actual, name))
            if math.isnan(true) or math.isnan(band.low):
                continue
            # Equal within the figures' own rounding: goodput's span is the arrivals' span as each side stored it.
            hit = band.low * (1 - ROUNDING) <= true <= band.high * (1 + ROUNDING)
            self.inside[name] = self.inside.get(name, 0) + hit
            self.total[name] = self.total.get(name, 0) + 1
            if band.value and math.isfinite(band.high):  # an open-ended interval (knife-edge) has no width
                self.widths.append((band.high - band.low) / abs(band.value))
            marks.append("in" if hit else "OUT")
            if not hit:
                self.misses.append(f"{label} {name}: {true:.3f} outside [{band.low:.3f}, {band.high:.3f}]")
        return " ".join(marks)

    def pairs(self, bands: list[Band], actual: list[float]) -> None:
        for i in range(len(bands)):
            for j in range(i + 1, len(bands)):
                if bands[i].overlaps(bands[j]):
                    continue
                self.separated += 1
                self.separated_agree += (bands[i].value - bands[j].value) * (actual[i] - actual[j]) > 0


INTERVAL_FIGURES = ("ttft_p50_s", "ttft_p99_s", "itl_p99_s", "goodput_rps")
ROUNDING = 1e-4


def _scheduled(config: EngineConfig, async_scheduling: bool) -> EngineConfig:
    if not async_scheduling:
        return config
    return replace(config, async_scheduling=True, host_overhead_s=0.75 * config.cost.step_overhead_s)


def main() -> int:
    global OBJECTIVES
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", default=",".join(cases()))
    parser.add_argument("--family", choices=("linear", "shaped", "cliff"), default="linear",
                        help="the named cases (linear step cost), truths drawn off the fit's form per seed, or two "
                             "engines whose shard lever puts a lane near its capacity")
    parser.add_argument("--seeds", type=int, default=6, help="shaped or cliff truths to draw (--family shaped, cliff)")
    parser.add_argument("--seed0", type=int, default=0)
    parser.add_argument("--replays", type=int, default=INTERVAL_REPLAYS, help="whatif's perturbed replays")
    parser.add_argument("--ttft", type=float, default=10.0)
    parser.add_argument("--tpot", type=float, default=0.1)
    parser.add_argument("--async-scheduling", action="store_true",
                        help="record the engines scheduling asynchronously, as vLLM 0.33 does on GPUs (their host "
                             "overhead 3/4 of the fixed step cost); the truths run as they would")
    args = parser.parse_args()
    OBJECTIVES = Objectives(args.ttft, args.tpot)
    seeds = range(args.seed0, args.seed0 + args.seeds)
    every = cases() if args.family == "linear" else shaped_cases(seeds) if args.family == "shaped" \
        else cliff_cases(seeds)
    chosen = [c.strip() for c in args.cases.split(",") if c.strip()] if args.family == "linear" else list(every)
    coverage = Coverage()  # the levers' intervals as whatif gives them (widened by the calibration's misses)
    raw = Coverage()  # the same, not widened: the replays' spread alone
    calibration = Coverage()  # the recording against the replayed baseline's own intervals
    all_errors: list[float] = []
    rankings: list[str] = []
    edged: list[tuple[str, bool]] = []  # each knife-edge lever's in/OUT marks, and whether its interval is open
    with tempfile.TemporaryDirectory(prefix="stepline-whatif-") as directory:
        base = f"chdb://{directory}"
        anchor = open_client(directory)  # the process's first client: the engine starts with stepline's profile
        for name in chosen:
            case = every[name]
            started = time.monotonic()
            recorded = record(base, [(e, Scenario(f"a-{e}", None, w, _scheduled(c, args.async_scheduling)))
                                     for e, w, c in case])
            result = whatif(recorded, OBJECTIVES, replays=args.replays)
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
            print(f"\n== {name} ({describe(case)}): {result.recorded.requests} requests on {len(case)} engine(s); "
                  "fit median error " + ", ".join(f"{f.median_error:.1%}" for f in result.fits.values())
                  + ", held-out total " + ", ".join(f"{f.total_error:+.1%}" for f in result.fits.values())
                  + ", form " + ", ".join(f"{f.form_error:.1%}" for f in result.fits.values())
                  + "; calibration " + ", ".join(f"{k} {v:+.1%}" for k, v in errors.items())
                  + f" (recorded and priced in {predicted_s:.0f} s)")
            marks = calibration.add(f"{name} recorded settings", result.baseline_bands(), result.recorded) \
                if result.baseline_spread else ""
            if marks:
                print(f"recorded settings: the recording against the baseline's intervals: {marks}; widened by "
                      + (", ".join(f"{k} {v:.0%}" for k, v in result.misses().items()) or "nothing"))
            goodput_bands: list[Band] = []
            for p in tested:
                assert p.replay is not None
                actual = truth(base, case, p.lever)
                pf = p.replay.figures
                row = [p.lever.name + (" (knife-edge)" if p.knife_edge else "")]
                for attr, _ in FIGURES:
                    e = _err(getattr(pf, attr), getattr(actual, attr))
                    all_errors.append(e)
                    row += [f"{getattr(pf, attr):.3f}", f"{getattr(actual, attr):.3f}", f"{e:+.1%}"]
                row.append(_lane(p))
                if p.spread:
                    marks = coverage.add(f"{name} {p.lever.name}", p.bands(), actual)
                    row.append(marks)
                    if p.knife_edge:
                        edged.append((marks, any(math.isinf(b.high) for b in p.bands().values())))
                    raw.add(f"{name} {p.lever.name}", bands(pf, [r.figures for r in p.spread]), actual)
                    goodput_bands.append(p.bands()["goodput_rps"])
                rows.append(row)
                predicted_goodput.append(pf.goodput_rps)
                actual_goodput.append(actual.goodput_rps)
            if goodput_bands:
                coverage.pairs(goodput_bands, actual_goodput)
            header = ["lever"] + [f"{label} {k}" for _, label in FIGURES for k in ("pred", "run", "err")] + [
                "busiest lane (load; at the edge: x cost error)"] + (
                ["in interval (TTFT p50, p99, ITL p99, goodput)"] if goodput_bands else [])
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
    if coverage.total:
        inside, total = sum(coverage.inside.values()), sum(coverage.total.values())
        nominal = nominal_coverage(args.replays + 1)
        print(f"\nintervals over {args.replays + 1} replays (nominal coverage {nominal:.0%}): "
              f"{inside}/{total} true figures inside ({inside / total:.0%}); "
              + ", ".join(f"{k} {coverage.inside.get(k, 0)}/{v}" for k, v in coverage.total.items())
              + f"; median width {statistics.median(coverage.widths):.1%} of the value"
              + f"; levers whose goodput intervals separate: {coverage.separated_agree}/{coverage.separated} pairs "
                "run in the predicted order")
        for miss in coverage.misses:
            print(f"  outside: {miss}")
        edge_marks = [m for each, _ in edged for m in each.split()]
        print(f"knife-edge levers: {len(edged)}, {sum(o for _, o in edged)} of them open-ended; their true figures "
              f"inside: {edge_marks.count('in')}/{len(edge_marks)}")
        for label, other in (("the replays' spread alone (not widened)", raw),
                             ("the recordings against the replayed baseline's intervals", calibration)):
            if other.total:
                got, of = sum(other.inside.values()), sum(other.total.values())
                print(f"{label}: {got}/{of} inside ({got / of:.0%}); "
                      + ", ".join(f"{k} {other.inside.get(k, 0)}/{v}" for k, v in other.total.items()))
    if all_errors and within < len(all_errors):
        print(f"TARGET MISSED: {len(all_errors) - within} figures outside {TOLERANCE:.0%}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
