"""Gateway lanes: what the router decided (gateway_decisions) against what the engine then counted (requests).

A gateway that splits traffic by size measures a request in its own unit (characters, bytes, an estimate of tokens)
and compares it with a bar. The engine counts tokens. Where the router's unit is not tokens, the bar stands for a
number of tokens only at some characters per token, and content differs: prose runs ~4 characters per token, dense
code and JSON ~3. A monster of dense JSON then measures under a bar meant for it and lands on the fast lane.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from datetime import datetime
from typing import Any, NamedTuple

from stepline.diagnosis.common import clip, hms, number, utc
from stepline.diagnosis.findings import Finding, Window
from stepline.queries.gateway import JOIN_OUTCOMES, MIN_JOINED, join_outcomes, joined, size_in_unit
from stepline.queries.query import Query, moment, param
from stepline.queries.window import EACH_ENGINE, ENGINES, IN_WINDOW, between
from stepline.store.reads import Reads, Row

MAX_REQUEST_IDS = 50  # engine request ids a finding lists, for the findings they explain (diagnosis/causes.py)


# Every decision with the engine's count of the request it became (on the engine it ran on: one of several behind a
# backend that stands for more than one); each is judged against the bar it recorded (those that recorded none are
# counted as such).
_JOINED = joined("d.gateway AS gateway, d.lane AS lane, r.engine AS engine, d.request_id AS request_id, "
                 "d.size_chars AS size_chars, d.size_bytes AS size_bytes, d.size_tokens AS size_tokens, "
                 "d.threshold AS threshold, d.threshold_unit AS threshold_unit, r.prompt_tokens AS prompt_tokens, "
                 "d.ts AS decided, r.request_id AS engine_request_id, r.ts AS finished, m.matched_by AS matched_by",
                 "1", ("ts", "prompt_tokens"), "r.prompt_tokens > 0")
_JOIN_OUTCOMES = join_outcomes("1")  # how _JOINED's decisions joined, refusals included
_UNIT_COLUMN = {"chars": "size_chars", "bytes": "size_bytes", "tokens": "size_tokens"}  # the size in each unit


def _size(row: Row, unit: str) -> Any:
    """A joined decision's size in one of the units of _UNIT_COLUMN (None where it measured none in it)."""
    return getattr(row, _UNIT_COLUMN[unit])


def _first(values: Any, default: Any = "") -> Any:
    """The first of an array a query answered (a topK's most frequent value), or `default` when it is empty."""
    return next(iter(values or ()), default)


# Whether any gateway reported in the window: the joins read the engine's requests, and a fleet with no gateway in
# front must not pay for them (0.6 s each over 64 engines x 24 h).
_ANY_DECISION = (f"SELECT count() AS decisions FROM (SELECT 1 FROM gateway_decisions WHERE {IN_WINDOW} AND "
                 f"{EACH_ENGINE} LIMIT 1)")


def _decided(reader: Reads, window: Window) -> bool:
    rows = Query(_ANY_DECISION, engine=window.engine, start=window.start, end=window.end).rows(reader)
    return any(int(r.decisions) for r in rows)


def lane_leak(reader: Reads, window: Window) -> list[Finding]:
    """Requests the router measured under its bar, so sent to the lane below it, that the engine counted above
    the bar's worth of tokens."""
    if not _decided(reader, window):
        return []
    declared = declared_bars(reader, window)
    found = [(gateway, finding) for gateway, rows in
             _grouped(Query(_JOINED, engine=window.engine, start=window.start, end=window.end), reader, "gateway")
             for finding in (_leaks(gateway, rows, window), _declared_leaks(gateway, rows, declared, window))
             if finding is not None]
    if found:
        # A time match the rules refused is a request the finding could not count: say how many.
        outcomes = {str(r.gateway): {o: getattr(r, o) for o in JOIN_OUTCOMES} for r in
                    Query(_JOIN_OUTCOMES, engine=window.engine, start=window.start, end=window.end).rows(reader)}
        shared = shared_backends(reader, window)
        for gateway, finding in found:
            counts = outcomes.get(gateway, {})
            finding.evidence["time_matches_refused"] = {o: int(counts.get(o, 0))
                                                        for o in ("ambiguous", "taken", "unjoined")}
            if shared.get(gateway):
                finding.evidence["shared_backends"] = shared[gateway]
    return [finding for _, finding in found]


# Decisions to a backend that stands for several engines (sources/addresses.py): the join looked across them.
_SHARED = f"""
SELECT gateway, engine, any(backend_engines) AS engines, count() AS decisions FROM gateway_decisions
WHERE {IN_WINDOW} AND {EACH_ENGINE} AND notEmpty(backend_engines) GROUP BY gateway, engine ORDER BY gateway, engine
"""


def shared_backends(reader: Reads, window: Window) -> dict[str, dict[str, str]]:
    """gateway -> each backend of its decisions that stands for several engines, and how the join read it."""
    out: dict[str, dict[str, str]] = {}
    for r in Query(_SHARED, engine=window.engine, start=window.start, end=window.end).rows(reader):
        out.setdefault(str(r.gateway), {})[str(r.engine)] = (
            f"{int(r.decisions)} decisions; the engines behind it: {', '.join(map(str, r.engines))} (each decision "
            "matched by time and size across them, or by the id it forwarded)")
    return out


def _matched_by(methods: list[Any]) -> dict[str, int]:
    """How many pairs joined by id and by time and size (and by time alone, where any did)."""
    counts = {"joined_by_id": 0, "joined_by_time_and_size": 0, "joined_by_time": 0}
    for method in methods:
        counts[f"joined_by_{method}"] += 1
    return counts if counts["joined_by_time"] else {k: v for k, v in counts.items() if k != "joined_by_time"}


