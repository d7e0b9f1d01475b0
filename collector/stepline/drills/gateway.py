"""The gateway's incidents, replayed: a size router in front of two simulated engines (sim/gateway.py).

`seed_story` is the seed's: a router that measures characters against a bar set from a token estimate, so dense JSON
monsters slip onto the fast lane; and heavy-lane slots released on success or failure but never on a client's
disconnect, until the heavy lane refuses everything while its GPUs sit idle. `stepline demo --fast --gateway` replays
it; `generate_gateway(seed)` draws cases of each gateway failure (and of healthy lanes) for the scored evaluation.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, replace
from typing import Any

from stepline.analysis import gateway as analysis_gateway
from stepline.app.demo import roll_up_usage
from stepline.diagnosis.detectors import summary_for_demo
from stepline.diagnosis.findings import Window
from stepline.drills.generator import draw_engine, ordinary_traffic
from stepline.drills.scenarios import Scenario, ScenarioRun, run_engines
from stepline.sim.config import EngineConfig
from stepline.sim.gateway import (
    CHARS_PER_TOKEN,
    CONTENTS,
    ESTIMATE_CHARS_PER_TOKEN,
    GatewayConfig,
    GatewayRequest,
    Lane,
    SimGateway,
)
from stepline.sim.traffic import decode_step_seconds, prefill_seconds
from stepline.sim.workloads import chat_arrivals, one_request
from stepline.store.reader import open_reader

# The seed's bar: 100,000 tokens estimated at 4 characters each, compared with characters.
SEED_BAR_TOKENS = 100_000
SEED_BAR_CHARS = SEED_BAR_TOKENS * ESTIMATE_CHARS_PER_TOKEN
SEED_DURATION_S = 600.0
SEED_DRAIN_S = 60.0
SEED_HEAVY_SLOTS = 4
# (second, prompt tokens, content) of the seed's 14 monsters: 12 documents of prose, 2 dense JSON payloads of
# ~113k tokens that measure ~340k characters, under the 400k-character bar.
SEED_MONSTERS = ((15, 180_000, "prose"), (45, 113_402, "json"), (60, 240_000, "prose"), (100, 150_000, "prose"),
                 (140, 300_000, "prose"), (185, 130_000, "prose"), (230, 359_000, "prose"), (290, 115_000, "json"),
                 (330, 200_000, "prose"), (380, 170_000, "prose"), (430, 260_000, "prose"),
                 (480, 140_000, "prose"), (530, 220_000, "prose"), (575, 190_000, "prose"))
SEED_MONSTER_OUTPUT = 400
# The heavy lane's first clients give up mid-stream (a client timeout during a long answer).
SEED_DISCONNECTS = 4
SEED_DISCONNECT_AFTER_TOKENS = 40


@dataclass(frozen=True)
class GatewayCase:
    """A gateway in front of its lane engines, and what each engine is sent (before the gateway routes it)."""

    config: GatewayConfig
    requests: tuple[GatewayRequest, ...]
    engines: tuple[tuple[str, EngineConfig], ...]
    duration_s: float
    drain_s: float
    facts: dict[str, Any]

    def scenarios(self) -> tuple[SimGateway, tuple[tuple[str, Scenario], ...]]:
        """A fresh gateway and each lane engine's scenario, its workload what the gateway routes to it."""
        gateway = SimGateway(self.config)
        workloads = gateway.route(list(self.requests), self.duration_s, self.drain_s)
        return gateway, tuple((name, Scenario(name, None, workloads[name], config)) for name, config in self.engines)


def replay(case: GatewayCase, store_url: str, *, end_at: float | None = None
           ) -> tuple[SimGateway, list[ScenarioRun], Window]:
    """Replay the case's engines behind its gateway into `store_url`: the gateway, each engine's run, the window."""
    gateway, engines = case.scenarios()
    runs, window = run_engines(engines, store_url, end_at=end_at, gateway=gateway)
    return gateway, runs, replace(window, engine="")


