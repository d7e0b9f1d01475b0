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
from typing import Any

from stepline.diagnosis.common import clip, hms, number, utc
from stepline.diagnosis.findings import Finding, Window
from stepline.queries.gateway import JOIN_OUTCOMES, MIN_JOINED, join_outcomes, joined, size_in_unit
from stepline.queries.query import Query, moment, param
from stepline.queries.window import EACH_ENGINE, ENGINES, IN_WINDOW, between
from stepline.store.reads import Reads

MAX_REQUEST_IDS = 50  # engine request ids a finding lists, for the findings they explain (diagnosis/causes.py)


# Every decision with the engine's count of the request it became (on the engine it ran on: one of several behind a
# backend that stands for more than one); each is judged against the bar it recorded (those that recorded none are
# counted as such).
_JOINED = joined("d.gateway, d.lane, r.engine, d.request_id, d.size_chars, d.size_bytes, d.size_tokens, "
                 "d.threshold, d.threshold_unit, r.prompt_tokens, d.ts, r.request_id, r.ts, m.matched_by",
                 "1", ("ts", "prompt_tokens"), "r.prompt_tokens > 0")
_JOIN_OUTCOMES = join_outcomes("1")  # how _JOINED's decisions joined, refusals included
_UNIT_COLUMN = {"chars": 4, "bytes": 5, "tokens": 6}  # the row's index of the size in each unit


# Whether any gateway reported in the window: the joins read the engine's requests, and a fleet with no gateway in
# front must not pay for them (0.6 s each over 64 engines x 24 h).
_ANY_DECISION = f"SELECT count() FROM (SELECT 1 FROM gateway_decisions WHERE {IN_WINDOW} AND {EACH_ENGINE} LIMIT 1)"


def _decided(reader: Reads, window: Window) -> bool:
    rows = Query(_ANY_DECISION, engine=window.engine, start=window.start, end=window.end).rows(reader)
    return bool(rows and int(rows[0][0]))