class _Bar(NamedTuple):
    """The bar a decision recorded: a size in a unit of _UNIT_COLUMN."""

    unit: str
    threshold: float


def _bar(row: Row) -> _Bar | None:
    """A decision's own bar, or None where it recorded none that can be read."""
    unit, threshold = str(row.threshold_unit), number(row.threshold)
    return _Bar(unit, threshold) if unit in _UNIT_COLUMN and threshold > 0 else None


def _leaks(gateway: str, rows: list[Row], window: Window) -> Finding | None:
    """Each decision judged against the bar it recorded itself: a router may change its bar mid-window, or record
    none for some decisions (a hook that failed open); those are counted, never allowed to hide the others."""
    judged = [(r, bar, int(_size(r, bar.unit))) for r in rows
              if (bar := _bar(r)) is not None and _size(r, bar.unit) is not None]
    if len(judged) < MIN_JOINED:
        return None
    # The bar in tokens: at the router's own traffic's median units per token in that unit (the baseline), or as it
    # is when the router counts tokens. A request under its bar whose engine count is at or over this was sent the
    # wrong way.
    typical = {unit: 1.0 if unit == "tokens" else _median([size / int(r.prompt_tokens) for r, bar, size in judged
                                                           if bar.unit == unit])
               for unit in {bar.unit for _, bar, _ in judged}}
    below = [(r, bar, size) for r, bar, size in judged if size < bar.threshold]
    leaked = [(r, bar, size) for r, bar, size in below if int(r.prompt_tokens) >= bar.threshold / typical[bar.unit]]
    if not leaked:
        return None
    worst, (unit, threshold), _ = max(leaked, key=lambda x: int(x[0].prompt_tokens))
    bar_tokens = threshold / typical[unit]
    of_unit = [(r, size) for r, bar, size in judged if bar.unit == unit]
    leaked_of_unit = [(r, size) for r, bar, size in leaked if bar.unit == unit]
    lanes = sorted({str(r.lane) for r, _, _ in below})
    leaked_per_token = sorted(size / int(r.prompt_tokens) for r, size in leaked_of_unit)
    # The bar that would have sent every leaked request of the worst one's unit over it (rounded down).
    would_hold = math.floor(min(size for _, size in leaked_of_unit) / 1000) * 1000 if unit != "tokens" else None
    bars = _bars(judged, leaked)
    evidence: dict[str, Any] = {
        "leaked_requests": len(leaked),
        "monsters": len(leaked) + sum(1 for r, bar, size in judged if size >= bar.threshold
                                      and int(r.prompt_tokens) >= bar.threshold / typical[bar.unit]),
        "lanes_leaked_onto": lanes,
        "threshold": f"{threshold:g} {unit}",
        "threshold_in_tokens": f"{bar_tokens:,.0f} (at the median {typical[unit]:.2f} {unit}/token of "
                               f"{len(of_unit)} requests joined to their engine's count)"
                               if unit != "tokens" else f"{threshold:g}",
        f"leaked_{unit}_per_token": f"{leaked_per_token[0]:.2f}..{leaked_per_token[-1]:.2f}",
        "largest_leak": f"{worst.engine_request_id}: {int(_size(worst, unit)):,} {unit} measured, "
                        f"{int(worst.prompt_tokens):,} tokens counted",
        f"{unit}_per_token_by_lane": {
            lane: round(_median([size / int(r.prompt_tokens) for r, size in of_unit if r.lane == lane]), 2)
            for lane in sorted({str(r.lane) for r, _ in of_unit})},
        "joined_requests": len(judged), **_matched_by([r.matched_by for r, _, _ in judged]),
        "joined_without_a_bar": len(rows) - len(judged),
    }
    if len(bars) > 1:  # the router changed its bar in the window: each decision was judged against its own
        evidence["bars"] = bars
    if would_hold is not None:
        evidence["threshold_that_would_have_held"] = f"{would_hold:,} {unit}"
    # The engine's ids of what leaked: the prefills they caused on the fast lane are this finding's symptoms.
    evidence["request_ids"] = sorted(str(r.engine_request_id) for r, _, _ in leaked)[:MAX_REQUEST_IDS]
    first, last = min(utc(r.decided) for r, _, _ in leaked), max(utc(r.finished) for r, _, _ in leaked)
    lever = (f"measure requests in tokens at the gateway, or lower the bar to {would_hold:,} {unit} (what would have "
             f"sent all {len(leaked_of_unit)} over it); dense code/JSON runs ~3 {unit} per token, prose ~4"
             if would_hold is not None else "the router's token estimate undercounts: count with the model's "
             "tokenizer before routing")
    return Finding(
        "lane_leak", "warning", str(worst.engine), first, last,
        clip(f"{len(leaked)} monsters under the {threshold:g}-{unit} bar of {gateway} went to {', '.join(lanes)}"),
        evidence, Query(_JOINED, engine=window.engine, start=window.start, end=window.end).literal(), lever,
        float(sum(int(r.prompt_tokens) for r, _, _ in leaked)))


# The bars operators declared for routers that do not say theirs (`stepline collect --lane-bar LANE=TOKENS`): each
# collector puts them on the timeline as `lane_bar` events when it starts; the newest up to the window's end holds.
_DECLARED = ("SELECT attributes['lane'] AS lane, argMax(attributes['threshold'], ts) AS tokens FROM events "
             f"WHERE kind = 'lane_bar' AND ts <= {moment('end')} GROUP BY attributes['lane']")


