"""A gateway in front of simulated engines: the seed's size-routing router, with its units and its leaks.

The router measures each request in its own unit (characters, bytes, or tokens estimated at
ESTIMATE_CHARS_PER_TOKEN), compares it with one bar, and sends it to the lane below the bar or to the lane at or over
it. Content sets how many characters a token is: prose ~4, dense code and JSON ~3 (CHARS_PER_TOKEN), so a dense-JSON
monster measures a quarter smaller than its tokens. Each lane lets `slots` requests be in flight to its engine and
answers 429 beyond them.

The switches are the gateway failures the seed lived through:
- `leak_on_disconnect`: a slot is released on success or failure, never when the client goes away; once the lane's
  slots have leaked it refuses everything while its engine sits idle;
- `cancel_upstream=False`: a client's disconnect does not close the engine's request, which runs on for nobody;
- `fail_open`: content kinds whose sizing raises; the hook swallows the exception and routes to the default lane.

`SimGateway.route` splits GatewayRequests into each lane's workload; each lane's engine replays behind its gate
(`gate(engine).admit` as arrivals reach it, `.on_step` after each step, which releases slots); `records` then says
what the router saw, one per request, in DecisionRecorder.record's terms.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, replace
from typing import Any

from stepline.gateway.decisions import UNITS
from stepline.sim.records import FinishedRequest, StepRecord
from stepline.sim.workloads import Arrival, Workload, compose

CONTENTS = ("prose", "code", "json")
# Characters per token by content, as the seed measured them: prose ~4, dense code and JSON ~3.
CHARS_PER_TOKEN = {"prose": 4.0, "code": 3.0, "json": 3.0}
# A router's token estimate from characters: len(text) / 4 (llm-d sizes prompts as len(json)/4; so did the seed's).
ESTIMATE_CHARS_PER_TOKEN = 4.0
SIZE_JITTER = 0.03  # each request's characters per token vary this much around its content's
# What the seed's hook swallowed on a body it did not expect (a tool-call payload without `messages`).
FAIL_OPEN_EXCEPTION = "KeyError: 'messages'"
SATURATED = "lane_saturated"  # the error class of a request refused because its lane had no free slot


@dataclass(frozen=True, slots=True)
class Lane:
    """A traffic class: its name, the engine that serves it and the requests it lets be in flight there."""

    name: str
    engine: str
    slots: int = 64


@dataclass(frozen=True, slots=True)
class GatewayConfig:
    """A two-lane size router: below `threshold` (in `unit`) to lanes[0], the default; at or over it to lanes[1]."""

    lanes: tuple[Lane, Lane]
    threshold: float
    unit: str = "chars"
    name: str = "router"
    leak_on_disconnect: bool = False
    cancel_upstream: bool = True
    fail_open: frozenset[str] = frozenset()
    seed: int = 0

    def __post_init__(self) -> None:
        if self.unit not in UNITS:
            raise ValueError(f"gateway unit must be one of {', '.join(UNITS)}, got {self.unit!r}")
        if not self.threshold > 0:
            raise ValueError(f"gateway threshold must be positive, got {self.threshold}")
        if self.lanes[0].engine == self.lanes[1].engine or self.lanes[0].name == self.lanes[1].name:
            raise ValueError("the gateway's two lanes need engines and names of their own")
        if any(lane.slots < 1 for lane in self.lanes):
            raise ValueError("every lane needs at least one slot")
        unknown = set(self.fail_open) - set(CONTENTS)
        if unknown:
            raise ValueError(f"fail_open names unknown content {sorted(unknown)}; one of {', '.join(CONTENTS)}")


@dataclass(frozen=True, slots=True)
class GatewayRequest:
    """A client's request as it reaches the gateway: what the engine will be asked, what the text is, and whether
    the client goes away after `disconnect_after_tokens` streamed tokens (None: it stays to the end)."""

    arrival: Arrival
    content: str = "prose"
    disconnect_after_tokens: int | None = None

    @property
    def disconnects(self) -> bool:
        after = self.disconnect_after_tokens
        return after is not None and after < self.arrival.output_tokens


@dataclass
class _Decision:
    request: GatewayRequest
    lane: Lane
    sizes: dict[str, int | None]
    swallowed: str
    in_flight: int | None = None
    refused: bool = False
    finished: FinishedRequest | None = None


class LaneGate:
    """One lane's slots in front of its engine: `admit` as arrivals reach it, `on_step` to release."""

    def __init__(self, gateway: SimGateway, lane: Lane) -> None:
        self._gateway, self.lane = gateway, lane
        self.held = 0
        self.leaked = 0

    def admit(self, arrival: Arrival, offset_s: float) -> bool:
        decision = self._gateway.decisions[arrival.request_id]
        if self.held >= self.lane.slots:
            decision.refused, decision.in_flight = True, self.held
            return False
        self.held += 1
        decision.in_flight = self.held
        return True

    def on_step(self, step: StepRecord) -> None:
        for finished in step.finished_requests:
            decision = self._gateway.decisions.get(finished.request_id)
            if decision is None or decision.lane != self.lane:
                continue
            decision.finished = finished
            if decision.request.disconnects and self._gateway.config.leak_on_disconnect:
                self.leaked += 1  # the disconnect path never gives the slot back
            else:
                self.held -= 1


