"""Who used the GPUs: each request's GPU-seconds and energy over a window, and each engine's busy, idle and
unattributed time and energy beside them, which add up exactly.

`usage(reader, window)` reads the engine's steps, the requests alive in the window and its GPUs' energy readings
(stepline.queries.usage), places the requests on the steps and splits each step by what each request cost it
(stepline.analysis.placement), and the GPUs' energy over each step with it (stepline.analysis.energy). METHOD says
how, in the words the schema reference prints.

Limits: one Python pass over the steps read, which run from the earliest moment a request alive in the window was
scheduled (at most MAX_LOOKBACK_S before the window) to STEP_PAD_S after it, with every request alive in that span
and the GPU samples of the window +- GPU_PAD_S; about 1-2 s per 100k steps here. A window longer than MAX_STEPS
steps is refused: ask for a shorter one.
"""

from __future__ import annotations

import math
from bisect import bisect_left
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from stepline.analysis.energy import EnergyCurve, curve, method, used
from stepline.analysis.placement import CostWeights, Phases, Rank, features, fit, pairs, place
from stepline.diagnosis.findings import Window
from stepline.queries import usage as q
from stepline.store.reads import Reads, Row, first_or_none, named, scalar

MAX_LOOKBACK_S = 3600.0  # a request scheduled earlier still counts; its earlier prefill steps are not walked
STEP_PAD_S = 30.0  # a step that began in the window and ended after it (a long prefill chunk takes seconds)
GPU_PAD_S = 10.0  # GPU samples beyond the window, so that its edges interpolate between two samples
MAX_STEPS = 5_000_000
# Scrapes this far either side of the window say whether the engine was up at its edges (the scrape interval is
# seconds; a gap of this length is an engine or a collector that was down).
LIFE_PAD_S = 600.0

METHOD = """\
## Derived: GPU-seconds and energy per request

`stepline.analysis.usage` attributes each engine's GPU time and energy over a window to the requests it served,
from `steps`, `requests` and `gpu_samples`; nothing is stored.

- **Busy time** is the part of each step (from `ts` - `elapsed_ms`, or the previous step's `ts` of its engine index
  where that is later, to `ts`) that lies in the window, summed over the engine's steps; **idle** is the rest of the
  time the engine was up in the window, per engine index: from its first `/metrics` scrape or step in the window to
  its last (`engine_samples`), or the whole window where it was never scraped. Busy + idle = that time times the
  engine indices seen, exactly.
- **Which requests a step carried** is inferred, since no report lists them: a request's prefill steps are those of
  its engine index that ended after it was scheduled (`arrival_ts` + `queue_seconds`) and by its first token (the
  step whose `ttft_seconds` sample is its own: the step's `ts` less the sample is its arrival; else `arrival_ts` +
  `ttft_seconds`, which mixes two clocks), its decode steps those that ended after its first token and by its finish
  (`ts`).
  A step's `num_ctx_tokens` go to the requests then in prefill, oldest first, each up to its uncached prompt tokens
  (`prompt_tokens` - `cached_tokens`) not yet computed; each of its `num_generation_requests` is one decoding
  request, with its prompt and the tokens decoded so far in context.
- **What each cost the step**: the step's duration is split by an affine cost fitted per engine over the steps
  read (least squares of relative errors), `elapsed_ms` = overhead + a x (prefill + draft tokens) + b x attention
  pairs (chunk x (chunk start + chunk / 2)) + c x decoding requests + d x their context tokens, weights kept >= 0;
  where the steps cannot be fitted (under 20, terms that cannot be told apart, or work that explains under 2% of
  their time) the ratios of an 8B model on an H100 split them, and the result says which. A request's share is its
  own terms over the step's; the overhead is shared in the same proportion.
- **Unattributed** is the work no known request can take: steps whose requests are still running at the window's
  end or were aborted without a report (vLLM reports no aborted request), recompute after a preemption, dummy
  steps. Attributed + unattributed = busy time, exactly (microseconds, apportioned by largest remainder).
- **GPU-seconds** are a share of step time times the engine's GPUs (the distinct `gpu_uuid` of its `gpu_samples`
  in the window, divided among its engine indices); 1 GPU where none was sampled, and the result says so.
- **Energy** is each GPU's `energy_mj` counter (its rise, linear between samples) where at least two reads of it
  succeeded, else `power_w` integrated over time; a step's energy is the engine's GPUs' over the step's span in the
  window (per engine index, an equal part of them), shared as its time is. Busy + idle energy = the GPUs' energy
  over the window; attributed + unattributed = busy energy, exactly (millijoules).
"""


