"""How often does diagnosis name the injected cause? Replays generated cases and scores the top finding.

    python benchmarks/diagnosis_generated.py [--cases 200] [--seed0 0] [--jobs 2] [--seed N ...]
        [--family engines|engines-async|gateway]

Each case (stepline.drills.generator.generate(seed)) is replayed into a database of its own in a temporary
embedded store and diagnosed over its window (all engines). Prints top-1 accuracy overall and per cause,
a confusion matrix (truth x top finding kind), how often the top finding names the right engine, false
warnings/criticals (on healthy and legitimately slow cases, and on engines nothing was injected into), the
worst misses with their seeds (`--seed N` replays one), and timing. Always exits 0: a report, not a gate.
"""

from __future__ import annotations

import argparse
import multiprocessing
import tempfile
import time
from collections import Counter, defaultdict
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor

from stepline.core.texttable import render_table
from stepline.diagnosis.detectors import diagnose
from stepline.diagnosis.findings import Finding
from stepline.drills.gateway import GATEWAY_CAUSE_NAMES, generate_gateway, replay
from stepline.drills.generator import CAUSE_NAMES, REPLAY_LEAD_S, Judged, Verdict, generate, judge, run_case
from stepline.store.reader import open_reader
from stepline.store.store import Store

Result = tuple[Verdict, str, float, float, list[str]]  # verdict, description, replay s, diagnose s, findings


# engines-async: the engines' cases on engines that schedule asynchronously (vLLM 0.33's default on GPUs).
FAMILIES = {"engines": CAUSE_NAMES, "engines-async": CAUSE_NAMES, "gateway": GATEWAY_CAUSE_NAMES}


def run_one(seed: int, store_dir: str, family: str = "engines") -> Result:
    """Replay and diagnose the case of `seed` (of `family`) in its own database under `store_dir`."""
    url = f"chdb://{store_dir}?database=gen_{family.replace('-', '_')}_{seed}"
    started = time.monotonic()
    case: Judged
    if family == "gateway":
        case = generate_gateway(seed)
        window = replay(case.case, url, end_at=time.time() + REPLAY_LEAD_S)[2]
    else:
        case = generate(seed, async_scheduling=family == "engines-async")
        window = run_case(case, url)
    replayed = time.monotonic()
    reader = open_reader(url)
    try:
        findings = sorted(diagnose(reader.client, window), key=Finding.rank_key)
    finally:
        reader.close()
    # Every case's parts merge in the background: dropped, they no longer slow the next cases.
    store = Store.open(url)
    store.client.command(f"DROP DATABASE IF EXISTS `{store.database}`")
    store.close()
    diagnosed = time.monotonic()
    shown = [f"{f.severity} {f.kind}@{f.engine}: {f.title}" for f in findings[:4]]
    return judge(case, findings), case.description, replayed - started, diagnosed - replayed, shown


def _run_chunk(seeds: Sequence[int], family: str = "engines") -> list[Result]:
    """One worker's seeds, in a store of its own (chDB allows one embedded store per process)."""
    with tempfile.TemporaryDirectory(prefix="stepline-generated-") as store_dir:
        return [run_one(seed, store_dir, family) for seed in seeds]


