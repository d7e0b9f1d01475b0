"""Who used the GPUs, grouped: `stepline usage --by team` and the like, from each request's GPU time and energy in a
window (stepline.analysis.usage), who sent it (the gateway's decision it joins, queries/gateway.py) and a price per
GPU-hour per GPU model (no price is invented: without one, no cost is shown).

A group's requests and tokens are those of the requests that finished in the window (prompt and generated tokens, as
the engine counted them); its GPU-seconds and energy are the shares of every request in it that the window holds (a
request running across the window's edge brings the part inside). Idle and unattributed time are their own lines,
never spread over the groups: an operator pays for them, nobody sent them.

Dimensions: engine, model (the engine's served model), lane, adapter (the model the gateway asked the backend for:
a LoRA adapter's name where the request named one), key, team, user, end_user, and tenant (the team where the
gateway says one, else the key, else the end user, else the user). A request no gateway decision joins has none of
the gateway's dimensions ("(none)").
"""

from __future__ import annotations

import csv
import io
import json
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from typing import Any

from stepline.analysis.usage import EngineUsage, usage
from stepline.core.texttable import render_table
from stepline.diagnosis.findings import Window
from stepline.model.rows import micros, tenant_of
from stepline.queries.gateway import MATCH_SKEW_S, joined
from stepline.queries.query import Query
from stepline.queries.requests import merged_matching
from stepline.queries.window import EACH_ENGINE, EACH_HOST, IN_WINDOW, between
from stepline.store.reads import Reads, Row

DIMENSIONS = ("tenant", "team", "key", "user", "end_user", "model", "adapter", "lane", "engine")
NONE = "(none)"
IDLE = "(idle)"
UNATTRIBUTED = "(unattributed)"

# The requests that finished in the window, with what the engine counted of them.
_FINISHED_IN = merged_matching(f"{EACH_ENGINE} AND {EACH_HOST} AND {IN_WINDOW}",
                               ("model_name", "prompt_tokens", "generation_tokens"))
_FINISHED = ("SELECT host, engine, request_id, toUnixTimestamp64Micro(arrival_ts) AS arrival_us, model_name, "
             f"prompt_tokens, generation_tokens FROM {_FINISHED_IN}")
# Who sent each engine request a gateway decision in the window joins (on whichever host the decision was written).
_WHO = joined("r.engine AS engine, r.request_id AS request_id, toUnixTimestamp64Micro(r.arrival_ts) AS arrival_us, "
              "d.lane AS lane, d.model AS adapter, d.key AS api_key, d.team AS team, d.user AS `user`, "
              "d.end_user AS end_user", "1", ("arrival_ts",))
# The GPU model each engine ran on in the window (its commonest, where it had several).
_GPU_MODELS = (f"SELECT host, engine, topK(1)(gpu_name)[1] AS gpu_model FROM gpu_samples WHERE engine != '' AND "
               f"{EACH_ENGINE} AND {EACH_HOST} AND {between()} GROUP BY host, engine")

Key = tuple[str, str, int]  # engine, request id, arrival (us)


@dataclass(frozen=True)
class Who:
    """What a request is grouped by besides its engine: the engine's model and the gateway's decision ('' where
    none joins)."""

    model: str = ""
    lane: str = ""
    adapter: str = ""
    key: str = ""
    team: str = ""
    user: str = ""
    end_user: str = ""

    def value(self, by: str, engine: str) -> str:
        """The value of dimension `by`."""
        if by == "engine":
            return engine
        if by == "tenant":
            return tenant_of(self.team, self.key, self.end_user, self.user) or NONE
        return str(getattr(self, by)) or NONE


@dataclass(frozen=True)
class Line:
    """One request's part of the window (its share of the GPU time, and its requests and tokens where it finished
    in the window), or one engine's idle or unattributed part: what the report and the per-minute rollup group."""

    host: str
    engine: str
    kind: str  # LINE_KINDS
    gpu_name: str  # '' where the engine's GPUs were not sampled
    who: Who
    requests: int
    prompt_tokens: int
    generation_tokens: int
    engine_us: int  # its part of the engine's time, us over the engine indices
    gpu_seconds: float
    energy_mj: int | None  # None: the engine's GPUs were not sampled
    gpus: int  # the engine's GPUs seen; 0: none sampled


LINE_KINDS = ("request", "idle", "unattributed")


