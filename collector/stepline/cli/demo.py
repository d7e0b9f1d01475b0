"""`stepline demo`: the simulator under a burst, collected into the embedded store, then summarised and diagnosed."""

from __future__ import annotations

import argparse

HELP = "simulate a burst and collect it into the embedded store"
DESCRIPTION = ("Start the simulator and the collector, run the burst workload, then print a summary and the "
               "diagnosis from SQL.")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The store, real time or --fast, the workload and the simulated GPUs."""
    from stepline.app.demo import DEFAULT_GPU_SCENARIO, FAST_WORKLOAD, REALTIME_WORKLOAD
    from stepline.sim.gpu import SCENARIOS
    from stepline.sim.workloads import SHORT_BURST_DRAIN_S, SHORT_BURST_DURATION_S, WORKLOAD_NAMES

    parser.add_argument("--store", help="store URL (default: $STEPLINE_STORE, else chdb://./stepline-data)")
    parser.add_argument("--fast", action="store_true",
                        help=f"replay the full 10-minute {FAST_WORKLOAD} on a virtual clock in seconds, stamped as "
                             f"if it had just happened, instead of the {REALTIME_WORKLOAD} in real time "
                             f"(about {SHORT_BURST_DURATION_S + SHORT_BURST_DRAIN_S:.0f} s)")
    parser.add_argument("--workload", choices=WORKLOAD_NAMES,
                        help=f"what traffic to simulate (default: {REALTIME_WORKLOAD} in real time, "
                             f"{FAST_WORKLOAD} with --fast)")
    parser.add_argument("--duration", type=float, metavar="SECONDS",
                        help="how long requests arrive (default: the workload's nominal length; the demo then "
                             "waits for the engine to drain)")
    parser.add_argument("--scrape-interval", type=float, metavar="SECONDS",
                        help="scrape interval (default 1 s in real time, 5 s with --fast)")
    parser.add_argument("--gpu-scenario", choices=SCENARIOS, default=DEFAULT_GPU_SCENARIO,
                        help="what the simulated GPUs do: follow the load (normal), also hit a power cap during "
                             "prefill so clocks drop (power-cap, the default), or also report an XID error (xid)")
    parser.add_argument("--gateway", action="store_true",
                        help="with --fast: replay the seed's gateway story instead (a size router in front of a fast "
                             "and a heavy lane: dense-JSON monsters measured in characters slip onto the fast lane, "
                             "then the heavy lane's slots leak on client disconnects until it refuses everything)")


def run(args: argparse.Namespace) -> int:
    """Run the demo; 0."""
    from stepline.app.demo import run_demo, workload_for
    from stepline.store.url import default_store_url

    if args.gateway:
        if not args.fast or args.workload or args.duration:
            raise SystemExit("stepline demo: --gateway replays its own ten minutes on a virtual clock: give --fast, "
                             "and no --workload or --duration (not yet in real time)")
        from stepline.drills.gateway import run_demo as run_gateway_demo

        run_gateway_demo(args.store or default_store_url())
        return 0
    workload = workload_for(args.workload, fast=args.fast, duration_s=args.duration)
    run_demo(args.store or default_store_url(), workload, fast=args.fast, scrape_interval_s=args.scrape_interval,
             gpu_scenario=args.gpu_scenario)
    return 0