@dataclass(frozen=True)
class RequestUsage:
    """One request's part of its engine's GPU work in the window."""

    host: str
    engine: str
    request_id: str
    arrival: datetime
    finished: datetime
    step_us: int  # its share of the engine's step time in the window, us
    gpu_seconds: float  # step_us times the GPUs of its engine index
    energy_mj: int | None  # None where the engine's GPUs were not sampled


@dataclass(frozen=True)
class EngineUsage:
    """One engine's time and energy over the window: busy (attributed + unattributed) and idle."""

    host: str
    engine: str
    ranks: int  # engine indices seen (data-parallel ranks)
    gpus: int  # GPUs seen serving it; 0 where none was sampled (then counted as one per rank)
    window_us: int  # the window's length times `ranks`
    busy_us: int
    attributed_us: int
    unattributed_us: int
    idle_us: int
    energy_method: str  # counter, power, counter+power, or none
    energy_mj: int | None  # the GPUs' energy over the window; None: not sampled
    busy_energy_mj: int | None
    attributed_energy_mj: int | None
    unattributed_energy_mj: int | None
    idle_energy_mj: int | None
    weights: CostWeights
    steps_without_duration: int = 0  # steps without iteration details (elapsed_ms NaN): neither busy nor placed
    requests_unplaced: int = 0  # requests alive in the window whose queue or TTFT no report gave

    @property
    def gpus_per_rank(self) -> float:
        """GPUs per engine index; 1 where the engine's GPUs are unknown."""
        return self.gpus / self.ranks if self.gpus and self.ranks else 1.0


@dataclass(frozen=True)
class Usage:
    """The window's usage: per engine, and per request (those with a share in it)."""

    window: Window
    engines: list[EngineUsage]
    requests: list[RequestUsage]


@dataclass(frozen=True)
class StepRow:
    """One row of queries.usage.STEPS."""

    host: str
    engine: str
    engine_index: int
    end_us: int
    elapsed_ms: float
    num_ctx_tokens: int
    num_generation_requests: int
    num_generation_tokens: int
    first_token_arrivals_us: list[int]


@dataclass(frozen=True)
class RequestRow:
    """One row of queries.usage.REQUESTS."""

    host: str
    engine: str
    engine_index: int
    request_id: str
    arrival_us: int
    queue_seconds: float
    ttft_seconds: float
    finish_us: int
    prompt_tokens: int
    cached_tokens: int
    generation_tokens: int


@dataclass
class _Engine:
    """What the walk gathers for one engine before it is apportioned."""

    ranks: dict[int, Rank] = field(default_factory=dict)
    requests: list[RequestRow] = field(default_factory=list)
    curves: list[EnergyCurve] = field(default_factory=list)
    gpus: int = 0
    without_duration: int = 0
    scraped: tuple[int, int] | None = None  # its first and last /metrics scrape in the window (us), if any
    # engine index -> (arrival us, end us of the step that gave it its first token), from the steps' TTFT samples
    first_tokens: dict[int, list[tuple[int, int]]] = field(default_factory=dict)


FIRST_TOKEN_MATCH_US = 2  # stored moments are whole microseconds: a sample's arrival within this of a request's


