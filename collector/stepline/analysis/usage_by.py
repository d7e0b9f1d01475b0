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
from typing import Any

from stepline.analysis.usage import EngineUsage, Usage, usage
from stepline.core.texttable import render_table
from stepline.diagnosis.common import Query
from stepline.diagnosis.findings import Window
from stepline.queries.gateway import joined
from stepline.queries.requests import merged_matching
from stepline.queries.window import EACH_ENGINE, IN_WINDOW, between
from stepline.store.reads import Reads

DIMENSIONS = ("tenant", "team", "key", "user", "end_user", "model", "adapter", "lane", "engine")
NONE = "(none)"
IDLE = "(idle)"
UNATTRIBUTED = "(unattributed)"

# The requests that finished in the window, with what the engine counted of them.
_FINISHED_IN = merged_matching(f"{EACH_ENGINE} AND {IN_WINDOW}", ("model_name", "prompt_tokens", "generation_tokens"))
_FINISHED = ("SELECT engine, request_id, toUnixTimestamp64Micro(arrival_ts), model_name, prompt_tokens, "
             f"generation_tokens FROM {_FINISHED_IN}")
# Who sent each engine request a gateway decision in the window joins.
_WHO = joined("r.engine, r.request_id, toUnixTimestamp64Micro(r.arrival_ts), d.lane, d.model, d.key, d.team, d.user, "
              "d.end_user", "1", ("arrival_ts",))
# The GPU model each engine ran on in the window (its commonest, where it had several).
_GPU_MODELS = (f"SELECT engine, topK(1)(gpu_name)[1] FROM gpu_samples WHERE engine != '' AND {EACH_ENGINE} AND "
               f"{between()} GROUP BY engine")


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
    engines: list[EngineUsage] = field(default_factory=list)

    @property
    def gpu_seconds(self) -> float:
        return sum(g.gpu_seconds for g in (*self.groups, self.idle, self.unattributed))

    def idle_share(self) -> float:
        total = self.gpu_seconds
        return self.idle.gpu_seconds / total if total else 0.0


def report(reader: Reads, window: Window, by: str, prices: Mapping[str, float] | None = None) -> Report:
    """GPU time, energy and cost over `window`, grouped by `by` (one of DIMENSIONS)."""
    if by not in DIMENSIONS:
        raise ValueError(f"usage by {by!r}: one of {', '.join(DIMENSIONS)}")
    prices = dict(prices or {})
    used = usage(reader, window)
    bound = {"engine": window.engine, "start": window.start, "end": window.end}
    gpu_of = {str(e): str(name) for e, name in Query(_GPU_MODELS, **bound).rows(reader)}
    who = {(str(r[0]), str(r[1]), int(r[2])): tuple(str(x) for x in r[3:]) for r in Query(_WHO, **bound).rows(reader)}
    groups: dict[str, Group] = {}
    model_of: dict[tuple[str, str, int], str] = {}
    for engine, rid, arrival, model, prompt, generated in Query(_FINISHED, **bound).rows(reader):
        key = (str(engine), str(rid), int(arrival))
        model_of[key] = str(model)
        g = _group(groups, _value(by, key, str(model), who.get(key)))
        g.requests += 1
        g.prompt_tokens += int(prompt)
        g.generation_tokens += int(generated)
    _shares(used, by, groups, who, model_of, gpu_of, prices)
    idle, unattributed = _engine_lines(used.engines, gpu_of, prices)
    seen = sorted({gpu_of.get(e.engine, "") for e in used.engines} - {""})
    ordered = sorted(groups.values(), key=lambda g: (-g.gpu_seconds, g.name))
    return Report(by, window, ordered, idle, unattributed, prices, [m for m in seen if m not in prices], used.engines)


def _shares(used: Usage, by: str, groups: dict[str, Group], who: Mapping[tuple[str, str, int], tuple[str, ...]],
            model_of: dict[tuple[str, str, int], str], gpu_of: Mapping[str, str], prices: Mapping[str, float]) -> None:
    """Each request's share of the window into its group (a request that finished after the window is read for its
    model by the engine's: its row is not among the finished)."""
    served = {engine: m for (engine, _, _), m in model_of.items()}
    for r in used.requests:
        key = (r.engine, r.request_id, round(r.arrival.timestamp() * 1e6))
        model = model_of.get(key, served.get(r.engine, ""))
        energy = None if r.energy_mj is None else r.energy_mj / 1000
        _group(groups, _value(by, key, model, who.get(key))).add(r.gpu_seconds, energy,
                                                                 prices.get(gpu_of.get(r.engine, "")))


def _engine_lines(engines: Iterable[EngineUsage], gpu_of: Mapping[str, str],
                  prices: Mapping[str, float]) -> tuple[Group, Group]:
    """The GPU time nobody sent (idle) and what no known request can take (unattributed), over every engine."""
    idle, unattributed = Group(IDLE), Group(UNATTRIBUTED)
    for e in engines:
        price = prices.get(gpu_of.get(e.engine, ""))
        per_us = e.gpus_per_rank / 1e6
        idle.add(e.idle_us * per_us, None if e.idle_energy_mj is None else e.idle_energy_mj / 1000, price)
        unattributed.add(e.unattributed_us * per_us,
                         None if e.unattributed_energy_mj is None else e.unattributed_energy_mj / 1000, price)
    return idle, unattributed


def _group(groups: dict[str, Group], name: str) -> Group:
    if name not in groups:
        groups[name] = Group(name)
    return groups[name]


def _value(by: str, key: tuple[str, str, int], model: str, who: tuple[str, ...] | None) -> str:
    """The request's value of dimension `by`."""
    if by == "engine":
        return key[0]
    if by == "model":
        return model or NONE
    lane, adapter, api_key, team, user, end_user = who or ("",) * 6
    values = {"lane": lane, "adapter": adapter, "key": api_key, "team": team, "user": user, "end_user": end_user,
              "tenant": team or api_key or end_user or user}
    return values[by] or NONE


# ---- rendering -------------------------------------------------------------------------------------------------

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
                       "rows": rows(r), "idle_share_of_gpu_time": round(r.idle_share(), 4),
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
    notes = [f"idle: {r.idle_share():.1%} of the GPU time in the window (no request on the engine)"]
    if not r.prices:
        notes.append("no cost: set a price per GPU-hour per GPU model (--gpu-price 'MODEL=USD', "
                     "$STEPLINE_GPU_PRICES)")
    elif r.unpriced_gpus:
        notes.append(f"no price for {', '.join(r.unpriced_gpus)}: their GPU time has no cost")
    if any(e.gpus == 0 for e in r.engines):
        notes.append("engines without GPU samples count 1 GPU per rank and no energy: "
                     + ", ".join(sorted(e.engine for e in r.engines if e.gpus == 0)))
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