@dataclass(frozen=True)
class Lines:
    """The window's lines, and the engines they come from (the exact pass's account of each)."""

    lines: list[Line]
    engines: list[EngineUsage]


def lines(reader: Reads, window: Window, host: str = "") -> Lines:
    """Every request's and engine's part of `window` (the engines of `host`; '': every host), with who sent it."""
    used = usage(reader, window, host)
    bound = {"engine": window.engine, "host": host, "start": window.start, "end": window.end}
    gpu_of = {(str(r.host), str(r.engine)): str(r.gpu_model) for r in Query(_GPU_MODELS, **bound).rows(reader)}
    finished = {(str(r.engine), str(r.request_id), int(r.arrival_us)):
                (str(r.host), str(r.model_name), int(r.prompt_tokens), int(r.generation_tokens))
                for r in Query(_FINISHED, **bound).rows(reader)}
    # Who sent them: the decisions from the earliest arrival among them (a request alive in the window may have been
    # sent long before it, a minute's first ones a moment before), less the join's clock skew.
    earliest = min([micros(window.start.timestamp()), *(micros(r.arrival.timestamp()) for r in used.requests),
                    *(k[2] for k in finished)])
    since = datetime.fromtimestamp(earliest / 1e6 - MATCH_SKEW_S, UTC)
    who = {(str(r.engine), str(r.request_id), int(r.arrival_us)): r
           for r in Query(_WHO, **{**bound, "start": since}).rows(reader)}
    # A request that finished after the window is read for its model by its engine's.
    served = {key[0]: model for key, (_, model, _, _) in finished.items()}
    gpus = {(e.host, e.engine): e for e in used.engines}
    out: list[Line] = []
    for r in used.requests:
        key = (r.engine, r.request_id, micros(r.arrival.timestamp()))
        done = finished.pop(key, None)
        _, model, prompt, generated = done or ("", served.get(r.engine, ""), 0, 0)
        out.append(Line(r.host, r.engine, "request", gpu_of.get((r.host, r.engine), ""), _who(model, who.get(key)),
                        1 if done else 0, prompt, generated, r.step_us, r.gpu_seconds, r.energy_mj,
                        gpus[(r.host, r.engine)].gpus))
    for key, (h, model, prompt, generated) in finished.items():  # finished in the window, no share of it
        e = gpus.get((h, key[0]))
        out.append(Line(h, key[0], "request", gpu_of.get((h, key[0]), ""), _who(model, who.get(key)), 1, prompt,
                        generated, 0, 0.0, None, e.gpus if e else 0))
    out += [line for e in used.engines for line in _engine_lines(e, gpu_of.get((e.host, e.engine), ""))]
    return Lines(out, used.engines)


def _who(model: str, decision: Row | None) -> Who:
    """Who sent a request: its model, and what the gateway decision it joins (a row of _WHO) says."""
    if decision is None:
        return Who(model)
    return Who(model=model, lane=str(decision.lane), adapter=str(decision.adapter), key=str(decision.api_key),
               team=str(decision.team), user=str(decision.user), end_user=str(decision.end_user))


def _engine_lines(e: EngineUsage, gpu_name: str) -> list[Line]:
    """The GPU time nobody sent (idle) and what no known request can take (unattributed), of one engine."""
    per_us = e.gpus_per_rank / 1e6
    return [Line(e.host, e.engine, "idle", gpu_name, Who(), 0, 0, 0, e.idle_us, e.idle_us * per_us,
                 e.idle_energy_mj, e.gpus),
            Line(e.host, e.engine, "unattributed", gpu_name, Who(), 0, 0, 0, e.unattributed_us,
                 e.unattributed_us * per_us, e.unattributed_energy_mj, e.gpus)]


@dataclass
class Group:
    """One line of the report: a group's requests, tokens, GPU time, energy and cost."""

    name: str
    requests: int = 0
    prompt_tokens: int = 0
    generation_tokens: int = 0
    gpu_seconds: float = 0.0
    energy_j: float | None = None  # None: none of its engines' GPUs were sampled
    cost: float | None = None  # None: no price applies to any of its GPU time
    unpriced_gpu_seconds: float = 0.0  # GPU time on GPUs without a price

    @property
    def tokens(self) -> int:
        return self.prompt_tokens + self.generation_tokens

    @property
    def cost_per_million_tokens(self) -> float | None:
        return self.cost / self.tokens * 1e6 if self.cost is not None and self.tokens else None

    def add(self, gpu_seconds: float, energy_j: float | None, price: float | None) -> None:
        self.gpu_seconds += gpu_seconds
        if energy_j is not None:
            self.energy_j = (self.energy_j or 0.0) + energy_j
        if price is None:
            self.unpriced_gpu_seconds += gpu_seconds
        else:
            self.cost = (self.cost or 0.0) + gpu_seconds / 3600 * price