def declared_bars(reader: Reads, window: Window) -> dict[str, int]:
    """lane -> the least prompt, in the engine's tokens, that belongs on it, as its operator declared."""
    return {str(r.lane): int(r.tokens) for r in Query(_DECLARED, end=window.end).rows(reader)
            if str(r.tokens).isdigit() and int(r.tokens) > 0}


def _declared_leaks(gateway: str, rows: list[Row], declared: dict[str, int],
                    window: Window) -> Finding | None:
    """Decisions that carry no bar of their own, judged by the engine's count against the bars declared per lane: a
    prompt belongs on the lane with the largest declared bar it reaches; sent to a lane whose bar is lower, it
    leaked (a router that cannot say its bar: no metadata, a hook stepline cannot change)."""
    if not declared:
        return None
    unjudged = [r for r in rows if _bar(r) is None]
    leaked = []
    for r in unjudged:
        tokens, lane = int(r.prompt_tokens), str(r.lane)
        belongs = max(((bar, name) for name, bar in declared.items() if tokens >= bar), default=None)
        if belongs is not None and lane != belongs[1] and declared.get(lane, 0) < belongs[0]:
            leaked.append((r, belongs))
    if not leaked:
        return None
    worst, (bar, home) = max(leaked, key=lambda x: int(x[0].prompt_tokens))
    lanes = sorted({str(r.lane) for r, _ in leaked})
    evidence: dict[str, Any] = {
        "gateway": gateway, "leaked_requests": len(leaked), "lanes_leaked_onto": lanes,
        "declared_bars": {lane: f"{tokens:,} tokens" for lane, tokens in sorted(declared.items())},
        "threshold_from": "declared by the operator (--lane-bar): the router recorded no bar",
        "largest_leak": f"{worst.engine_request_id}: {int(worst.prompt_tokens):,} tokens counted, sent to "
                        f"{worst.lane} (belongs on {home}, {bar:,} tokens and over)",
        "judged_requests": len(unjudged), **_matched_by([r.matched_by for r in unjudged]),
        "request_ids": sorted(str(r.engine_request_id) for r, _ in leaked)[:MAX_REQUEST_IDS],
    }
    first, last = min(utc(r.decided) for r, _ in leaked), max(utc(r.finished) for r, _ in leaked)
    return Finding(
        "lane_leak", "warning", str(worst.engine), first, last,
        clip(f"{len(leaked)} prompts over {home}'s declared {bar:,}-token bar went to {', '.join(lanes)}"),
        evidence, Query(_JOINED, engine=window.engine, start=window.start, end=window.end).literal(),
        f"make {gateway} count the prompt in the model's tokens before routing (its own measure sends them "
        f"below {home}'s bar), or record the bar it routes by (docs/gateway.md)",
        float(sum(int(r.prompt_tokens) for r, _ in leaked)))


def _bars(judged: list[tuple[Row, _Bar, int]],
          leaked: list[tuple[Row, _Bar, int]]) -> dict[str, str]:
    """Each bar the router decided against in the window: when, how many decisions, how many of them leaked."""
    out: dict[str, str] = {}
    for unit, threshold in sorted({bar for _, bar, _ in judged},
                                  key=lambda b: min(utc(r.decided) for r, bar, _ in judged if bar == b)):
        times = [utc(r.decided) for r, bar, _ in judged if bar == (unit, threshold)]
        n_leaked = sum(1 for _, bar, _ in leaked if bar == (unit, threshold))
        out[f"{threshold:g} {unit}"] = (f"{len(times)} decisions {hms(min(times))}..{hms(max(times))}, "
                                        f"{n_leaked} leaked")
    return out


def _grouped(query: Query, reader: Reads, column: str) -> list[tuple[str, list[Row]]]:
    """The query's rows grouped by one column's text, in that text's order."""
    groups: dict[str, list[Row]] = {}
    for row in query.rows(reader):
        groups.setdefault(str(getattr(row, column)), []).append(row)
    return sorted(groups.items())