def usage(reader: Reads, window: Window, host: str = "") -> Usage:
    """Each request's and engine's GPU time and energy over `window` (every engine where its engine is ''), of the
    engines of `host` ('': every host)."""
    start, end = _micros(window.start), _micros(window.end)
    bound = {"engine": window.engine, "host": host}
    earliest = first_or_none(reader.query(q.EARLIEST_SCHEDULED, parameters={**bound, "lo": start, "hi": end}))
    lo = min(start, max(earliest.earliest_us if earliest is not None and earliest.earliest_us is not None else start,
                        start - round(MAX_LOOKBACK_S * 1e6)))
    hi = end + round(STEP_PAD_S * 1e6)
    engines: dict[tuple[str, str], _Engine] = defaultdict(_Engine)
    counted = int(scalar(reader.query(q.STEP_COUNT, parameters={**bound, "lo": lo, "hi": hi})))
    if counted > MAX_STEPS:
        raise ValueError(f"{counted} steps to walk, more than {MAX_STEPS}: ask for a shorter window")
    steps = _rows(reader, q.STEPS, StepRow, {**bound, "lo": lo, "hi": hi})
    for s in steps:
        _add_step(engines[(s.host, s.engine)], s)
    for r in _rows(reader, q.REQUESTS, RequestRow, {**bound, "lo": lo, "hi": hi}):
        engines[(r.host, r.engine)].requests.append(r)
    life = round(LIFE_PAD_S * 1e6)
    for life_row in _named(reader, q.LIFE, {**bound, "lo": start - life, "hi": end + life}):
        engines[(life_row.host, life_row.engine)].scraped = (life_row.first_us, life_row.last_us)
    pad = round(GPU_PAD_S * 1e6)
    _add_gpus(engines, _named(reader, q.GPU_ENERGY, {**bound, "lo": start - pad, "hi": end + pad}))
    results = [attribute(host, engine, e, start, end) for (host, engine), e in sorted(engines.items())]
    return Usage(window, [u for u, _ in results], [r for _, rs in results for r in rs])


def _micros(moment: datetime) -> int:
    return round(moment.astimezone(UTC).timestamp() * 1e6)


def _rows(reader: Reads, sql: str, cls: Any, parameters: dict[str, Any]) -> list[Any]:
    """The query's rows, each built by name as `cls` (a dataclass whose fields are the query's columns)."""
    result = reader.query(sql, parameters=parameters)
    names = result.column_names
    return [cls(**dict(zip(names, row, strict=True))) for row in result.result_rows]


def _named(reader: Reads, sql: str, parameters: dict[str, Any]) -> list[Row]:
    return named(reader.query(sql, parameters=parameters))


def _add_step(e: _Engine, s: StepRow) -> None:
    if not math.isfinite(s.elapsed_ms):
        e.without_duration += 1
        return
    rank = e.ranks.setdefault(s.engine_index, Rank([], [], [], [], []))
    rank.end_us.append(s.end_us)
    rank.elapsed_us.append(max(0, round(s.elapsed_ms * 1e3)))
    rank.prefill_tokens.append(s.num_ctx_tokens)
    rank.decoding.append(s.num_generation_requests)
    rank.decode_tokens.append(s.num_generation_tokens)
    if s.first_token_arrivals_us:
        e.first_tokens.setdefault(s.engine_index, []).extend((a, s.end_us) for a in s.first_token_arrivals_us)


def _add_gpus(engines: dict[tuple[str, str], _Engine], rows: Sequence[Row]) -> None:
    """One energy curve per GPU of each engine (the rows of q.GPU_ENERGY, ordered by host, engine, GPU, time)."""
    groups: dict[tuple[str, str, str], list[tuple[int, int | None, float]]] = defaultdict(list)
    for r in rows:
        groups[(r.host, r.engine, r.gpu_uuid)].append((r.at_us, r.energy_mj, r.power_w))
    for (host, engine, _), samples in groups.items():
        e = engines[(host, engine)]
        e.gpus += 1
        c = curve(samples)
        if c is not None:
            e.curves.append(c)


