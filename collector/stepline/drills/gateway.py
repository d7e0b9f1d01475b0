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
from stepline.diagnosis.detectors import summary_for_demo
from stepline.diagnosis.findings import Window
from stepline.drills.scenarios import Scenario, ScenarioRun, run_engines
from stepline.sim.config import EngineConfig
from stepline.sim.gateway import (
    CHARS_PER_TOKEN,
    ESTIMATE_CHARS_PER_TOKEN,
    GatewayConfig,
    GatewayRequest,
    Lane,
    SimGateway,
)
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