def seed_story(prefix: str = "lane") -> GatewayCase:
    """The seed's gateway incident over ten minutes: monsters leaking onto the fast lane, then the heavy lane wedged."""
    fast, heavy = f"{prefix}-fast", f"{prefix}-heavy"
    config = GatewayConfig((Lane("fast", fast, 256), Lane("heavy", heavy, SEED_HEAVY_SLOTS)), SEED_BAR_CHARS,
                           "chars", name="router", leak_on_disconnect=True)
    chat = chat_arrivals("chat", 0.0, SEED_DURATION_S, 3.0, prompt_median=2000, output_median=150,
                         cached=(0.85, 0.95), max_prompt=16_384)
    rng = random.Random("seed-gateway")
    requests = [GatewayRequest(a, rng.choice(("prose", "prose", "code"))) for a in chat]
    heavy_seen = 0
    for i, (at, tokens, content) in enumerate(SEED_MONSTERS):
        arrival = one_request(f"monster-{i:02d}-{tokens // 1000}k", float(at), tokens, SEED_MONSTER_OUTPUT)
        leaves = None
        if tokens * CHARS_PER_TOKEN[content] >= SEED_BAR_CHARS:
            heavy_seen += 1
            leaves = SEED_DISCONNECT_AFTER_TOKENS if heavy_seen <= SEED_DISCONNECTS else None
        requests.append(GatewayRequest(arrival, content, leaves))
    requests.sort(key=lambda r: r.arrival.offset_s)
    facts = {"monsters": len(SEED_MONSTERS), "dense_json_monsters": sum(c == "json" for _, _, c in SEED_MONSTERS),
             "bar": f"{SEED_BAR_CHARS:,.0f} chars", "heavy_slots": SEED_HEAVY_SLOTS, "disconnects": SEED_DISCONNECTS}
    return GatewayCase(config, tuple(requests), ((fast, EngineConfig()), (heavy, EngineConfig())),
                       SEED_DURATION_S, SEED_DRAIN_S, facts)



def run_demo(store_url: str) -> None:
    """`stepline demo --fast --gateway`: replay the seed's gateway story into `store_url`, then print what the router
    decided, what the engines counted, and what diagnose says about it."""
    started = time.monotonic()
    case = seed_story(time.strftime("lane-%H%M%S"))
    gateway, runs, window = replay(case, store_url)
    roll_up_usage(store_url, "", window.start.timestamp(), window.end.timestamp(), {n for n, _ in case.engines})
    fast, heavy = case.config.lanes
    print(f"replayed a router in front of two simulated engines ({case.duration_s:.0f} s of traffic, "
          f"{len(case.requests)} requests) in {time.monotonic() - started:.1f} s")
    print(f"the router: below {case.config.threshold:,.0f} {case.config.unit} to the {fast.name} lane ({fast.engine}),"
          f" at or over it to the {heavy.name} lane ({heavy.engine}, {heavy.slots} slots, released on success or "
          "failure but not on a client's disconnect)")
    reader = open_reader(store_url)
    try:
        print("\nwhat the router decided (gateway_decisions):")
        print(analysis_gateway.lanes(reader.client, window))
        print(f"\nthe monsters, as measured at the router and counted by their engine (at least "
              f"{SEED_BAR_TOKENS // 1000}k tokens):")
        for line in analysis_gateway.largest(reader.client, window, SEED_BAR_TOKENS):
            print(f"  {line}")
        print(f"\nthe {heavy.name} lane's slots at the router beside what {heavy.engine} held, per minute:")
        print(analysis_gateway.slots(reader.client, window, heavy.engine))
        print("\nwhat stepline diagnose says (all engines):")
        print(summary_for_demo(reader.client, "", window.start.timestamp()))
    finally:
        reader.close()
    leaked = sum(g.leaked for g in gateway.gates)
    print(f"\n(the simulated router leaked {leaked} slots; {sum(r.in_flight for r in runs)} requests were still in "
          "flight when the replay ended)")
    print("\nlook further:\n"
          "  stepline diagnose --since 1h\n"
          "  stepline query \"SELECT ts, lane, engine, size_chars, threshold, status, in_flight FROM gateway_decisions "
          "ORDER BY size_chars DESC LIMIT 10\"")


