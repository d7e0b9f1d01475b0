"""`stepline whatif`: fit the engine's step cost, check the replay against the recording, price every lever."""

from __future__ import annotations

import argparse
import json
import sys
import time

from stepline.cli.diagnose import add_window_arguments, window_of
from stepline.config.slo import Slo
from stepline.whatif.intervals import INTERVAL_REPLAYS, nominal_coverage

HELP = "what each scheduler lever would buy, replayed on the recorded window"
DESCRIPTION = ("Fits the engine's step cost from its recorded steps (error on held-out steps), replays the window's "
               "requests through the simulator's scheduler under the recorded settings (the calibration check, "
               "beside the recording) and under each lever: chunk threshold, token budget, max_num_seqs, prefill "
               "interval, priority, shape-sharding, deadline-aware chunks. TTFT, ITL, decode rates and goodput, "
               "ranked.")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The window, goodput's objectives (the alert configuration's SLO by default), and the replays."""
    add_window_arguments(parser)
    slo = Slo()
    parser.add_argument("--ttft", type=float, default=slo.ttft_p99_seconds, metavar="SECONDS",
                        help="goodput's time-to-first-token objective (default: the alert configuration's TTFT "
                             "SLO, %(default)s s)")
    parser.add_argument("--tpot", type=float, default=slo.tpot_seconds, metavar="SECONDS",
                        help="goodput's mean time-per-output-token objective, also the deadline-aware policy's "
                             "(default: the alert configuration's, %(default)s s)")
    parser.add_argument("--chars-per-token", type=float, metavar="N",
                        help="your prompts' characters per token, to give shape-sharding thresholds in characters "
                             "(the store holds no prompt text); where a gateway's decisions are in the window, its "
                             "own bar and measured units per token are used instead")
    parser.add_argument("--jobs", type=int, help="replays run in parallel (default: one per CPU)")
    parser.add_argument("--replays", type=int, default=INTERVAL_REPLAYS, metavar="N",
                        help="perturbed replays of each plan beside its central one, for each figure's interval and "
                             "the knife-edge and tie verdicts (default %(default)s: nominal coverage "
                             f"{round(100 * nominal_coverage(INTERVAL_REPLAYS + 1))}%%; 0: no intervals, ten times "
                             "faster)")
    parser.add_argument("--json", action="store_true", help="print the result as JSON")


def run(args: argparse.Namespace) -> int:
    """0 when priced; 2 when the window cannot be replayed."""
    from stepline.core.usageerror import UsageError
    from stepline.store.reader import open_located
    from stepline.whatif.core import WhatIfError, whatif
    from stepline.whatif.figures import Objectives
    from stepline.whatif.render import as_json, render
    from stepline.whatif.router import router_bars
    from stepline.whatif.trace import load

    if not (args.ttft > 0 and args.tpot > 0):
        raise UsageError(f"--ttft and --tpot must be positive, got {args.ttft} and {args.tpot}")
    if args.replays < 0:
        raise UsageError(f"--replays must be 0 or more, got {args.replays}")
    window = window_of(args)
    started = time.monotonic()
    reader = open_located(args.store)[0]
    try:
        traces = load(reader.client, window)
        bars = router_bars(reader.client, window)  # a gateway's bar in front, to price sharding in its unit
    finally:
        reader.close()
    try:
        result = whatif(traces, Objectives(args.ttft, args.tpot), chars_per_token=args.chars_per_token,
                        jobs=args.jobs, bars=bars, replays=args.replays)
    except WhatIfError as exc:
        print(f"stepline whatif: {exc} ({window.start:%H:%M:%S}..{window.end:%H:%M:%S} UTC)", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(as_json(result), indent=2))
    else:
        print(render(result))
        print(f"\n({len(result.levers)} levers in {time.monotonic() - started:.1f}s, via {reader.via})")
    return 0
