"""Does diagnosis name the known cause? Replays every scenario into a store and checks the top finding.

    python benchmarks/diagnosis_eval.py [--scenario NAME ...]

Each scenario (stepline.drills.scenarios) is replayed fast into a database of its own in a temporary
embedded store, then `diagnose` runs over the scenario's window. Prints a match table, then a
TARGET MISSED line for each scenario whose top finding is not the expected kind, and for any
finding above info on a scenario where nothing is wrong. Always exits 0: a report, not a gate.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from collections.abc import Callable, Sequence
from typing import Any

from stepline.core.texttable import render_table
from stepline.diagnosis.findings import Finding, Window
from stepline.drills.scenarios import SCENARIO_NAMES, Scenario, make_scenario, run_scenario
from stepline.store.reader import open_reader

Diagnose = Callable[[Any, Window], list[Finding]]


def load_diagnose() -> Diagnose | None:
    """The detectors' entry point, or None while they are not written yet."""
    try:
        from stepline.diagnosis.detectors import diagnose
    except ImportError:
        return None
    return diagnose


def above_info(findings: Sequence[Finding]) -> list[Finding]:
    """Findings an operator would be paged or warned about."""
    return [f for f in findings if f.severity != "info"]


def matches(scenario: Scenario, findings: Sequence[Finding]) -> bool:
    """Top finding is the expected kind; with nothing expected, no finding above info."""
    if scenario.expected_kind is None:
        return not above_info(findings)
    return bool(findings) and findings[0].kind == scenario.expected_kind


def evaluate(names: Sequence[str], store_dir: str) -> tuple[list[list[str]], list[str]]:
    """Run each scenario into `store_dir` and diagnose it; returns table rows and TARGET MISSED lines."""
    diagnose = load_diagnose()
    if diagnose is None:
        print("detectors not available yet (no stepline.diagnosis.detectors.diagnose): replaying the scenarios only")
    rows: list[list[str]] = []
    missed: list[str] = []
    for name in names:
        scenario = make_scenario(name)
        url = f"chdb://{store_dir}?database=eval_{name}"
        started = time.monotonic()
        engine, window = run_scenario(scenario, url)
        replay_s = time.monotonic() - started
        expected = scenario.expected_kind or "(nothing above info)"
        if diagnose is None:
            rows.append([name, expected, "-", "-", "-", "n/a", f"{replay_s:.1f}"])
            continue
        reader = open_reader(url)
        try:
            findings = sorted(diagnose(reader.client, window), key=Finding.rank_key)
        finally:
            reader.close()
        top = findings[0] if findings else None
        ok = matches(scenario, findings)
        rows.append([name, expected, top.kind if top else "-", top.severity if top else "-",
                     top.title if top else "-", "yes" if ok else "NO", f"{replay_s:.1f}"])
        if not ok:
            got = f"{top.kind} ({top.severity})" if top else "no finding"
            missed.append(f"TARGET MISSED {name}: expected {expected}, top finding {got}")
        if scenario.expected_kind is None:
            missed += [f"TARGET MISSED {name}: {f.severity} {f.kind}: {f.title}" for f in above_info(findings)]
        elif len(findings) > 1:
            print(f"{name} ({engine}): also " + "; ".join(f"{f.severity} {f.kind}" for f in findings[1:]))
    return rows, missed


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--scenario", action="append", choices=SCENARIO_NAMES,
                        help="run only this scenario (repeatable; default: all)")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="stepline-eval-") as store_dir:
        rows, missed = evaluate(args.scenario or SCENARIO_NAMES, store_dir)
    print()
    print(render_table(["scenario", "expected", "top finding", "severity", "title", "match", "replay s"], rows,
                       max_width=76))
    for line in missed:
        print(line)
    scored = [r for r in rows if r[5] != "n/a"]
    if scored:
        print(f"\n{sum(r[5] == 'yes' for r in scored)}/{len(scored)} scenarios matched")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