class SimGateway:
    """The router of `config`: routes requests to lanes, gates each lane's engine, and reports its decisions."""

    def __init__(self, config: GatewayConfig) -> None:
        self.config = config
        self.decisions: dict[str, _Decision] = {}
        self._gates = {lane.engine: LaneGate(self, lane) for lane in config.lanes}

    def gate(self, engine: str) -> LaneGate | None:
        """The gate in front of `engine`, None when no lane is served by it."""
        return self._gates.get(engine)

    def route(self, requests: list[GatewayRequest], duration_s: float, drain_s: float) -> dict[str, Workload]:
        """Each lane engine's workload (every lane's, empty or not) from the requests the gateway receives."""
        per_lane: dict[str, list[Arrival]] = {lane.engine: [] for lane in self.config.lanes}
        for request in requests:
            decision = self._decide(request)
            self.decisions[request.arrival.request_id] = decision
            per_lane[decision.lane.engine].append(self._upstream(request))
        return {engine: compose(f"{self.config.name}-{engine}", duration_s, drain_s, arrivals)
                for engine, arrivals in per_lane.items()}

    def _decide(self, request: GatewayRequest) -> _Decision:
        fast, heavy = self.config.lanes
        if request.content in self.config.fail_open:
            # The hook raised before measuring; its `except` routed to the default lane and went on.
            return _Decision(request, fast, {unit: None for unit in UNITS}, FAIL_OPEN_EXCEPTION)
        sizes = measure(request, self.config.seed)
        lane = heavy if (sizes[self.config.unit] or 0) >= self.config.threshold else fast
        return _Decision(request, lane, dict(sizes), "")

    def _upstream(self, request: GatewayRequest) -> Arrival:
        """The engine's request: a disconnect the gateway passes on (`cancel_upstream`) aborts it there."""
        arrival = request.arrival
        if request.disconnects and self.config.cancel_upstream:
            assert request.disconnect_after_tokens is not None
            return replace(arrival, output_tokens=max(1, request.disconnect_after_tokens), finish_reason="abort")
        return arrival

    def records(self, start_ts: dict[str, float]) -> list[dict[str, Any]]:
        """DecisionRecorder.record's keyword arguments for every request that ended or was refused, stamped from
        each lane engine's simulated second 0 (`start_ts` by engine). Requests still in flight are not yet
        reported (a gateway reports an attempt when it ends), nor those the engine could never hold."""
        out = []
        for request_id, d in self.decisions.items():
            at = start_ts[d.lane.engine] + d.request.arrival.offset_s
            common: dict[str, Any] = {
                "request_id": request_id, "lane": d.lane.name, "backend": d.lane.engine, "start_s": at,
                "candidates": [lane.engine for lane in self.config.lanes], "size_chars": d.sizes["chars"],
                "size_bytes": d.sizes["bytes"], "size_tokens": d.sizes["tokens"],
                "threshold": self.config.threshold, "threshold_unit": self.config.unit, "health": "healthy",
                "in_flight": d.in_flight, "swallowed": d.swallowed or None}
            if d.refused:
                out.append({**common, "end_s": at, "status": 429, "error_type": SATURATED})
            elif d.finished is not None:
                out.append({**common, **_outcome(d.request, d.finished)})
        return out

    @property
    def gates(self) -> tuple[LaneGate, ...]:
        return tuple(self._gates.values())


def measure(request: GatewayRequest, seed: int = 0) -> dict[str, int]:
    """The request's size in every unit the router has: characters (its content's per token, give or take
    SIZE_JITTER), bytes (ASCII text: as many), tokens estimated from the characters."""
    rng = random.Random(f"gateway-size-{seed}-{request.arrival.request_id}")
    per_token = CHARS_PER_TOKEN[request.content] * (1 + rng.uniform(-SIZE_JITTER, SIZE_JITTER))
    chars = round(request.arrival.prompt_tokens * per_token)
    return {"chars": chars, "bytes": chars, "tokens": round(chars / ESTIMATE_CHARS_PER_TOKEN)}


def _outcome(request: GatewayRequest, finished: FinishedRequest) -> dict[str, Any]:
    first_byte = finished.arrival_ts + finished.time_to_first_token
    if not request.disconnects:
        return {"first_byte_s": first_byte, "end_s": finished.finished_ts, "status": 200}
    after = request.disconnect_after_tokens or 1
    generated = finished.num_generation_tokens
    if finished.finish_reason == "abort" or generated <= 1:
        left = finished.finished_ts  # passed upstream: the engine stopped when the client went
    else:  # the engine ran on: the client left after its `after`-th token
        left = first_byte + finished.decode_time * min(1.0, (after - 1) / (generated - 1))
    return {"first_byte_s": first_byte, "end_s": left, "status": 499, "error_type": "client_disconnected",
            "client_disconnected": True}