def lane_leak(reader: Reads, window: Window) -> list[Finding]:
    """Requests the router measured under its bar, so sent to the lane below it, that the engine counted above
    the bar's worth of tokens."""
    if not _decided(reader, window):
        return []
    declared = declared_bars(reader, window)
    found = [(gateway, finding) for gateway, rows in
             _grouped(Query(_JOINED, engine=window.engine, start=window.start, end=window.end), reader, 0)
             for finding in (_leaks(gateway, rows, window), _declared_leaks(gateway, rows, declared, window))
             if finding is not None]
    if found:
        # A time match the rules refused is a request the finding could not count: say how many.
        outcomes = {str(r[0]): dict(zip(JOIN_OUTCOMES, r[1:], strict=True)) for r in
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
SELECT gateway, engine, any(backend_engines), count() FROM gateway_decisions
WHERE {IN_WINDOW} AND {EACH_ENGINE} AND notEmpty(backend_engines) GROUP BY gateway, engine ORDER BY gateway, engine
"""


def shared_backends(reader: Reads, window: Window) -> dict[str, dict[str, str]]:
    """gateway -> each backend of its decisions that stands for several engines, and how the join read it."""
    out: dict[str, dict[str, str]] = {}
    for gateway, backend, engines, decisions in Query(_SHARED, engine=window.engine, start=window.start,
                                                      end=window.end).rows(reader):
        out.setdefault(str(gateway), {})[str(backend)] = (
            f"{int(decisions)} decisions; the engines behind it: {', '.join(map(str, engines))} (each decision "
            "matched by time and size across them, or by the id it forwarded)")
    return out


def _matched_by(methods: list[Any]) -> dict[str, int]:
    """How many pairs joined by id and by time and size (and by time alone, where any did)."""
    counts = {"joined_by_id": 0, "joined_by_time_and_size": 0, "joined_by_time": 0}
    for method in methods:
        counts[f"joined_by_{method}"] += 1
    return counts if counts["joined_by_time"] else {k: v for k, v in counts.items() if k != "joined_by_time"}


def _bar(row: tuple[Any, ...]) -> tuple[str, float] | None:
    """A decision's own bar (unit, threshold), or None where it recorded none that can be read."""
    unit, threshold = str(row[8]), number(row[7])
    return (unit, threshold) if unit in _UNIT_COLUMN and threshold > 0 else None


def _leaks(gateway: str, rows: list[tuple[Any, ...]], window: Window) -> Finding | None:
    """Each decision judged against the bar it recorded itself: a router may change its bar mid-window, or record
    none for some decisions (a hook that failed open); those are counted, never allowed to hide the others."""
    judged = [(r, bar, int(r[_UNIT_COLUMN[bar[0]]])) for r in rows
              if (bar := _bar(r)) is not None and r[_UNIT_COLUMN[bar[0]]] is not None]
    if len(judged) < MIN_JOINED:
        return None
    # The bar in tokens: at the router's own traffic's median units per token in that unit (the baseline), or as it
    # is when the router counts tokens. A request under its bar whose engine count is at or over this was sent the
    # wrong way.
    typical = {unit: 1.0 if unit == "tokens" else _median([size / int(r[9]) for r, bar, size in judged
                                                           if bar[0] == unit])
               for unit in {bar[0] for _, bar, _ in judged}}
    below = [(r, bar, size) for r, bar, size in judged if size < bar[1]]
    leaked = [(r, bar, size) for r, bar, size in below if int(r[9]) >= bar[1] / typical[bar[0]]]
    if not leaked:
        return None
    worst, (unit, threshold), _ = max(leaked, key=lambda x: int(x[0][9]))
    bar_tokens = threshold / typical[unit]
    of_unit = [(r, size) for r, bar, size in judged if bar[0] == unit]
    leaked_of_unit = [(r, size) for r, bar, size in leaked if bar[0] == unit]
    lanes = sorted({str(r[1]) for r, _, _ in below})
    leaked_per_token = sorted(size / int(r[9]) for r, size in leaked_of_unit)
    # The bar that would have sent every leaked request of the worst one's unit over it (rounded down).
    would_hold = math.floor(min(size for _, size in leaked_of_unit) / 1000) * 1000 if unit != "tokens" else None
    bars = _bars(judged, leaked)
    evidence: dict[str, Any] = {
        "leaked_requests": len(leaked),
        "monsters": len(leaked) + sum(1 for r, bar, size in judged
                                      if size >= bar[1] and int(r[9]) >= bar[1] / typical[bar[0]]),
        "lanes_leaked_onto": lanes,
        "threshold": f"{threshold:g} {unit}",
        "threshold_in_tokens": f"{bar_tokens:,.0f} (at the median {typical[unit]:.2f} {unit}/token of "
                               f"{len(of_unit)} requests joined to their engine's count)"
                               if unit != "tokens" else f"{threshold:g}",
        f"leaked_{unit}_per_token": f"{leaked_per_token[0]:.2f}..{leaked_per_token[-1]:.2f}",
        "largest_leak": f"{worst[11]}: {int(worst[_UNIT_COLUMN[unit]]):,} {unit} measured, "
                        f"{int(worst[9]):,} tokens counted",
        f"{unit}_per_token_by_lane": {lane: round(_median([size / int(r[9]) for r, size in of_unit if r[1] == lane]),
                                                  2) for lane in sorted({str(r[1]) for r, _ in of_unit})},
        "joined_requests": len(judged), **_matched_by([r[13] for r, _, _ in judged]),
        "joined_without_a_bar": len(rows) - len(judged),
    }
    if len(bars) > 1:  # the router changed its bar in the window: each decision was judged against its own
        evidence["bars"] = bars
    if would_hold is not None:
        evidence["threshold_that_would_have_held"] = f"{would_hold:,} {unit}"
    # The engine's ids of what leaked: the prefills they caused on the fast lane are this finding's symptoms.
    evidence["request_ids"] = sorted(str(r[11]) for r, _, _ in leaked)[:MAX_REQUEST_IDS]
    first, last = min(utc(r[10]) for r, _, _ in leaked), max(utc(r[12]) for r, _, _ in leaked)
    lever = (f"measure requests in tokens at the gateway, or lower the bar to {would_hold:,} {unit} (what would have "
             f"sent all {len(leaked_of_unit)} over it); dense code/JSON runs ~3 {unit} per token, prose ~4"
             if would_hold is not None else "the router's token estimate undercounts: count with the model's "
             "tokenizer before routing")
    return Finding(
        "lane_leak", "warning", str(worst[2]), first, last,
        clip(f"{len(leaked)} monsters under the {threshold:g}-{unit} bar of {gateway} went to {', '.join(lanes)}"),
        evidence, Query(_JOINED, engine=window.engine, start=window.start, end=window.end).literal(), lever,
        float(sum(int(r[9]) for r, _, _ in leaked)))


# The bars operators declared for routers that do not say theirs (`stepline collect --lane-bar LANE=TOKENS`): each
# collector puts them on the timeline as `lane_bar` events when it starts; the newest up to the window's end holds.
_DECLARED = ("SELECT attributes['lane'], argMax(attributes['threshold'], ts) FROM events "
             f"WHERE kind = 'lane_bar' AND ts <= {moment('end')} GROUP BY attributes['lane']")


def declared_bars(reader: Reads, window: Window) -> dict[str, int]:
    """lane -> the least prompt, in the engine's tokens, that belongs on it, as its operator declared."""
    return {str(lane): int(tokens) for lane, tokens in Query(_DECLARED, end=window.end).rows(reader)
            if str(tokens).isdigit() and int(tokens) > 0}


def _declared_leaks(gateway: str, rows: list[tuple[Any, ...]], declared: dict[str, int],
                    window: Window) -> Finding | None:
    """Decisions that carry no bar of their own, judged by the engine's count against the bars declared per lane: a
    prompt belongs on the lane with the largest declared bar it reaches; sent to a lane whose bar is lower, it
    leaked (a router that cannot say its bar: no metadata, a hook stepline cannot change)."""
    if not declared:
        return None
    unjudged = [r for r in rows if _bar(r) is None]
    leaked = []
    for r in unjudged:
        tokens, lane = int(r[9]), str(r[1])
        belongs = max(((bar, name) for name, bar in declared.items() if tokens >= bar), default=None)
        if belongs is not None and lane != belongs[1] and declared.get(lane, 0) < belongs[0]:
            leaked.append((r, belongs))
    if not leaked:
        return None
    worst, (bar, home) = max(leaked, key=lambda x: int(x[0][9]))
    lanes = sorted({str(r[1]) for r, _ in leaked})
    evidence: dict[str, Any] = {
        "gateway": gateway, "leaked_requests": len(leaked), "lanes_leaked_onto": lanes,
        "declared_bars": {lane: f"{tokens:,} tokens" for lane, tokens in sorted(declared.items())},
        "threshold_from": "declared by the operator (--lane-bar): the router recorded no bar",
        "largest_leak": f"{worst[11]}: {int(worst[9]):,} tokens counted, sent to {worst[1]} (belongs on {home}, "
                        f"{bar:,} tokens and over)",
        "judged_requests": len(unjudged), **_matched_by([r[13] for r in unjudged]),
        "request_ids": sorted(str(r[11]) for r, _ in leaked)[:MAX_REQUEST_IDS],
    }
    first, last = min(utc(r[10]) for r, _ in leaked), max(utc(r[12]) for r, _ in leaked)
    return Finding(
        "lane_leak", "warning", str(worst[2]), first, last,
        clip(f"{len(leaked)} prompts over {home}'s declared {bar:,}-token bar went to {', '.join(lanes)}"),
        evidence, Query(_JOINED, engine=window.engine, start=window.start, end=window.end).literal(),
        f"make {gateway} count the prompt in the model's tokens before routing (its own measure sends them "
        f"below {home}'s bar), or record the bar it routes by (docs/gateway.md)",
        float(sum(int(r[9]) for r, _ in leaked)))


def _bars(judged: list[tuple[tuple[Any, ...], tuple[str, float], int]],
          leaked: list[tuple[tuple[Any, ...], tuple[str, float], int]]) -> dict[str, str]:
    """Each bar the router decided against in the window: when, how many decisions, how many of them leaked."""
    out: dict[str, str] = {}
    for unit, threshold in sorted({bar for _, bar, _ in judged}, key=lambda b: min(utc(r[10]) for r, bar, _ in judged
                                                                                if bar == b)):
        times = [utc(r[10]) for r, bar, _ in judged if bar == (unit, threshold)]
        n_leaked = sum(1 for _, bar, _ in leaked if bar == (unit, threshold))
        out[f"{threshold:g} {unit}"] = (f"{len(times)} decisions {hms(min(times))}..{hms(max(times))}, "
                                        f"{n_leaked} leaked")
    return out


def _grouped(query: Query, reader: Reads, column: int) -> list[tuple[str, list[tuple[Any, ...]]]]:
    """The query's rows grouped by one column's text, in that text's order."""
    groups: dict[str, list[tuple[Any, ...]]] = {}
    for row in query.rows(reader):
        groups.setdefault(str(row[column]), []).append(row)
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
_FAILED_REQUESTS = joined("r.request_id, m.matched_by", f"gateway = {param('gateway', 'String')} AND ({_FAILED})",
                          ("ts",))

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
SELECT gateway, min(ts), max(ts) FROM gateway_decisions
WHERE {IN_WINDOW} AND {EACH_ENGINE} AND {_ROUTED}
GROUP BY gateway HAVING uniqExact(lane) >= 2 ORDER BY gateway
"""
_MID = "fromUnixTimestamp64Micro({mids:Array(Int64)}[indexOf({gateways:Array(String)}, gateway)], 'UTC')"
_EARLIER_LANES = f"""
SELECT gateway, lane, count(), quantileExact(0.5)({_SIZE}), min({_SIZE})
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
_SHIFTED_REQUESTS = joined("r.request_id, m.matched_by",
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
    mids = {str(g): utc(first) + (utc(last) - utc(first)) / 2 for g, first, last in halves}
    base: dict[str, Any] = {"engine": window.engine, "start": window.start, "end": window.end,
                            "gateways": sorted(mids), "mids": [round(mids[g].timestamp() * 1e6) for g in sorted(mids)]}
    rules: dict[str, tuple[str, float]] = {}
    for gateway, lanes in _grouped(Query(_EARLIER_LANES, **base), reader, 0):
        if len(lanes) >= 2:
            largest = max(lanes, key=lambda r: number(r[3]))  # the lane whose median size is the largest
            rules[gateway] = (str(largest[1]), number(largest[4]))
    if not rules:
        return {}
    names = sorted(rules)
    params = {**base, "gateways": names, "mids": [round(mids[g].timestamp() * 1e6) for g in names],
              "uppers": [rules[g][0] for g in names], "bars": [rules[g][1] for g in names]}
    out = {}
    for gateway, earlier, at_bar, elsewhere, later, later_at_bar, shifted, first, last, backend, lanes in Query(
            _SHIFT, **params).rows(reader):
        if (int(shifted) < MIN_FAILED_OPEN or int(elsewhere) > ROUTED_BAR_NOISE * int(at_bar)
                or int(shifted) < SHIFTED_SHARE * int(later_at_bar)):
            continue
        upper, bar = rules[str(gateway)]
        out[str(gateway)] = _Shift(upper, bar, mids[str(gateway)], (int(earlier), int(at_bar), int(elsewhere)),
                                   (int(later), int(later_at_bar)), int(shifted), utc(first), utc(last),
                                   str((backend or [""])[0]), {str(k): int(v) for k, v in zip(*lanes, strict=True)},
                                   {**params, "gateway": str(gateway)})
    return out


def gateway_fail_open(reader: Reads, window: Window) -> list[Finding]:
    """A routing hook that caught its own errors and routed anyway: exceptions swallowed, sizes never measured,
    sizes over the bar sent below it, or, with nothing recorded, the gateway's routing changed while sizes held."""
    query = Query(_FAILED_OPEN, engine=window.engine, start=window.start, end=window.end)
    shifts = _shifts(reader, window)
    findings = []
    for gateway, lanes in _grouped(query, reader, 0):
        total = sum(int(r[2]) for r in lanes)
        swallowed = sum(int(r[3]) for r in lanes)
        unmeasured = sum(int(r[4]) for r in lanes)
        misrouted, below = _misrouted(lanes)
        shift = shifts.get(gateway)
        shifted = shift.shifted if shift is not None else 0
        # A decision both swallowed and unmeasured is one that failed open, once; a shifted one has neither.
        failed = max(swallowed, unmeasured) + misrouted + shifted
        if failed < MIN_FAILED_OPEN and not swallowed:
            continue
        hit = [r for r in lanes if int(r[3]) or int(r[4]) or (misrouted and r is below)]
        exceptions = sorted({str(e) for r in hit for e in r[5]})
        went: dict[str, int] = {str(r[1]): max(int(r[3]), int(r[4])) + (misrouted if r is below else 0)
                                for r in hit}
        # Named after the backend most of them went to (the default lane's, as a rule).
        top = max(hit, key=lambda r: went[str(r[1])], default=None)
        busiest = str((top[8] or top[13] or [""])[0]) if top is not None else ""
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
            "request_ids": sorted({str(r[0]) for r in requests})[:MAX_REQUEST_IDS],
            **_matched_by([r[1] for r in requests]),
        }
        moments = [(utc(r[6]), utc(r[7])) for r in hit if int(r[3]) or int(r[4])]
        if misrouted and below is not None:
            moments.append((utc(below[11]), utc(below[12])))
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


def _misrouted(lanes: list[tuple[Any, ...]]) -> tuple[int, tuple[Any, ...] | None]:
    """Decisions at or over the bar, nothing swallowed, sent to the lane that takes what is under it (the lane with
    the most under the bar), where another lane takes what is over it; and that lane's row."""
    below = max(lanes, key=lambda r: int(r[9]), default=None)
    if below is None or not int(below[9]) or not any(int(r[10]) for r in lanes if r is not below):
        return 0, None
    return int(below[10]), below


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
SELECT g.engine, g.gateway, g.metric, g.least, g.latest, g.samples,
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
SELECT engine, min(ts), max(ts) FROM (
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
SELECT engine, avg(util_gpu_pct) FROM gpu_samples WHERE {between("tail", "end")} AND {EACH_ENGINE} AND engine != ''
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
SELECT max(held), sum(steps) FROM (
    SELECT toFloat64(held) AS held, steps FROM ({_held_in_steps("first", "last", ENGINES)})
    UNION ALL
    SELECT held, toUInt64(0) AS steps FROM ({_held_in_gauges("first", "last", ENGINES)}))
"""


def _refusing(reader: Reads, window: Window) -> list[Finding]:
    """Lanes that refused all they were asked for REFUSAL_PATIENCE_S while their engines held nothing."""
    findings = []
    query = Query(_REFUSALS, start=window.start, end=window.end)
    for gateway, lane, refused, first, last, engines, statuses, gone in query.rows(reader):
        behind = sorted(str(e) for e in engines if not window.engine or e == window.engine)
        span = (utc(last) - utc(first)).total_seconds()
        if not behind or span < REFUSAL_PATIENCE_S:
            continue
        params = {"first": utc(first), "last": utc(last), "engines": behind}
        held, busy = (int(number(v)) for v in Query(_HELD, **params).rows(reader)[0])
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
    disconnects = {str(r[0]): (int(r[1]), int(r[2])) for r in
                   Query(_DISCONNECTS, engine=window.engine, start=window.start, end=window.end).rows(reader)}
    findings = []
    for engine, first, last in spans:
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
    for _, gateway, metric, least, latest, samples, held, busy, scraped in query.rows(reader):
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
        gpu = [number(r[1], math.nan) for r in Query(_GPU_UTIL, **params).rows(reader)]
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
_ORPHANS = joined("d.gateway, d.engine, if(d.request_id = '', r.request_id, d.request_id), d.end_ts, r.ts, "
                  "r.generation_tokens, r.decode_seconds, m.matched_by",
                  "client_disconnected", ("ts", "generation_tokens", "decode_seconds"),
                  f"r.ts > d.end_ts + toIntervalMillisecond({round(ORPHAN_SLACK_S * 1000)})")


def orphaned_engine_work(reader: Reads, window: Window) -> list[Finding]:
    """The client went away at the gateway, and the engine ran the request to its end anyway: work for nobody."""
    if not _decided(reader, window):
        return []
    query = Query(_ORPHANS, engine=window.engine, start=window.start, end=window.end)
    findings = []
    for engine, orphans in _grouped(query, reader, 1):
        after = [(utc(r[4]) - utc(r[3])).total_seconds() for r in orphans]
        gateways = sorted({str(r[0]) for r in orphans})
        worst = max(orphans, key=lambda r: utc(r[4]) - utc(r[3]))
        findings.append(Finding(
            "orphaned_engine_work", "warning", engine, min(utc(r[3]) for r in orphans),
            max(utc(r[4]) for r in orphans),
            clip(f"{len(orphans)} requests ran on {engine} {sum(after):.0f}s after their clients left"),
            {"orphaned_requests": len(orphans), "engine_s_after_disconnect": round(sum(after), 1),
             "tokens_generated": sum(int(r[5]) for r in orphans), "gateways": gateways,
             "longest": f"{worst[2]}: {(utc(worst[4]) - utc(worst[3])).total_seconds():.1f}s after the client left",
             "counted_from": f"a finish {ORPHAN_SLACK_S:g}s or more after the gateway saw the client go",
             **_matched_by([r[7] for r in orphans])},
            query.literal(),
            "cancel the upstream request when the client disconnects: close the connection to the engine on the "
            "gateway's disconnect path, so that vLLM aborts the request and frees its slot and KV cache",
            sum(after)))
    return findings