def evaluate(seeds: Sequence[int], jobs: int, family: str = "engines") -> list[Result]:
    if jobs <= 1:
        return _run_chunk(seeds, family)
    chunks = [list(seeds[i::jobs]) for i in range(jobs)]
    # Spawned, not forked: a forked child inherits the parent's threads' locks (and chDB's) mid-flight.
    with ProcessPoolExecutor(max_workers=jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
        results = [r for chunk in pool.map(_run_chunk, chunks, [family] * len(chunks)) for r in chunk]
    return sorted(results, key=lambda r: r[0].seed)


def _pct(n: int, d: int) -> str:
    return f"{n}/{d} ({100 * n / d:.0f}%)" if d else "-"


def report(results: Sequence[Result], wall_s: float, jobs: int, family: str = "engines") -> None:
    verdicts = [r[0] for r in results]
    print(f"top-1 accuracy: {_pct(sum(v.correct for v in verdicts), len(verdicts))}")
    caused = [v for v in verdicts if v.truth_kind is not None]
    right = sum(v.right_engine for v in caused)
    print(f"right engine (top finding on the injected engine): {_pct(right, len(caused))}")
    rows = []
    for cause in FAMILIES[family]:
        mine = [v for v in verdicts if v.cause == cause]
        if mine:
            tops = Counter(v.top_kind or "-" for v in mine).most_common(2)
            rows.append([cause, mine[0].truth_kind or "(nothing above info)", _pct(sum(v.correct for v in mine),
                         len(mine)), ", ".join(f"{k} {n}" for k, n in tops)])
    print()
    print(render_table(["cause", "expected top finding", "top-1", "most common top finding"], rows, max_width=60))

    kinds = sorted({v.top_kind or "-" for v in verdicts})
    matrix: dict[str, Counter[str]] = defaultdict(Counter)
    for v in verdicts:
        matrix[v.truth_kind or "none"][v.top_kind or "-"] += 1
    print("\nconfusion matrix (rows: truth kind; columns: top finding kind, '-' none)")
    short = {k: k[:14] for k in kinds}
    print(render_table(["truth \\ top", *(short[k] for k in kinds)],
                       [[truth, *(str(matrix[truth][k] or "") for k in kinds)] for truth in sorted(matrix)],
                       max_width=22))

    quiet = [v for v in verdicts if v.truth_kind is None]
    alarmed = [v for v in quiet if v.false_alarms]
    print(f"\nfalse warnings/criticals on healthy and legitimately slow cases: {_pct(len(alarmed), len(quiet))} cases")
    for kind, n in Counter(a.split("@")[0] for v in quiet for a in v.false_alarms).most_common():
        print(f"  {n:3d}  {kind}")
    bystanders = Counter(a.split("@")[0] for v in caused for a in v.false_alarms)
    print(f"false warnings/criticals on bystander engines of cause cases: {sum(bystanders.values())}")
    for kind, n in bystanders.most_common():
        print(f"  {n:3d}  {kind}")

    misses = [r for r in results if not r[0].correct]
    # Worst first: a confident wrong answer (critical/warning) outranks a missing one.
    rank = {"critical": 0, "warning": 1, "info": 2, None: 3}
    misses.sort(key=lambda r: (rank[r[0].top_severity], r[0].cause, r[0].seed))
    print(f"\nworst misses ({len(misses)} in all; replay one with --seed N):")
    for verdict, description, _, _, shown in misses[:25]:
        got = f"{verdict.top_severity} {verdict.top_kind}@{verdict.top_engine}" if verdict.top_kind else "no finding"
        print(f"  seed {verdict.seed}: {verdict.cause} -> {got}")
        print(f"      {description[:150]}")
        for line in shown[:3]:
            print(f"      | {line[:140]}")

    replay = [r[2] for r in results]
    diag = [r[3] for r in results]
    print(f"\ntiming: {len(results)} cases in {wall_s:.0f}s wall with {jobs} job(s); per case replay "
          f"mean {sum(replay) / len(replay):.1f}s max {max(replay):.1f}s, diagnose mean {sum(diag) / len(diag):.2f}s "
          f"max {max(diag):.1f}s")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--cases", type=int, default=200, help="how many consecutive seeds (default 200)")
    parser.add_argument("--seed0", type=int, default=0, help="the first seed (default 0)")
    parser.add_argument("--seed", type=int, action="append", help="run only this seed (repeatable)")
    parser.add_argument("--jobs", type=int, default=1, help="cases replayed in parallel processes (default 1)")
    parser.add_argument("--family", choices=tuple(FAMILIES), default="engines",
                        help="engine causes (generator.generate) or gateway causes in front of two lanes "
                             "(drills.gateway.generate_gateway); default engines")
    parser.add_argument("--verbose", action="store_true", help="print each case as it is scored")
    args = parser.parse_args(argv)
    seeds = args.seed or list(range(args.seed0, args.seed0 + args.cases))
    started = time.monotonic()
    results = evaluate(seeds, max(1, args.jobs), args.family)
    if args.verbose or args.seed:
        for verdict, description, replay_s, _, shown in results:
            print(f"seed {verdict.seed} {'ok ' if verdict.correct else 'MISS'} {description}")
            print(f"   replay {replay_s:.1f}s; findings: " + ("; ".join(shown) or "none"))
    report(results, time.monotonic() - started, max(1, args.jobs), args.family)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