# Generated gateway cases: cause -> the finding kind a correct diagnosis ranks first (None: nothing above info).
GATEWAY_CAUSES: dict[str, str | None] = {
    "healthy_lanes": None,
    "slow_heavy_lane": None,
    "lane_leak": "lane_leak",
    "slot_leak": "gateway_slot_leak",
    "fail_open": "gateway_fail_open",
    "orphaned_work": "orphaned_engine_work",
}
GATEWAY_CAUSE_NAMES = tuple(GATEWAY_CAUSES)
LANE_SPEEDS = (0.3, 3.0)  # each lane engine's step cost against the reference 8B model's
BAR_TOKENS = (24_000, 128_000)  # the router's bar, drawn in tokens, set in its unit
HEAVY_SHARE = (1.2, 2.5)  # a heavy-lane monster's tokens against the bar
DENSE_SHARE = (1.05, 1.3)  # a dense monster that leaks: over the bar in tokens, under it at ~3 chars per token
LEAVER_OUTPUT = (400, 1500)  # long answers whose clients leave early, orphaned when the upstream runs on


@dataclass(frozen=True)
class GeneratedGatewayCase:
    """A generated gateway case and what a correct diagnosis says (as generator.Case, for generator.judge)."""

    seed: int
    cause: str
    truth_kind: str | None
    truth_engine: str | None
    description: str
    case: GatewayCase

    @property
    def engines(self) -> tuple[tuple[str, EngineConfig], ...]:
        return self.case.engines


