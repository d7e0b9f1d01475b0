"""How long `stepline whatif` takes, and how it grows with the requests in the window.

    python benchmarks/whatif_scale.py [--store chdb://./stepline-data] [--scales 1,4,16] [--jobs 2]

Records the 10-minute demo burst (`stepline demo --fast`: 658 requests, ~7k steps) into a fresh embedded store
(or reads the window of --store), then prices every lever over the window tiled 1x, 4x and 16x in time (copies
of its requests and steps one after another, so the load and the engine's state repeat). Prints per scale: the
requests, steps and levers, the seconds the store read, the fit and the replays took, and seconds per 1,000
requests, whose flatness is linear scaling. Target: the 1x burst with >= 8 levers in < 30 s on 2 cores.
Always exits 0: a report, not a gate.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from datetime import UTC, datetime, timedelta

from stepline.core.texttable import render_table
from stepline.diagnosis.findings import Window
from stepline.store.reader import open_reader
from stepline.whatif.core import whatif
from stepline.whatif.figures import Objectives
from stepline.whatif.trace import EngineTrace, Steps, load

TARGET_S = 30.0
MIN_LEVERS = 8


def tiled(trace: EngineTrace, times: int) -> EngineTrace:
    """`trace` repeated `times` times, each copy after the last one's end."""
    first = min([r.arrival for r in trace.requests] + trace.steps.ts[:1])
    last = max([r.finished for r in trace.requests] + trace.steps.ts[-1:])
    period = last - first + 1.0
    requests = [replace(r, request_id=f"{r.request_id}~{k}", arrival=r.arrival + k * period,
                        finished=r.finished + k * period) for k in range(times) for r in trace.requests]
    s = trace.steps
    steps = Steps([t + k * period for k in range(times) for t in s.ts], s.elapsed_s * times, s.ctx_tokens * times,
                  s.gen_requests * times, s.gen_tokens * times, s.in_flight_after * times, s.itls * times)
    return EngineTrace(trace.engine, trace.config, requests, steps)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--store", help="read this store's last --since instead of recording the demo burst")
    parser.add_argument("--since", default="6h")
    parser.add_argument("--scales", default="1,4,16")
    parser.add_argument("--jobs", type=int, default=None)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="stepline-whatif-scale-") as directory:
        store = args.store or f"chdb://{directory}/store"
        if not args.store:
            started = time.monotonic()
            subprocess.run([sys.executable, "-m", "stepline", "demo", "--fast", "--store", store], check=True,
                           capture_output=True, timeout=900)
            print(f"recorded the demo burst in {time.monotonic() - started:.0f} s")
        now = datetime.now(UTC)
        from stepline.core.timeparse import parse_duration

        window = Window(now - timedelta(seconds=parse_duration(args.since)), now)
        reader = open_reader(store)
        try:
            started = time.monotonic()
            traces = load(reader.client, window)
            read_s = time.monotonic() - started
        finally:
            reader.close()
    rows = []
    first_s = None
    for scale in (int(x) for x in args.scales.split(",")):
        t = [tiled(tr, scale) for tr in traces]
        started = time.monotonic()
        result = whatif(t, Objectives(10.0, 0.1), jobs=args.jobs)
        took = time.monotonic() - started
        requests = sum(len(tr.requests) for tr in t)
        priced = sum(1 for p in result.levers if p.replay is not None)
        if first_s is None:
            first_s = took + read_s
        rows.append([f"{scale}x", f"{requests:,}", f"{sum(len(tr.steps) for tr in t):,}", str(priced),
                     f"{read_s:.2f}" if scale == 1 else "-", f"{took:.1f}", f"{took / requests * 1000:.2f}",
                     "yes" if result.reproduces else "NO"])
    print(render_table(["scale", "requests", "steps", "levers priced", "store read s", "whatif s",
                        "s per 1k requests", "replay reproduces"], rows))
    if first_s is not None and (first_s >= TARGET_S or int(rows[0][3]) < MIN_LEVERS):
        print(f"TARGET MISSED: the 1x window took {first_s:.1f} s with {rows[0][3]} levers (target < {TARGET_S:.0f} s "
              f"with >= {MIN_LEVERS})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
