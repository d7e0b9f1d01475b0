"""`stepline demo`: what its options choose, and the one length the README and the help give it."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

from stepline.app import demo as demo_library
from stepline.cli import demo

README = Path(__file__).resolve().parents[2] / "README.md"


def parse_args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    demo.add_arguments(parser)
    return parser.parse_args(list(argv))


def test_the_readme_and_help_give_the_demo_one_length() -> None:
    workload = demo_library.workload_for()
    length = f"about {workload.duration_s + workload.drain_s:.0f} s"
    parser = argparse.ArgumentParser()
    demo.add_arguments(parser)
    assert length in " ".join(parser.format_help().split())
    try_it = README.read_text(encoding="utf-8").split("## Try it", 1)[1].split("\n## ", 1)[0]
    prose = " ".join(try_it.split())
    assert length in prose
    assert "about a minute" not in prose and not re.search(r"\b(60|120) s\b", prose)


def test_the_options_default_to_the_short_burst_in_real_time_on_power_capped_gpus() -> None:
    args = parse_args()
    assert (args.fast, args.workload, args.duration, args.scrape_interval, args.gpu_scenario) == (
        False, None, None, None, "power-cap")
    fast = parse_args("--fast", "--gpu-scenario", "xid", "--duration", "30")
    assert (fast.fast, fast.gpu_scenario, fast.duration) == (True, "xid", 30.0)
    assert demo_library.workload_for(args.workload, fast=args.fast).name == "short-burst"
    assert demo_library.workload_for(fast.workload, fast=fast.fast).name == "burst"