def generate_gateway(seed: int) -> GeneratedGatewayCase:
    """The gateway case of `seed`: a two-lane router in front of two engines of random speed and budget, its bar
    drawn in tokens and set in characters or estimated tokens, ordinary traffic sized for each engine, monsters for
    the heavy lane, and the cause GATEWAY_CAUSE_NAMES[seed % 6] injected."""
    rng = random.Random(f"stepline-gateway-case-{seed}")
    cause = GATEWAY_CAUSE_NAMES[seed % len(GATEWAY_CAUSE_NAMES)]
    fast_e = draw_engine(rng, "lane-fast", 120.0, seed, LANE_SPEEDS)
    heavy_e = draw_engine(rng, "lane-heavy", 120.0, seed, LANE_SPEEDS)
    for e in (fast_e, heavy_e):
        e.config = replace(e.config, speculative=None)
    bar_tokens = round(rng.uniform(*BAR_TOKENS), -3)
    unit = rng.choice(("chars", "tokens"))
    threshold = bar_tokens * ESTIMATE_CHARS_PER_TOKEN if unit == "chars" else float(bar_tokens)
    # Heavy monsters one at a time: each prefills and answers before the next comes (a lane meant to be slow).
    slots = rng.randint(2, 5)
    # With leaking slots, monsters keep coming after the lane is full (each refused with every slot held).
    count = slots + rng.randint(2, 4) if cause == "slot_leak" else rng.randint(4, 7)
    sizes = [round(bar_tokens * rng.uniform(*HEAVY_SHARE)) for _ in range(count)]
    output = rng.randint(50, 200)
    alone = max(prefill_seconds(heavy_e.cost, n, heavy_e.budget) for n in sizes) + output * decode_step_seconds(
        heavy_e.cost, 1, max(sizes))
    spacing = max(10.0, 1.5 * alone)
    duration = round(max(120.0, spacing * (count + 1)))
    for e in (fast_e, heavy_e):
        e.duration_s = duration
    knobs: dict[str, Any] = {}
    heavy: list[GatewayRequest] = []
    for i, n in enumerate(sizes):
        arrival = one_request(f"heavy-{i:02d}-{n // 1000}k", spacing * (i + 0.5), n, output)
        heavy.append(GatewayRequest(arrival, rng.choice(CONTENTS) if n >= 1.34 * bar_tokens else "prose"))
    fast = [GatewayRequest(a, rng.choice(("prose", "prose", "code")))
            for a in ordinary_traffic(rng, fast_e, 0.0, duration)]
    facts: dict[str, Any] = {"bar": f"{threshold:,.0f} {unit}", "heavy_monsters": count, "slots": slots}
    truth = {"lane_leak": fast_e.name, "slot_leak": heavy_e.name, "fail_open": fast_e.name,
             "orphaned_work": fast_e.name}.get(cause)
    match cause:
        case "slow_heavy_lane":
            heavy = [GatewayRequest(one_request("heavy-long-700k", 0.5, 700_000, rng.randint(500, 3000), 0.9))]
            heavy_e.config = replace(heavy_e.config, num_gpu_blocks=max(heavy_e.config.num_gpu_blocks, 60_000))
        case "lane_leak":
            leaks = rng.randint(1, 3)
            at = sorted(rng.uniform(0.15, 0.75) * duration for _ in range(leaks))
            dense = [(t, round(bar_tokens * rng.uniform(*DENSE_SHARE))) for t in at]
            fast += [GatewayRequest(one_request(f"dense-{i:02d}-{n // 1000}k", t, n, output),
                                    rng.choice(("json", "code"))) for i, (t, n) in enumerate(dense)]
            facts["dense_leaks"] = leaks
        case "slot_leak":
            # The first `slots` heavy clients leave mid-stream; every later monster finds the lane full.
            heavy = [replace(r, disconnect_after_tokens=rng.randint(2, max(2, output // 4))) if i < slots else r
                     for i, r in enumerate(heavy)]
            knobs["leak_on_disconnect"] = True
            facts["disconnects"] = slots
        case "fail_open":
            knobs["fail_open"] = frozenset({"json"})
            share = rng.uniform(0.1, 0.4)
            fast = [replace(r, content="json") if rng.random() < share else r for r in fast]
            facts["failed_open"] = sum(r.content == "json" for r in fast)
        case "orphaned_work":
            knobs["cancel_upstream"] = False
            leavers = rng.randint(3, 8)
            fast += [GatewayRequest(one_request(f"leaver-{i:02d}", rng.uniform(0.1, 0.8) * duration,
                                                min(2000, fast_e.mix.max_prompt), rng.randint(*LEAVER_OUTPUT), 0.9),
                                    "prose", rng.randint(3, 30)) for i in range(leavers)]
            facts["leavers"] = leavers
        case "healthy_lanes":
            # Clients leave now and then, and a correct gateway gives their slots back and cancels upstream.
            fast = [replace(r, disconnect_after_tokens=1) if rng.random() < 0.03 and r.arrival.output_tokens > 1
                    else r for r in fast]
    config = GatewayConfig((Lane("fast", fast_e.name, 256), Lane("heavy", heavy_e.name, slots)), threshold, unit,
                           seed=seed, **knobs)
    requests = tuple(sorted([*fast, *heavy], key=lambda r: r.arrival.offset_s))
    case = GatewayCase(config, requests, ((fast_e.name, fast_e.config), (heavy_e.name, heavy_e.config)),
                       float(duration), 30.0, facts)
    described = ", ".join(f"{e.name} x{e.speed:.2g} budget {e.budget}" for e in (fast_e, heavy_e))
    return GeneratedGatewayCase(seed, cause, GATEWAY_CAUSES[cause], truth,
                                f"{cause} ({', '.join(f'{k}={v}' for k, v in facts.items())}); {described}", case)