@dataclass
class Report:
    """`stepline usage`'s answer: a group per value of `by`, then the idle and unattributed lines."""

    by: str
    window: Window
    groups: list[Group]
    idle: Group
    unattributed: Group
    prices: dict[str, float]  # GPU model -> price per GPU-hour, as given
    unpriced_gpus: list[str] = field(default_factory=list)  # GPU models seen without a price
    engines: list[EngineUsage] = field(default_factory=list)  # the exact pass's engines (none from the rollup)
    without_gpus: list[str] = field(default_factory=list)  # engines no GPU sample tied to: 1 GPU per rank
    # exact: one pass over the steps; rollup: usage_minutes and its edges from the steps; rollup_minutes: usage_minutes
    # over its whole minutes only, `window` cut to them (stepline.analysis.usage_rollup)
    source: str = "exact"

    @property
    def gpu_seconds(self) -> float:
        return sum(g.gpu_seconds for g in (*self.groups, self.idle, self.unattributed))

    def idle_share(self) -> float:
        total = self.gpu_seconds
        return self.idle.gpu_seconds / total if total else 0.0


def report(reader: Reads, window: Window, by: str, prices: Mapping[str, float] | None = None) -> Report:
    """GPU time, energy and cost over `window`, grouped by `by` (one of DIMENSIONS), from one exact pass."""
    check(by)
    found = lines(reader, window)
    return grouped(found.lines, window, by, prices, found.engines)


def check(by: str) -> None:
    """ValueError unless `by` is one of DIMENSIONS."""
    if by not in DIMENSIONS:
        raise ValueError(f"usage by {by!r}: one of {', '.join(DIMENSIONS)}")


def grouped(found: Iterable[Line], window: Window, by: str, prices: Mapping[str, float] | None = None,
            engines: Sequence[EngineUsage] = (), source: str = "exact") -> Report:
    """The lines grouped by `by`, idle and unattributed on lines of their own, priced per GPU model."""
    prices = dict(prices or {})
    groups: dict[str, Group] = {}
    special = {"idle": Group(IDLE), "unattributed": Group(UNATTRIBUTED)}
    seen: set[str] = set()
    without: set[str] = set()
    for line in found:
        seen.add(line.gpu_name)
        if line.kind == "idle" and line.gpus == 0:
            without.add(line.engine)
        g = special.get(line.kind) or _group(groups, line.who.value(by, line.engine))
        g.requests += line.requests
        g.prompt_tokens += line.prompt_tokens
        g.generation_tokens += line.generation_tokens
        # A request that finished in the window with no share of it adds no GPU time: no cost of 0 either.
        if line.gpu_seconds or line.energy_mj is not None or line.kind != "request":
            g.add(line.gpu_seconds, None if line.energy_mj is None else line.energy_mj / 1000,
                  prices.get(line.gpu_name))
    ordered = sorted(groups.values(), key=lambda g: (-g.gpu_seconds, g.name))
    unpriced = sorted(m for m in seen - {""} if m not in prices)
    return Report(by, window, ordered, special["idle"], special["unattributed"], prices, unpriced, list(engines),
                  sorted(without), source)


def _group(groups: dict[str, Group], name: str) -> Group:
    if name not in groups:
        groups[name] = Group(name)
    return groups[name]


# ---- rendering -------------------------------------------------------------------------------------------------

SOURCES = {"exact": "from one pass over the window's steps (exact)",
           "rollup": "from the per-minute rollup (usage_minutes), the window's edges from its steps: each minute as "
                     "it was rolled up, minutes after it closed (requests running then count as unattributed)",
           "rollup_minutes": "from the per-minute rollup (usage_minutes) only, over its whole minutes from {start} to "
                             "{end} UTC: the rest of the window held too many steps to walk quickly (--exact walks "
                             "them); each minute as it was rolled up, minutes after it closed"}
