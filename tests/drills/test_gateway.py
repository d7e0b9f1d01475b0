"""`stepline demo --fast --gateway`: the seed's gateway story through the real collector, and what diagnose says."""

from __future__ import annotations

import contextlib
import io
import time
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from stepline.cli.main import main
from stepline.diagnosis.detectors import diagnose
from stepline.diagnosis.findings import Finding, Window
from stepline.drills.gateway import (
    GATEWAY_CAUSE_NAMES,
    SEED_DISCONNECTS,
    SEED_HEAVY_SLOTS,
    SEED_MONSTERS,
    generate_gateway,
    replay,
    seed_story,
)
from stepline.drills.generator import REPLAY_LEAD_S, judge
from stepline.sim.gateway import CHARS_PER_TOKEN, SimGateway
from stepline.store.store import Store


@pytest.fixture(scope="module")
def demo(chdb_dir: Path) -> Iterator[tuple[str, list[Finding], Store]]:
    """The demo's printed story, and diagnose over its store."""
    url = f"chdb://{chdb_dir}?database=gwdemo_{uuid.uuid4().hex[:8]}"
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["demo", "--fast", "--gateway", "--store", url]) == 0
    store = Store.open(url)
    now = datetime.now(UTC)
    findings = diagnose(store, Window(now - timedelta(hours=1), now))
    yield out.getvalue(), findings, store
    store.client.command(f"DROP DATABASE IF EXISTS `{store.database}`")
    store.close()


def _only(findings: list[Finding], kind: str) -> Finding:
    [found] = [f for f in findings if f.kind == kind]
    return found


def test_diagnose_names_the_leaked_slots_of_the_idle_heavy_lane_first(demo: tuple[str, list[Finding], Store]) -> None:
    _, findings, _ = demo
    top = findings[0]
    assert (top.kind, top.severity) == ("gateway_slot_leak", "critical") and top.engine.endswith("-heavy")
    assert top.evidence["leaked_slots"] == SEED_HEAVY_SLOTS and top.evidence["engine_busy_steps"] == 0
    assert top.evidence["client_disconnects"].startswith(f"{SEED_DISCONNECTS} of ")


def test_diagnose_names_the_dense_json_monsters_that_leaked_onto_the_fast_lane(
        demo: tuple[str, list[Finding], Store]) -> None:
    _, findings, _ = demo
    leak = _only(findings, "lane_leak")
    dense = [(at, tokens) for at, tokens, content in SEED_MONSTERS if tokens * CHARS_PER_TOKEN[content] < 400_000]
    assert leak.engine.endswith("-fast") and leak.evidence["leaked_requests"] == len(dense) == 2
    assert leak.evidence["lanes_leaked_onto"] == ["fast"]
    # Their prefills on the fast lane are the leak's symptoms, told once under it, not findings of their own.
    symptoms = {s["kind"] for s in leak.evidence["symptoms"]}
    assert {"prefill_interference", "head_of_line_blocking"} & symptoms
    assert not [f for f in findings if f.kind in ("prefill_interference", "head_of_line_blocking")]


def test_the_store_holds_every_decision_the_router_made(demo: tuple[str, list[Finding], Store]) -> None:
    _, _, store = demo
    gateway = SimGateway(seed_story().config)
    gateway.route(list(seed_story().requests), 600, 60)
    rows = {int(status): int(n) for status, n in
            store.query("SELECT status, count() FROM gateway_decisions GROUP BY status").result_rows}
    # Refused and disconnected heavy requests, every fast-lane request answered: none lost on the way.
    assert rows[499] == SEED_DISCONNECTS
    assert rows[429] == sum(1 for _, tokens, content in SEED_MONSTERS
                            if tokens * CHARS_PER_TOKEN[content] >= 400_000) - SEED_HEAVY_SLOTS
    assert sum(rows.values()) == len(gateway.decisions)


def test_the_demo_prints_the_story_in_the_routers_and_the_engines_terms(
        demo: tuple[str, list[Finding], Store]) -> None:
    printed, _, _ = demo
    assert "chars (under the bar) -> fast lane; the engine counted 113,402 tokens" in printed
    assert "CRITICAL  gateway_slot_leak" in printed and "lane_leak" in printed


def test_the_gateway_demo_is_a_fast_replay_only() -> None:
    with pytest.raises(SystemExit, match="give --fast"):
        main(["demo", "--gateway", "--store", "chdb:///nonexistent"])


@pytest.mark.parametrize("seed", range(len(GATEWAY_CAUSE_NAMES)))
def test_each_generated_gateway_cause_is_named_first(chdb_dir: Path, seed: int) -> None:
    """One generated case per gateway cause (the seed picks it), replayed and diagnosed; healthy lanes and a
    legitimately slow heavy lane must raise nothing above info. benchmarks/diagnosis_generated.py --family gateway
    scores many more."""
    case = generate_gateway(seed)
    url = f"chdb://{chdb_dir}?database=gwcase_{seed}_{uuid.uuid4().hex[:6]}"
    _, _, window = replay(case.case, url, end_at=time.time() + REPLAY_LEAD_S)
    store = Store.open(url)
    try:
        verdict = judge(case, sorted(diagnose(store, window), key=Finding.rank_key))
    finally:
        store.client.command(f"DROP DATABASE IF EXISTS `{store.database}`")
        store.close()
    assert verdict.cause == GATEWAY_CAUSE_NAMES[seed]
    assert verdict.correct and not verdict.false_alarms, (case.description, verdict)