def _median(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[len(ordered) // 2] if ordered else 0.0


# Decisions that failed open, per gateway and window, before they are a warning. Three, because what is inferred
# (no size measured, a size over the bar sent under it, a routing that moved) has honest one-offs: an empty prompt
# measures nothing, a prompt at the bar's edge measured twice lands either side. An exception the hook recorded
# swallowing has none: one is named from the first, at info below MIN_FAILED_OPEN (the seed's router swallowed 2 of
# 14: KeyError('messages') twice, named at info; from the third, a warning).
MIN_FAILED_OPEN = 3

# Per gateway and lane: decisions whose hook swallowed an exception, those with no size measured in any unit (a
# hook that failed before measuring), of all; the commonest swallowed exceptions.
# Unmeasured counts only against a bar in force: a gateway that does not route by size measures nothing, rightly.
_UNMEASURED = "threshold IS NOT NULL AND size_chars IS NULL AND size_bytes IS NULL AND size_tokens IS NULL"
_FAILED = f"swallowed_exception != '' OR ({_UNMEASURED})"
# The size in the bar's unit (NULL where unmeasured or no bar): a decision at or over the bar sent to the lane that
# takes what is under it was routed against the router's own measure, a hook that failed open after measuring.
_SIZED = size_in_unit()
_FAILED_OPEN = f"""
SELECT gateway, lane, count() AS decisions, countIf(swallowed_exception != '') AS swallowed,
       countIf({_UNMEASURED}) AS unmeasured,
       topKIf(3)(swallowed_exception, swallowed_exception != '') AS exceptions,
       minIf(ts, {_FAILED}) AS first, maxIf(ts, {_FAILED}) AS last, topKIf(1)(engine, {_FAILED}) AS backend,
       countIf({_SIZED} < threshold) AS under_bar,
       countIf({_SIZED} >= threshold AND swallowed_exception = '') AS over_bar,
       minIf(ts, {_SIZED} >= threshold) AS first_over, maxIf(ts, {_SIZED} >= threshold) AS last_over,
       topKIf(1)(engine, {_SIZED} >= threshold AND swallowed_exception = '') AS over_backend
FROM gateway_decisions
WHERE {IN_WINDOW} AND {EACH_ENGINE}
GROUP BY gateway, lane ORDER BY gateway, lane
"""
# The engine requests that failed-open decisions became: the prefills they caused are the finding's symptoms.
_FAILED_REQUESTS = joined("r.request_id AS request_id, m.matched_by AS matched_by",
                          f"gateway = {param('gateway', 'String')} AND ({_FAILED})", ("ts",))

# A hook that fails open and records nothing at all (no bar, no exception: the seed's bare `except: return data`
# before it logged anything) leaves decisions that say only where each request went and, where the gateway measures
# by itself (LiteLLM's callback counts the prompt's characters), how large it was. What gives it away is the
# gateway's own routing changing while the sizes do not: the baseline is the earlier half of its first attempts in
# the window, where its upper lane (the one whose sizes run largest) took everything from some size on (the least
# size it sent there: the bar as routed). A baseline that did not route by size (more than ROUTED_BAR_NOISE of what
# measured at or over that bar went elsewhere: clients choosing their lane, a bar in another unit) sets no rule.
# In the later half, a decision at or over the bar as routed, with no bar and nothing swallowed of its own, that
# went to another lane was routed against the gateway's own rule, where most of that half's decisions at or over
# the bar did (SHIFTED_SHARE).

# Of the earlier half's decisions at or over the bar as routed, the share that may have gone elsewhere with the
# routing still taken as a rule by size
ROUTED_BAR_NOISE = 0.05
# Of the later half's decisions at or over the bar as routed, the share that must have gone elsewhere: the routing
# moved, not a few requests near the bar (a router that bars in tokens, seen here in characters, sends prose a little
# over the bar's characters to the lower lane rightly)
SHIFTED_SHARE = 0.5
_SIZE = "coalesce(size_chars, size_bytes, size_tokens)"  # a gateway measures in one unit; it is compared with itself
_ROUTED = f"attempt <= 1 AND {_SIZE} IS NOT NULL"  # routing decisions (a retry or fallback goes where it must)
_HALVES = f"""
SELECT gateway, min(ts) AS first, max(ts) AS last FROM gateway_decisions
WHERE {IN_WINDOW} AND {EACH_ENGINE} AND {_ROUTED}
GROUP BY gateway HAVING uniqExact(lane) >= 2 ORDER BY gateway
"""
_MID = "fromUnixTimestamp64Micro({mids:Array(Int64)}[indexOf({gateways:Array(String)}, gateway)], 'UTC')"
_EARLIER_LANES = f"""
SELECT gateway, lane, count() AS decisions, quantileExact(0.5)({_SIZE}) AS median_size,
       min({_SIZE}) AS least_size
FROM gateway_decisions
WHERE {IN_WINDOW} AND {EACH_ENGINE} AND {_ROUTED} AND has({param('gateways', 'Array(String)')}, gateway) AND ts < {_MID}
GROUP BY gateway, lane ORDER BY gateway, lane
"""
_AT_THE_BAR = ("has({gateways:Array(String)}, gateway) AND "
               f"{_SIZE} >= {param('bars', 'Array(Float64)')}[indexOf({param('gateways', 'Array(String)')}, gateway)]")
_OFF_THE_RULE = "lane != {uppers:Array(String)}[indexOf({gateways:Array(String)}, gateway)]"
_SHIFTED_NOW = (f"ts >= {_MID} AND {_OFF_THE_RULE} AND threshold IS NULL AND swallowed_exception = ''")
_SHIFT = f"""
SELECT gateway,
       countIf(ts < {_MID}) AS earlier, countIf(ts < {_MID} AND {_AT_THE_BAR}) AS earlier_at_bar,
       countIf(ts < {_MID} AND {_AT_THE_BAR} AND {_OFF_THE_RULE}) AS earlier_elsewhere,
       countIf(ts >= {_MID}) AS later, countIf(ts >= {_MID} AND {_AT_THE_BAR}) AS later_at_bar,
       countIf({_AT_THE_BAR} AND {_SHIFTED_NOW}) AS shifted,
       minIf(ts, {_AT_THE_BAR} AND {_SHIFTED_NOW}) AS first, maxIf(ts, {_AT_THE_BAR} AND {_SHIFTED_NOW}) AS last,
       topKIf(1)(engine, {_AT_THE_BAR} AND {_SHIFTED_NOW}) AS backend,
       sumMapIf([lane], [toUInt64(1)], {_AT_THE_BAR} AND {_SHIFTED_NOW}) AS lanes
FROM gateway_decisions
WHERE {IN_WINDOW} AND {EACH_ENGINE} AND {_ROUTED} AND has({param('gateways', 'Array(String)')}, gateway)
GROUP BY gateway ORDER BY gateway
"""
_SHIFTED_REQUESTS = joined("r.request_id AS request_id, m.matched_by AS matched_by",
                           f"gateway = {param('gateway', 'String')} AND {_ROUTED} AND {_AT_THE_BAR} "
                           f"AND {_SHIFTED_NOW}", ("ts",))


@dataclass(frozen=True)
class _Shift:
    """A gateway whose later decisions went against the routing of its earlier ones (see ROUTED_BAR_NOISE)."""

    upper: str
    bar: float
    mid: datetime
    earlier: tuple[int, int, int]  # decisions, at or over the bar, of those elsewhere
    later: tuple[int, int]  # decisions, at or over the bar
    shifted: int
    first: datetime
    last: datetime
    backend: str
    lanes: dict[str, int]  # where the shifted decisions went, and how many each
    params: dict[str, Any]


def _shifts(reader: Reads, window: Window) -> dict[str, _Shift]:
    """gateway -> its routing that changed (at least MIN_FAILED_OPEN decisions), for each gateway that has one."""
    halves = Query(_HALVES, engine=window.engine, start=window.start, end=window.end).rows(reader)
    if not halves:
        return {}
    mids = {str(r.gateway): utc(r.first) + (utc(r.last) - utc(r.first)) / 2 for r in halves}
    base: dict[str, Any] = {"engine": window.engine, "start": window.start, "end": window.end,
                            "gateways": sorted(mids), "mids": [round(mids[g].timestamp() * 1e6) for g in sorted(mids)]}
    rules: dict[str, tuple[str, float]] = {}
    for gateway, lanes in _grouped(Query(_EARLIER_LANES, **base), reader, "gateway"):
        if len(lanes) >= 2:
            largest = max(lanes, key=lambda r: number(r.median_size))  # the lane whose median size is the largest
            rules[gateway] = (str(largest.lane), number(largest.least_size))
    if not rules:
        return {}
    names = sorted(rules)
    params = {**base, "gateways": names, "mids": [round(mids[g].timestamp() * 1e6) for g in names],
              "uppers": [rules[g][0] for g in names], "bars": [rules[g][1] for g in names]}
    out = {}
    for r in Query(_SHIFT, **params).rows(reader):
        if (int(r.shifted) < MIN_FAILED_OPEN or int(r.earlier_elsewhere) > ROUTED_BAR_NOISE * int(r.earlier_at_bar)
                or int(r.shifted) < SHIFTED_SHARE * int(r.later_at_bar)):
            continue
        gateway = str(r.gateway)
        upper, bar = rules[gateway]
        lanes, counts = r.lanes  # sumMap's (keys, values)
        out[gateway] = _Shift(upper, bar, mids[gateway],
                              (int(r.earlier), int(r.earlier_at_bar), int(r.earlier_elsewhere)),
                              (int(r.later), int(r.later_at_bar)), int(r.shifted), utc(r.first), utc(r.last),
                              str(_first(r.backend)), {str(k): int(v) for k, v in zip(lanes, counts, strict=True)},
                              {**params, "gateway": gateway})
    return out


def gateway_fail_open(reader: Reads, window: Window) -> list[Finding]:
    """A routing hook that caught its own errors and routed anyway: exceptions swallowed, sizes never measured,
    sizes over the bar sent below it, or, with nothing recorded, the gateway's routing changed while sizes held."""
    query = Query(_FAILED_OPEN, engine=window.engine, start=window.start, end=window.end)
    shifts = _shifts(reader, window)
    findings = []
    for gateway, lanes in _grouped(query, reader, "gateway"):
        total = sum(int(r.decisions) for r in lanes)
        swallowed = sum(int(r.swallowed) for r in lanes)
        unmeasured = sum(int(r.unmeasured) for r in lanes)
        misrouted, below = _misrouted(lanes)
        shift = shifts.get(gateway)
        shifted = shift.shifted if shift is not None else 0
        # A decision both swallowed and unmeasured is one that failed open, once; a shifted one has neither.
        failed = max(swallowed, unmeasured) + misrouted + shifted
        if failed < MIN_FAILED_OPEN and not swallowed:
            continue
        hit = [r for r in lanes if int(r.swallowed) or int(r.unmeasured) or (misrouted and r is below)]
        exceptions = sorted({str(e) for r in hit for e in r.exceptions})
        went: dict[str, int] = {
            str(r.lane): max(int(r.swallowed), int(r.unmeasured)) + (misrouted if r is below else 0) for r in hit}
        # Named after the backend most of them went to (the default lane's, as a rule).
        top = max(hit, key=lambda r: went[str(r.lane)], default=None)
        busiest = str(_first(top.backend or top.over_backend)) if top is not None else ""
        if shift is not None and shifted >= max(went.values(), default=0):
            busiest = shift.backend
        requests = Query(_FAILED_REQUESTS, engine=window.engine, start=window.start, end=window.end,
                         gateway=gateway).rows(reader)
        if shift is not None:
            requests += Query(_SHIFTED_REQUESTS, **shift.params).rows(reader)
            for lane, n in shift.lanes.items():
                went[lane] = went.get(lane, 0) + n
        evidence: dict[str, Any] = {
            "failed_open": failed, "decisions": total, "share": f"{failed / total:.1%}",
            "swallowed_exceptions": swallowed, "unmeasured_decisions": unmeasured,
            "exceptions": exceptions[:3],
            "routed_against_its_measure": misrouted,
            "lanes_they_went_to": went,
            "counted_from": f"a warning from {MIN_FAILED_OPEN} decisions in the window; a swallowed exception "
                            "the hook recorded is named from the first, at info",
            "request_ids": sorted({str(r.request_id) for r in requests})[:MAX_REQUEST_IDS],
            **_matched_by([r.matched_by for r in requests]),
        }
        moments = [(utc(r.first), utc(r.last)) for r in hit if int(r.swallowed) or int(r.unmeasured)]
        if misrouted and below is not None:
            moments.append((utc(below.first_over), utc(below.last_over)))
        if shift is not None:
            evidence.update(_shift_evidence(shift))
            moments.append((shift.first, shift.last))
        findings.append(Finding(
            "gateway_fail_open", "warning" if failed >= MIN_FAILED_OPEN else "info", busiest,
            min(m[0] for m in moments), max(m[1] for m in moments),
            clip(f"{gateway}: {failed} of {total} routing decisions failed open"
                 + (f" ({exceptions[0]})" if exceptions else "")),
            evidence, query.literal(),
            "the routing hook catches its own errors and routes anyway: log and count what it catches, fix the "
            "exception, and let a request that cannot be sized fail or go to the lane that can hold any size",
            float(failed)))
    return findings


def _shift_evidence(shift: _Shift) -> dict[str, Any]:
    """What the earlier half routed by, and how the later half went against it while the sizes held."""
    earlier, earlier_at_bar, elsewhere = shift.earlier
    later, later_at_bar = shift.later
    return {
        "routed_against_its_earlier_rule": shift.shifted,
        "bar_as_routed": f"{shift.bar:,.0f} (the least size {shift.upper} took before {hms(shift.mid)} UTC; "
                         f"{elsewhere} of {earlier_at_bar} at or over it went elsewhere then, noise up to "
                         f"{ROUTED_BAR_NOISE:.0%})",
        "size_mix_at_or_over_the_bar": f"{earlier_at_bar / earlier:.1%} of {earlier} before, "
                                       f"{later_at_bar / later:.1%} of {later} after" if earlier and later else "",
        "went_to_instead": dict(sorted(shift.lanes.items())),
        "moved_share": f"{shift.shifted} of the later half's {later_at_bar} at or over the bar went elsewhere "
                       f"(a finding from {SHIFTED_SHARE:.0%})",
    }


def _misrouted(lanes: list[Row]) -> tuple[int, Row | None]:
    """Decisions at or over the bar, nothing swallowed, sent to the lane that takes what is under it (the lane with
    the most under the bar), where another lane takes what is over it; and that lane's row."""
    below = max(lanes, key=lambda r: int(r.under_bar), default=None)
    if below is None or not int(below.under_bar) or not any(int(r.over_bar) for r in lanes if r is not below):
        return 0, None
    return int(below.over_bar), below


# The gateway's own count of requests in flight to one backend, as each gateway exports it: vllm-router's running
# requests per worker (its load counter misses cancellation paths: vllm-router PRs #200, #215); a home-made router
# exports its slots under the same kind of name.
IN_FLIGHT_METRICS = ("vllm_router_running_requests", "vllm_router_worker_load")
# A home-made router says, with each decision, how many slots it held on the backend (stepline.gateway.in_flight).
DECISIONS_IN_FLIGHT = "gateway_decisions.in_flight"
LEAK_TAIL_SHARE = 0.25  # the last quarter of what the gateway reported: leaked slots are held, so they show there
MIN_LEAKED_SLOTS = 2  # in flight at the gateway beyond what the engine holds, in every scrape of the tail

def _held_in_steps(lo: str, hi: str, engines: str) -> str:
    """Per engine from `lo` to `hi` (bound names) among `engines` (a filter): the most requests running or waiting
    in any of its steps (`held`), and how many steps did work (`steps`)."""
    return (f"SELECT engine, max(running + waiting) AS held, countIf(num_generation_tokens + num_ctx_tokens > 0) AS "
            f"steps FROM steps WHERE {between(lo, hi)} AND {engines} GROUP BY engine")


def _held_in_gauges(lo: str, hi: str, engines: str) -> str:
    """As _held_in_steps, from the engine's own gauges (vLLM's running + waiting per scrape): an engine that did not
    step still says what it holds."""
    return ("SELECT engine, max(value) AS held FROM (SELECT engine, ts, sum(value) AS value FROM engine_samples "
            f"WHERE {between(lo, hi)} AND {engines} AND metric IN ('vllm:num_requests_running', "
            "'vllm:num_requests_waiting') GROUP BY engine, ts) GROUP BY engine")


# Per backend over the window's tail: the gateway's in-flight count (its least and last value per metric), and
# what the engine held meanwhile: the most requests running or waiting in any step, and how many steps did work.
_SLOTS = f"""
SELECT g.engine AS engine, g.gateway AS gateway, g.metric AS metric, g.least AS least, g.latest AS latest,
       g.samples AS samples,
       ifNull(s.held, 0) AS engine_held, ifNull(s.steps, 0) AS busy_steps, ifNull(m.held, -1) AS scraped_held
FROM (SELECT engine, gateway, metric, min(value) AS least, argMax(value, ts) AS latest, count() AS samples
      FROM gateway_samples
      WHERE {between("tail", "end")} AND {EACH_ENGINE} AND engine != ''
        AND metric IN {param('metrics', 'Array(String)')}
      GROUP BY engine, gateway, metric
      UNION ALL
      SELECT engine, gateway, '{DECISIONS_IN_FLIGHT}' AS metric, toFloat64(min(in_flight)) AS least,
             toFloat64(argMax(in_flight, ts)) AS latest, count() AS samples
      FROM gateway_decisions
      WHERE {between("tail", "end")} AND {EACH_ENGINE} AND engine != '' AND in_flight IS NOT NULL
      GROUP BY engine, gateway) AS g
LEFT JOIN ({_held_in_steps("tail", "end", EACH_ENGINE)}) AS s ON s.engine = g.engine
LEFT JOIN ({_held_in_gauges("tail", "end", EACH_ENGINE)}) AS m ON m.engine = g.engine
ORDER BY g.engine, g.gateway, g.metric
"""
_GATEWAY_SPAN = f"""
SELECT engine, min(ts) AS first, max(ts) AS last FROM (
    SELECT engine, ts FROM gateway_decisions
    WHERE {IN_WINDOW} AND {EACH_ENGINE} AND engine != '' AND in_flight IS NOT NULL
    UNION ALL
    SELECT engine, ts FROM gateway_samples WHERE {IN_WINDOW} AND {EACH_ENGINE} AND engine != ''
        AND metric IN {param('metrics', 'Array(String)')})
GROUP BY engine ORDER BY engine
"""
_DISCONNECTS = f"""
SELECT engine, countIf(client_disconnected) AS disconnects, count() AS decisions
FROM gateway_decisions WHERE {IN_WINDOW} AND {EACH_ENGINE} AND engine != '' GROUP BY engine
"""
_GPU_UTIL = f"""
SELECT engine, avg(util_gpu_pct) AS util_pct FROM gpu_samples
WHERE {between("tail", "end")} AND {EACH_ENGINE} AND engine != ''
GROUP BY engine
"""


# A lane that refuses everything while its engines hold nothing is the same leak seen from the gateway's answers,
# where it exports no slot count (LiteLLM's hook slots, its max_parallel_requests limiter): at least MIN_REFUSED
# refusals (429 or 503) since the lane last served one, over REFUSAL_PATIENCE_S or more, while every engine the lane
# sent work to in the window held no request running or waiting. The engines behind a lane are those its served
# decisions went to: a refusal before any deployment is called names none.
_RELEASE_SLOTS = ("release the gateway's slot on every exit path, a client disconnect included (a finally around the "
                  "proxied stream), then restart the gateway or reset its counters to free what leaked")
MIN_REFUSED = 3
REFUSAL_PATIENCE_S = 10.0
_REFUSED = "status IN (429, 503)"
_REFUSALS = f"""
SELECT gateway, lane, countIf({_REFUSED} AND ts > served) AS refused, minIf(ts, {_REFUSED} AND ts > served) AS first,
       maxIf(ts, {_REFUSED} AND ts > served) AS last, groupUniqArrayIf(engine, engine != '') AS engines,
       topKIf(2)(status, {_REFUSED} AND ts > served) AS statuses,
       countIf(client_disconnected) AS disconnects
FROM (SELECT *, max(if(status > 0 AND status < 400, ts, toDateTime64(0, 6, 'UTC'))) OVER (PARTITION BY gateway, lane)
             AS served
      FROM gateway_decisions WHERE {IN_WINDOW} AND lane != '')
GROUP BY gateway, lane HAVING refused >= {MIN_REFUSED} ORDER BY gateway, lane
"""
_HELD = f"""
SELECT max(held) AS most_held, sum(steps) AS busy_steps FROM (
    SELECT toFloat64(held) AS held, steps FROM ({_held_in_steps("first", "last", ENGINES)})
    UNION ALL
    SELECT held, toUInt64(0) AS steps FROM ({_held_in_gauges("first", "last", ENGINES)}))
"""


def _refusing(reader: Reads, window: Window) -> list[Finding]:
    """Lanes that refused all they were asked for REFUSAL_PATIENCE_S while their engines held nothing."""
    findings = []
    query = Query(_REFUSALS, start=window.start, end=window.end)
    for r in query.rows(reader):
        gateway, lane, refused, first, last, statuses, gone = (
            r.gateway, r.lane, r.refused, r.first, r.last, r.statuses, r.disconnects)
        behind = sorted(str(e) for e in r.engines if not window.engine or e == window.engine)
        span = (utc(last) - utc(first)).total_seconds()
        if not behind or span < REFUSAL_PATIENCE_S:
            continue
        params = {"first": utc(first), "last": utc(last), "engines": behind}
        (engines_held,) = Query(_HELD, **params).rows(reader)
        held, busy = int(number(engines_held.most_held)), int(number(engines_held.busy_steps))
        if held > 0:
            continue
        evidence: dict[str, Any] = {
            "refused": int(refused), "refusing_for_s": round(span, 1), "statuses": [int(x) for x in statuses],
            "engines_behind_lane": behind, "engines_running_plus_waiting_max": held, "engine_busy_steps": int(busy),
            "client_disconnects_on_lane": int(gone),
            "leak_from": f"{MIN_REFUSED} or more refusals (429/503) since the lane last served one, over "
                         f"{REFUSAL_PATIENCE_S:g} s or more, while its engines held no request",
        }
        idle = int(busy) == 0
        findings.append(Finding(
            "gateway_slot_leak", "critical" if idle else "warning", behind[0], utc(first), utc(last),
            clip(f"{gateway} refused {int(refused)} on lane {lane} for {span:.0f}s, its engines holding nothing"),
            evidence, query.literal(), _RELEASE_SLOTS,
            span * int(refused)))
    return findings


def gateway_slot_leak(reader: Reads, window: Window) -> list[Finding]:
    """The gateway holds requests in flight to a backend that the engine does not have: slots leaked at the
    gateway (released on success or failure, never on a client's disconnect) while the engine sits idle. Seen in
    the gateway's own count of slots, or, where it exports none, in a lane refusing while its engines hold nothing."""
    refusing = _refusing(reader, window) if _decided(reader, window) else []
    spans = Query(_GATEWAY_SPAN, engine=window.engine, start=window.start, end=window.end,
                  metrics=list(IN_FLIGHT_METRICS)).rows(reader)
    if not spans:
        return refusing
    disconnects = {str(r.engine): (int(r.disconnects), int(r.decisions)) for r in
                   Query(_DISCONNECTS, engine=window.engine, start=window.start, end=window.end).rows(reader)}
    findings = []
    for engine, first, last in ((r.engine, r.first, r.last) for r in spans):
        # The tail of what the gateway reported about this backend (a window may reach well past it, e.g. --since
        # 1h over a 10-minute story). The gateway's count is from its /metrics or from its decisions: each decision
        # made in the tail says what the gateway held then, and a lane whose slots leaked refuses with all held.
        tail = utc(last) - (utc(last) - utc(first)) * LEAK_TAIL_SHARE
        found = _leak(reader, window, str(engine), tail, disconnects.get(str(engine), (0, 0)))
        if found is not None:
            findings.append(found)
    counted = {f.engine for f in findings}
    return findings + [f for f in refusing if f.engine not in counted]


def _leak(reader: Reads, window: Window, engine: str, tail: datetime, disconnects: tuple[int, int]
          ) -> Finding | None:
    params: dict[str, Any] = {"engine": engine, "tail": tail, "end": window.end, "metrics": list(IN_FLIGHT_METRICS)}
    query = Query(_SLOTS, **params)
    for r in query.rows(reader):
        gateway, metric, least, latest, samples, held, busy, scraped = (
            r.gateway, r.metric, r.least, r.latest, r.samples, r.engine_held, r.busy_steps, r.scraped_held)
        # What the engine holds: its steps' running + waiting, or its own gauges where it did not step.
        holds = max(int(held), int(number(scraped, 0.0)))
        leaked = number(least) - holds
        if leaked < MIN_LEAKED_SLOTS:
            continue
        gone, decided = disconnects
        evidence: dict[str, Any] = {
            "gateway_in_flight_least": round(number(least)), "gateway_in_flight_last": round(number(latest)),
            "engine_running_plus_waiting_max": holds, "leaked_slots": round(leaked),
            "engine_busy_steps": int(busy), "gateway_metric": f"{gateway} {metric}",
            "client_disconnects": f"{gone} of {decided} decisions to this backend" if decided else "no decisions",
            "leak_from": f"{MIN_LEAKED_SLOTS} slots beyond the engine's own running + waiting, in every one of "
                         f"{int(samples)} {'decisions' if metric == DECISIONS_IN_FLIGHT else 'scrapes'} of the "
                         f"gateway's last {LEAK_TAIL_SHARE:.0%} in the window",
        }
        gpu = [number(g.util_pct, math.nan) for g in Query(_GPU_UTIL, **params).rows(reader)]
        if gpu and math.isfinite(gpu[0]):
            evidence["gpu_util_pct"] = round(gpu[0], 1)
        idle = int(busy) == 0
        return Finding(
            "gateway_slot_leak", "critical" if idle else "warning", engine, tail, window.end,
            clip(f"{gateway} holds {round(number(least))} slots on {engine}, the engine {holds}"
                 + (": engine idle" if idle else "")),
            evidence, query.literal(),
            _RELEASE_SLOTS,
            leaked * (window.end - tail).total_seconds())
    return None

ORPHAN_SLACK_S = 1.0  # an engine request that finished this long after its client left ran on for nobody

# Decisions whose client left, beside the engine request that then ran on to its end: the engine's finish, its
# tokens generated, its time decoding. A request the engine aborted has no row (vLLM 0.32 reports no finished
# stats and no span for an abort: shared/DESIGN.md), so what joins ran to the end.
_ORPHANS = joined("d.gateway AS gateway, d.engine AS engine, "
                  "if(d.request_id = '', r.request_id, d.request_id) AS request_id, d.end_ts AS left_at, "
                  "r.ts AS finished, r.generation_tokens AS generation_tokens, r.decode_seconds AS decode_seconds, "
                  "m.matched_by AS matched_by",
                  "client_disconnected", ("ts", "generation_tokens", "decode_seconds"),
                  f"r.ts > d.end_ts + toIntervalMillisecond({round(ORPHAN_SLACK_S * 1000)})")


def orphaned_engine_work(reader: Reads, window: Window) -> list[Finding]:
    """The client went away at the gateway, and the engine ran the request to its end anyway: work for nobody."""
    if not _decided(reader, window):
        return []
    query = Query(_ORPHANS, engine=window.engine, start=window.start, end=window.end)
    findings = []
    for engine, orphans in _grouped(query, reader, "engine"):
        after = [(utc(r.finished) - utc(r.left_at)).total_seconds() for r in orphans]
        gateways = sorted({str(r.gateway) for r in orphans})
        worst = max(orphans, key=lambda r: utc(r.finished) - utc(r.left_at))
        findings.append(Finding(
            "orphaned_engine_work", "warning", engine, min(utc(r.left_at) for r in orphans),
            max(utc(r.finished) for r in orphans),
            clip(f"{len(orphans)} requests ran on {engine} {sum(after):.0f}s after their clients left"),
            {"orphaned_requests": len(orphans), "engine_s_after_disconnect": round(sum(after), 1),
             "tokens_generated": sum(int(r.generation_tokens) for r in orphans), "gateways": gateways,
             "longest": f"{worst.request_id}: {(utc(worst.finished) - utc(worst.left_at)).total_seconds():.1f}s "
                        "after the client left",
             "counted_from": f"a finish {ORPHAN_SLACK_S:g}s or more after the gateway saw the client go",
             **_matched_by([r.matched_by for r in orphans])},
            query.literal(),
            "cancel the upstream request when the client disconnects: close the connection to the engine on the "
            "gateway's disconnect path, so that vLLM aborts the request and frees its slot and KV cache",
            sum(after)))
    return findings
