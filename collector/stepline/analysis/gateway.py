"""What a gateway decided, as tables for a terminal: its lanes, the largest requests it measured beside what their
engine counted, and its slots on a backend beside what the engine held, minute by minute."""

from __future__ import annotations

from stepline.core.texttable import render_table
from stepline.diagnosis.findings import Window
from stepline.queries.gateway import joined, size_in_unit
from stepline.queries.query import Query, moment, param
from stepline.queries.window import EACH_ENGINE, IN_WINDOW
from stepline.store.reads import Reads

_LANES = f"""
SELECT gateway, lane, engine, count() AS decisions, countIf(status >= 200 AND status < 300) AS ok,
       countIf(status = 429) AS refused, countIf(client_disconnected) AS disconnects,
       countIf(swallowed_exception != '') AS swallowed, max(in_flight) AS most_in_flight
FROM gateway_decisions WHERE {IN_WINDOW} AND {EACH_ENGINE}
GROUP BY gateway, lane, engine ORDER BY gateway, lane, engine
"""

# The size in the bar's unit (or characters where no bar was in force) of each decision, beside the engine's count.
_SIZE = f"if(d.threshold_unit = '', d.size_chars, {size_in_unit('d')})"
_LARGEST = joined(f"if(d.request_id = '', r.request_id, d.request_id) AS request_id, d.lane AS lane, "
                  f"{_SIZE} AS measured, if(d.threshold_unit = '', 'chars', d.threshold_unit) AS unit, "
                  "d.threshold AS threshold, r.prompt_tokens AS tokens", "1", ("ts", "prompt_tokens"),
                  "r.prompt_tokens >= {min_tokens:UInt64}")

_SLOTS = f"""
SELECT toStartOfMinute(d.ts) AS minute, max(d.in_flight) AS gateway_in_flight, count() AS decisions,
       ifNull(any(s.held), 0) AS engine_running_waiting, ifNull(any(s.busy), 0) AS busy_steps
FROM gateway_decisions AS d
GLOBAL LEFT JOIN (SELECT toStartOfMinute(ts) AS minute, max(running + waiting) AS held,
                  countIf(num_ctx_tokens + num_generation_tokens > 0) AS busy
           FROM steps WHERE {IN_WINDOW} AND engine = {param('backend', 'String')} GROUP BY minute) AS s
    ON s.minute = toStartOfMinute(d.ts)
WHERE d.ts >= {moment('start')} AND d.ts <= {moment('end')} AND d.engine = {param('backend', 'String')}
  AND d.in_flight IS NOT NULL
GROUP BY minute ORDER BY minute
"""


def lanes(reader: Reads, window: Window) -> str:
    """Each gateway's lanes: decisions, answered, refused, disconnects, swallowed exceptions, the most in flight."""
    rows = Query(_LANES, engine=window.engine, start=window.start, end=window.end).rows(reader)
    return render_table(["gateway", "lane", "backend", "decisions", "2xx", "refused 429", "disconnects",
                         "swallowed", "most in flight"], rows)


def largest(reader: Reads, window: Window, min_tokens: int) -> list[str]:
    """One line per request of at least `min_tokens` engine-counted tokens: what the gateway measured, where it
    sent it, and what the engine counted."""
    rows = Query(_LARGEST, engine=window.engine, start=window.start, end=window.end,
                 min_tokens=min_tokens).rows(reader)
    lines = []
    for r in rows:
        request_id, lane, measured, unit, threshold, tokens = (
            r.request_id, r.lane, r.measured, r.unit, r.threshold, r.tokens)
        side = "" if threshold is None else (" (under the bar)" if measured is not None and measured < threshold
                                             else " (over the bar)")
        size = "no size measured" if measured is None else f"measured {measured:,} {unit}{side}"
        lines.append(f"{request_id}: {size} -> {lane} lane; the engine counted {tokens:,} tokens")
    return lines


def slots(reader: Reads, window: Window, backend: str) -> str:
    """The gateway's slots on `backend` per minute (the most any decision saw) beside the engine's running + waiting."""
    rows = Query(_SLOTS, engine="", backend=backend, start=window.start, end=window.end).rows(reader)
    return render_table(["minute (UTC)", "gateway in flight", "decisions", "engine running+waiting",
                         "engine busy steps"], [(f"{r.minute:%H:%M}", r.gateway_in_flight, r.decisions,
                                                r.engine_running_waiting, r.busy_steps) for r in rows])