COLUMNS = ("requests", "prompt_tokens", "generation_tokens", "gpu_seconds", "energy_kwh", "cost",
           "cost_per_1m_tokens", "share_of_gpu_time")


def _row(g: Group, total: float) -> dict[str, Any]:
    return {"requests": g.requests, "prompt_tokens": g.prompt_tokens, "generation_tokens": g.generation_tokens,
            "gpu_seconds": round(g.gpu_seconds, 3),
            "energy_kwh": None if g.energy_j is None else round(g.energy_j / 3.6e6, 6),
            "cost": None if g.cost is None else round(g.cost, 6),
            "cost_per_1m_tokens": None if g.cost_per_million_tokens is None else round(g.cost_per_million_tokens, 4),
            "share_of_gpu_time": round(g.gpu_seconds / total, 4) if total else 0.0}


def rows(r: Report) -> list[dict[str, Any]]:
    """Every line as a record: the groups, then idle and unattributed."""
    total = r.gpu_seconds
    return [{r.by: g.name, **_row(g, total)} for g in (*r.groups, r.idle, r.unattributed)]


def as_csv(r: Report) -> str:
    out = io.StringIO()
    writer = csv.DictWriter(out, fieldnames=[r.by, *COLUMNS], lineterminator="\n")
    writer.writeheader()
    writer.writerows(rows(r))
    return out.getvalue()


def as_json(r: Report) -> str:
    return json.dumps({"by": r.by, "from": r.window.start.isoformat(), "to": r.window.end.isoformat(),
                       "source": r.source, "rows": rows(r), "idle_share_of_gpu_time": round(r.idle_share(), 4),
                       "prices_per_gpu_hour": r.prices, "gpu_models_without_a_price": r.unpriced_gpus,
                       "engines": [_engine(e) for e in r.engines]}, indent=1)


def _engine(e: EngineUsage) -> dict[str, Any]:
    fields = ("engine", "ranks", "gpus", "busy_us", "attributed_us", "unattributed_us", "idle_us", "energy_method",
              "energy_mj")
    whole = asdict(e)
    return {k: whole[k] for k in fields}


def _text(value: Any, digits: int = 1) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:,.{digits}f}" if math.isfinite(value) else "-"
    return f"{value:,}"


def render(r: Report) -> str:
    """The report as a table, and a line each on idle time and on prices."""
    total = r.gpu_seconds
    lines = [(g.name, _text(g.requests), _text(g.tokens), _text(g.gpu_seconds),
              _text(None if g.energy_j is None else g.energy_j / 3.6e6, 3), _text(g.cost, 2),
              _text(g.cost_per_million_tokens, 2), f"{g.gpu_seconds / total:.1%}" if total else "-")
             for g in (*r.groups, r.idle, r.unattributed)]
    table = render_table((r.by, "requests", "tokens", "GPU-s", "kWh", "cost", "$/1M tok", "of GPU time"), lines)
    source = SOURCES[r.source].format(start=f"{r.window.start:%Y-%m-%d %H:%M}", end=f"{r.window.end:%Y-%m-%d %H:%M}")
    notes = [f"idle: {r.idle_share():.1%} of the GPU time in the window (no request on the engine)", source]
    if not r.prices:
        notes.append("no cost: set a price per GPU-hour per GPU model (--gpu-price 'MODEL=USD', "
                     "$STEPLINE_GPU_PRICES)")
    elif r.unpriced_gpus:
        notes.append(f"no price for {', '.join(r.unpriced_gpus)}: their GPU time has no cost")
    if r.without_gpus:
        notes.append("engines without GPU samples count 1 GPU per rank and no energy: " + ", ".join(r.without_gpus))
    return table + "\n" + "\n".join(notes)


def parse_prices(specs: Sequence[str]) -> dict[str, float]:
    """`MODEL=USD` (a GPU model as NVML names it, e.g. 'NVIDIA H100 80GB HBM3=2.49') -> price per GPU-hour;
    ValueError naming a bad entry."""
    prices: dict[str, float] = {}
    for spec in specs:
        name, sep, amount = spec.rpartition("=")
        try:
            value = float(amount)
        except ValueError:
            value = math.nan
        if not (sep and name.strip() and math.isfinite(value) and value >= 0):
            raise ValueError(f"GPU price {spec!r} must be MODEL=USD_PER_GPU_HOUR, e.g. 'NVIDIA H100 80GB HBM3=2.49'")
        prices[name.strip()] = value
    return prices