def attribute(host: str, engine: str, e: _Engine, start: int, end: int) -> tuple[EngineUsage, list[RequestUsage]]:
    """Place the engine's requests on its steps, fit its step cost, and split its busy time and energy."""
    phases, unplaced = _phases(e)
    for index, rank in e.ranks.items():
        place(rank, phases.get(index, []))
    # A request reported on an engine index that ran no step read (an OTLP-only report says 0) is not placed.
    unplaced += sum(len(p) for index, p in phases.items() if index not in e.ranks)
    weights = fit([row for rank in e.ranks.values() for row in _fit_rows(rank)])
    ranks = max(1, len(e.ranks))
    time_shares = [0.0] * len(e.requests)
    energy_shares = [0.0] * len(e.requests)
    busy = busy_energy = 0.0
    busy_us = idle_us = 0
    up = _up(e, start, end)
    for rank in e.ranks.values():
        spans = _spans(rank, start, end)
        energies = [used(e.curves, a, b) / ranks if b > a else 0.0 for a, b in spans]
        _share(rank, weights, [b - a for a, b in spans], time_shares)
        _share(rank, weights, energies, energy_shares)
        rank_busy = sum(b - a for a, b in spans)
        busy_us += rank_busy
        busy += rank_busy
        busy_energy += sum(energies)
        idle_us += up - rank_busy
    idle_us += (ranks - len(e.ranks)) * up  # an engine seen only on its GPUs was idle throughout
    times = apportion(busy_us, [*time_shares, max(0.0, busy - math.fsum(time_shares))])
    energy = _energy(e, start, end, busy_energy, energy_shares)
    gpus_per_rank = e.gpus / ranks if e.gpus else 1.0
    requests = [RequestUsage(host, engine, r.request_id, _moment(r.arrival_us), _moment(r.finish_us), t,
                             t * gpus_per_rank / 1e6, energy[0][i] if energy else None)
                for i, (r, t) in enumerate(zip(e.requests, times, strict=False)) if t or (energy and energy[0][i])]
    unattributed = times[-1]
    summary = EngineUsage(
        host, engine, ranks, e.gpus, window_us=ranks * up, busy_us=busy_us,
        attributed_us=busy_us - unattributed, unattributed_us=unattributed, idle_us=idle_us,
        energy_method=method(e.curves), energy_mj=energy[1] if energy else None,
        busy_energy_mj=energy[2] if energy else None,
        attributed_energy_mj=energy[2] - energy[0][-1] if energy else None,
        unattributed_energy_mj=energy[0][-1] if energy else None,
        idle_energy_mj=energy[1] - energy[2] if energy else None,
        weights=weights, steps_without_duration=e.without_duration, requests_unplaced=unplaced)
    return summary, requests


def _up(e: _Engine, start: int, end: int) -> int:
    """How long (us) the engine was up in the window: from its first /metrics scrape or step in it to its last, where
    the collector scraped it; the whole window where it never did (then nothing says when it was down)."""
    if e.scraped is None:
        return end - start
    first, last = e.scraped
    for rank in e.ranks.values():
        begun = [s - d for s, d in zip(rank.end_us, rank.elapsed_us, strict=True) if s > start]
        ended = [s for s in rank.end_us if s <= end]
        first = min(first, *begun) if begun else first
        last = max(last, *ended) if ended else last
    return max(0, min(end, last) - max(start, first))


def _phases(e: _Engine) -> tuple[dict[int, list[Phases]], int]:
    """Each request's phases, by the engine index it ran on; how many had unknown times (not placed)."""
    by_rank: dict[int, list[Phases]] = defaultdict(list)
    unplaced = 0
    first_tokens = {index: sorted(pairs) for index, pairs in e.first_tokens.items()}
    for i, r in enumerate(e.requests):
        if not (math.isfinite(r.queue_seconds) and math.isfinite(r.ttft_seconds)):
            unplaced += 1
            continue
        cached = min(r.cached_tokens, r.prompt_tokens)
        by_rank[r.engine_index].append(Phases(
            i, r.arrival_us + round(r.queue_seconds * 1e6), _first_token(r, first_tokens.get(r.engine_index, [])),
            r.finish_us, r.prompt_tokens - cached, cached, r.prompt_tokens))
    return by_rank, unplaced


def _first_token(r: RequestRow, first_tokens: Sequence[tuple[int, int]]) -> int:
    """When the request got its first token (us): the end of the step whose TTFT sample is the request's (the step's
    ts less the sample is its arrival, within the sample's Float32 rounding), else its arrival + `ttft_seconds`.

    The report's TTFT is e2e less decode (vLLM's FinishedRequestStats): e2e on the front-end's clock, decode on the
    engine core's, so arrival + TTFT can fall milliseconds either side of the step that computed the first token, and
    put a prefill step among the request's decode steps (or the reverse), leaving another request's prefill no step
    to take. A sample carried to a later step (its scheduler stats came apart, stepline.plugin.core) matches no
    arrival and changes nothing."""
    estimate = r.arrival_us + round(r.ttft_seconds * 1e6)
    tolerance = FIRST_TOKEN_MATCH_US + abs(r.ttft_seconds) * 1e6 * 2.0 ** -22  # Float32: 24 bits of mantissa
    i = bisect_left(first_tokens, (r.arrival_us - tolerance,))
    matches = []
    while i < len(first_tokens) and first_tokens[i][0] <= r.arrival_us + tolerance:
        matches.append(first_tokens[i][1])
        i += 1
    return min(matches, key=lambda end: abs(end - estimate)) if matches else estimate


