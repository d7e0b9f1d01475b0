"""A wedge on its way: slots held by requests that do no work while others wait, until none is left.

vLLM counts a request in `running` from admission to finish; each step schedules every running request it has
budget for. A step with token budget to spare that schedules fewer requests than are running, while requests
wait, has running requests that do nothing: leaked slots (a client gone, a slot never released). They add up
until the engine stops stepping; wedged_engine's stall rule sees it only then.
"""

from __future__ import annotations

from typing import Any

from stepline.diagnosis.baseline import IDLE_SLOT_SHARE, LEAK_RECENT_SHARE, MIN_LEAK_STEPS, budgets
from stepline.diagnosis.common import clip, engines, number, utc
from stepline.diagnosis.findings import Finding, Window
from stepline.diagnosis.rollup import Agg, rolled
from stepline.model.schema import UNSCHEDULED_WHILE_WAITING
from stepline.queries.query import Query, param
from stepline.queries.window import EACH_ENGINE, ENGINES, between
from stepline.store.reads import Reads

# Steps of the window's last LEAK_RECENT_SHARE with requests waiting and at least half the token budget unused.
_IDLE_SLOTS = f"""
SELECT engine, count() AS steps,
       quantileExact(0.5)(toInt64(running) - num_generation_requests - num_ctx_requests) AS idle_slots_p50,
       max(running) AS running_max, argMax(waiting, ts) AS waiting_last,
       argMin(toInt64(running) - num_generation_requests - num_ctx_requests, ts) AS idle_slots_first,
       argMax(toInt64(running) - num_generation_requests - num_ctx_requests, ts) AS idle_slots_last,
       min(ts) AS first, max(ts) AS last
FROM steps
WHERE {ENGINES} AND {between("recent")} AND waiting > 0
  AND num_ctx_tokens + num_generation_tokens < transform(toString(engine), {param('budget_engines', 'Array(String)')},
      {param('half_budget', 'Array(UInt64)')}, 0)
GROUP BY engine ORDER BY engine
"""


def leaked_slots(reader: Reads, window: Window) -> list[Finding]:
    """Requests wait while running requests hold slots and do no work, the budget to spare: wedging."""
    findings: list[Finding] = []
    known = budgets(reader, window)
    names = sorted(known)
    if not names:
        return findings
    recent = window.end - (window.end - window.start) * LEAK_RECENT_SHARE
    # Only an engine that left running requests unscheduled while others waited can have an idle slot in such a step.
    sql, bounds = rolled([Agg("unscheduled", UNSCHEDULED_WHILE_WAITING, "sum({})")], EACH_ENGINE, recent, window.end)
    suspects = sorted(str(r.engine) for r in Query(sql, engine=window.engine, **bounds).rows(reader)
                      if int(r.unscheduled) > 0)
    if not suspects:
        return findings
    params: dict[str, Any] = {"recent": recent, "end": window.end, "budget_engines": names,
                              "half_budget": [known[e][0] // 2 for e in names]}
    rows = {str(r.engine): r for r in Query(_IDLE_SLOTS, engines=suspects, **params).rows(reader)}
    for engine in engines(reader, window):
        if engine not in rows:
            continue
        r = rows[engine]
        steps, idle, running, waiting, idle_first, idle_last, first, last = (
            r.steps, r.idle_slots_p50, r.running_max, r.waiting_last, r.idle_slots_first, r.idle_slots_last, r.first,
            r.last)
        idle = number(idle)
        if int(steps) < MIN_LEAK_STEPS or idle < max(1.0, IDLE_SLOT_SHARE * int(running)):
            continue
        findings.append(Finding(
            "wedged_engine", "critical", engine, utc(first), utc(last),
            clip(f"wedging: {idle:.0f} of {running} slots do no work, {waiting} waiting"),
            {"idle_slots_p50": idle, "running_max": int(running), "waiting_last": int(waiting),
             "idle_slots_first_last": f"{idle_first} -> {idle_last}", "steps_compared": int(steps),
             "idle_from": f"{IDLE_SLOT_SHARE:.0%} of the running slots, in steps with requests waiting and half "
                          f"the token budget ({known[engine][0]}, {known[engine][1]}) unused, over the window's last "
                          f"{LEAK_RECENT_SHARE:.0%}"},
            Query(_IDLE_SLOTS, engines=[engine], **params).literal(),
            "running requests hold slots without being scheduled (leaked on client disconnect or abort): find the "
            "requests that never finish, fix the release path, and restart the engine before the last slot goes",
            number(waiting) * (utc(last) - utc(first)).total_seconds()))
    return findings