def _fit_rows(rank: Rank) -> Iterable[tuple[tuple[float, float, float, float], float]]:
    fallback = _mean_context(rank)
    for i, elapsed in enumerate(rank.elapsed_us):
        if elapsed > 0 and (rank.prefill_tokens[i] or rank.decoding[i]):
            yield features(rank, i, fallback), elapsed / 1e3


def _mean_context(rank: Rank) -> float:
    placed = sum(rank.decoders)
    return sum(rank.context) / placed if placed else 0.0


def _spans(rank: Rank, start: int, end: int) -> list[tuple[int, int]]:
    """Each step's span clipped to the window (an empty span (a, a) where it lies outside), never before the
    previous step's end: steps of one engine index run one after another, and Float32 durations overlap by a
    microsecond or so."""
    out = []
    previous = start
    for step_end, elapsed in zip(rank.end_us, rank.elapsed_us, strict=True):
        a, b = max(previous, step_end - elapsed), min(end, step_end)
        out.append((a, b) if b > a else (a, a))
        previous = max(previous, step_end)
    return out


def _share(rank: Rank, w: CostWeights, measure: Sequence[float], shares: list[float]) -> None:
    """Add each placed request's share of `measure` (per step: its time or energy in the window) to `shares`."""
    fallback = _mean_context(rank)
    n = len(rank.end_us)
    unit = [0.0] * n  # measure per unit of cost, each step
    for i in range(n):
        if not measure[i]:
            continue
        tokens, chunk_pairs, decoding, context = features(rank, i, fallback)
        cost = (w.prefill_token * tokens + w.attention_pair * chunk_pairs + w.decode_request * decoding
                + w.context_token * context)
        if cost > 0:
            unit[i] = measure[i] / cost
        for key, t, s in rank.chunks[i]:
            shares[key] += unit[i] * (w.prefill_token * t + w.attention_pair * pairs(s, t))
    _share_decodes(rank, w, unit, shares)


def _share_decodes(rank: Rank, w: CostWeights, unit: Sequence[float], shares: list[float]) -> None:
    """Each decoding request's shares over its decode steps at once, from prefix sums over the steps: per step, a
    placed decoder costs decode_request + prefill_token x its drafts + context_token x (its constant + the index)."""
    n = len(unit)
    per_slot, per_index, flat = [0.0] * (n + 1), [0.0] * (n + 1), [0.0] * (n + 1)
    for i in range(n):
        decoders = rank.decoders[i]
        # Placed beyond the step's decoding requests (a boundary off): each placed decoder is part of a slot.
        scale = unit[i] * min(1.0, rank.decoding[i] / decoders) if decoders else 0.0
        flat[i + 1] = flat[i] + scale * (w.decode_request + w.prefill_token * rank.drafts(i))
        per_slot[i + 1] = per_slot[i] + scale
        per_index[i + 1] = per_index[i] + scale * i
    for key, (first, stop, constant) in rank.decodes.items():
        shares[key] += (flat[stop] - flat[first] + w.context_token * (
            constant * (per_slot[stop] - per_slot[first]) + per_index[stop] - per_index[first]))


def _energy(e: _Engine, start: int, end: int, busy: float,
            shares: Sequence[float]) -> tuple[list[int], int, int] | None:
    """(each request's energy then the unattributed, in mJ; the window's; busy) or None without GPU samples."""
    if not e.curves:
        return None
    window = max(0, round(used(e.curves, start, end)))
    busy_mj = min(window, max(0, round(busy)))
    return apportion(busy_mj, [*shares, max(0.0, busy - math.fsum(shares))]), window, busy_mj


def apportion(total: int, values: Sequence[float]) -> list[int]:
    """`total` split in proportion to `values` (>= 0) as integers that sum to it exactly (largest remainder); all to
    the last where the values are all 0."""
    weight = math.fsum(values)
    if weight <= 0:
        return [0] * (len(values) - 1) + [total]
    exact = [v * total / weight for v in values]
    out = [math.floor(x) for x in exact]
    for i in sorted(range(len(out)), key=lambda i: out[i] - exact[i])[: total - sum(out)]:
        out[i] += 1
    return out


def _moment(us: int) -> datetime:
    return datetime.fromtimestamp(us / 1e6, UTC)
