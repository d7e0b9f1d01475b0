"""The join of a gateway's decisions (gateway_decisions) to the engine requests they became (requests): by the id the
gateway forwarded, else by time and size. The detectors (diagnosis.gateway), the terminal tables (analysis.gateway),
the gateway dashboard and whatif's router bar all read it."""

from __future__ import annotations

from stepline.queries.query import moment
from stepline.queries.requests import merged_matching
from stepline.queries.window import EACH_ENGINE, IN_WINDOW

# vLLM's request id from the X-Request-Id a gateway forwards (shared/DESIGN.md, "Request identity"): completions
# `cmpl-{id}-0` (the choice index), chat `chatcmpl-{id}`; an engine that keeps the id as it came has it bare.
ENGINE_IDS = ("[request_id, concat('cmpl-', request_id, '-0'), concat('cmpl-', request_id), "
              "concat('chatcmpl-', request_id)]")
MIN_JOINED = 5  # decisions joined to their engine request before a gateway's chars per token count as a baseline

# Many gateways forward no request id: LiteLLM forwards no client header to a backend unless told to
# (BerriAI/litellm, docs/my-website/docs/proxy/forward_client_headers.md: "By default, LiteLLM does not forward client
# headers to LLM provider APIs"), and its decisions carry its own litellm_call_id (stepline.gateway.litellm), which
# the engine never sees. Such a decision is matched by time and size, on the backend it chose, to an engine request
# that no decision names by id, that arrived from MATCH_SKEW_S before the decision to as long after the gateway's
# first byte (else the attempt's end; at most MATCH_FORWARD_S after deciding), and whose prompt tokens are within
# MATCH_SIZE_RATIO of the decision's size in tokens: its size_tokens, else its characters or bytes at the gateway's
# median per token over MIN_JOINED or more id-joined pairs, else at PRIOR_UNITS_PER_TOKEN (within
# MATCH_SIZE_RATIO_PRIOR). The skew: the gateway and
# the engine stamp times with different hosts' clocks, which NTP keeps within milliseconds and an unsynced
# container lets drift by seconds, so an arrival can read as before the decision that caused it.
MATCH_SKEW_S = 2.0
MATCH_FORWARD_S = 10.0  # a gateway forwards as it decides: a first byte later than this says nothing of the arrival
MATCH_SIZE_RATIO = 2.0  # prompt tokens off the size measured by more than this are another request
# ... where the gateway's units per token are only the prior (no id-joined pairs to learn them from, as behind
# LiteLLM): content runs from ~1 character per token (numeric JSON) to ~5 (prose), so the prior's 4 can be 4x off.
MATCH_SIZE_RATIO_PRIOR = 4.0
PRIOR_UNITS_PER_TOKEN = 4.0  # prose's ~4 characters (ASCII bytes) per token
# Of the candidates, those that fit the size within MATCH_SIZE_TIE of the best fit fit it as well as each other
# (content moves units per token that much: prose ~4 chars per token, code and JSON ~3), and of those the nearest
# in time is chosen, unless the next arrived within MATCH_TIME_TIE_S of it (forwarding takes milliseconds, but an
# event loop, TLS and an engine's HTTP server under load add up to hundreds): then nothing tells them apart and the
# match is refused ('ambiguous'). A wrong match needs a stranger that fits the size clearly better than the
# request the decision became, or as well and arrived clearly nearer. Each engine request goes to at most one
# decision: of those whose choice it is, the one it arrived nearest; the others are refused ('taken') and not
# matched again. Id-joined pairs always win: a request a decision names by id is nobody's candidate, and a decision
# that names one is not matched by time.
MATCH_SIZE_TIE = 1.5
MATCH_TIME_TIE_S = 0.5
JOIN_OUTCOMES = ("id", "time_and_size", "time", "ambiguous", "taken", "unjoined")


# A decision's (or a rolled-up minute's) tenant, as model.rows.tenant_of names it.
TENANT = "multiIf(team != '', team, `key` != '', `key`, end_user != '', end_user, `user`)"


def size_in_unit(alias: str = "") -> str:
    """The size a decision (columns of `alias`, e.g. 'd') compared with its bar, in the bar's unit: NULL where it
    measured none in that unit, or no bar's unit is known."""
    p = f"{alias}." if alias else ""
    return (f"multiIf({p}threshold_unit = 'chars', {p}size_chars, {p}threshold_unit = 'bytes', {p}size_bytes, "
            f"{p}threshold_unit = 'tokens', {p}size_tokens, NULL)")

def _ms(seconds: float) -> str:
    return f"toIntervalMillisecond({round(seconds * 1000)})"


def _bucket(moment: str) -> str:
    """The time match is an equi-join on (engine, slot): a decision's window spans a few buckets, a request's
    arrival lies in one."""
    return f"intDiv(toUnixTimestamp64Milli({moment}), {round(2000 * MATCH_SKEW_S)})"


# The engines a decision's request may be on: the backend it chose, or, where that address stands for several
# engines (a service in front of replicas: sources/addresses.py), each of them, and the match looks across them.
BEHIND = "if(empty(backend_engines), [engine], backend_engines)"
_DECISIONS = ("(SELECT *, cityHash64(host, gateway, ts, engine, request_id, attempt) AS decision_key\n"
              f" FROM gateway_decisions WHERE {IN_WINDOW} AND {EACH_ENGINE})")
# The engine's ids of the requests the window's decisions name.
_NAMED = (f"(SELECT arrayJoin({ENGINE_IDS}) FROM gateway_decisions WHERE {IN_WINDOW} AND {EACH_ENGINE} "
          "AND request_id != '')")


def _requests(columns: tuple[str, ...]) -> str:
    """The engine requests, merged, on the backends the window's decisions chose that arrived near the window, or
    up to 10 minutes before it where a decision names them."""
    return merged_matching(
        f"{EACH_ENGINE} AND engine GLOBAL IN (SELECT arrayJoin({BEHIND}) FROM gateway_decisions "
        f"WHERE {IN_WINDOW} AND {EACH_ENGINE})"
        f" AND arrival_ts <= {moment('end')} + {_ms(MATCH_FORWARD_S + MATCH_SKEW_S)}"
        f" AND (arrival_ts >= {moment('start')} - {_ms(MATCH_SKEW_S)} OR arrival_ts >= {moment('start')}"
        f" - INTERVAL 10 MINUTE AND request_id GLOBAL IN {_NAMED})",
        tuple(dict.fromkeys(("prompt_tokens", *columns))))


def _outcomes() -> str:
    """One row per decision in the window that joined or was refused: its outcome (of JOIN_OUTCOMES), `named` (the
    engine requests its id names) and `chosen` (the one the time match chose)."""
    requests = _requests(())
    pair = ("d.decision_key AS decision_key, d.gateway AS gateway, d.ts AS ts, d.size_tokens AS size_tokens, "
            "d.size_chars AS size_chars, d.size_bytes AS size_bytes, r.engine AS engine, r.request_id AS request_id, "
            "r.arrival_ts AS arrival_ts, r.prompt_tokens AS prompt_tokens")
    # Each decision beside the requests its id names, and beside those no decision names that arrived in its
    # window.
    pairs = f"""SELECT {pair}, 1 AS is_id
FROM (SELECT *, arrayJoin({ENGINE_IDS}) AS engine_id, arrayJoin({BEHIND}) AS behind
      FROM {_DECISIONS} WHERE request_id != '') AS d
GLOBAL INNER JOIN {requests} AS r ON r.engine = d.behind AND r.request_id = d.engine_id
UNION ALL
SELECT {pair}, 0 AS is_id
FROM (SELECT *, ts - {_ms(MATCH_SKEW_S)} AS earliest,
             least(coalesce(first_byte_ts, end_ts), ts + {_ms(MATCH_FORWARD_S)}) + {_ms(MATCH_SKEW_S)} AS latest,
             arrayJoin(range({_bucket('earliest')}, {_bucket('latest')} + 1)) AS slot, arrayJoin({BEHIND}) AS behind
      FROM {_DECISIONS} WHERE engine != '') AS d
GLOBAL INNER JOIN (SELECT *, {_bucket('arrival_ts')} AS slot FROM {requests}
                   WHERE request_id GLOBAL NOT IN {_NAMED}) AS r
    ON r.engine = d.behind AND r.slot = d.slot
WHERE r.arrival_ts >= d.earliest AND r.arrival_ts <= d.latest"""
    calibrated = " ".join(
        f"countIf(is_id AND size_{u} IS NOT NULL AND prompt_tokens > 0) OVER (PARTITION BY gateway) >= "
        f"{MIN_JOINED} AS {u}_learnt, if({u}_learnt, quantileExactIf(0.5)(size_{u} / prompt_tokens, is_id AND "
        f"size_{u} IS NOT NULL AND prompt_tokens > 0) OVER (PARTITION BY gateway), {PRIOR_UNITS_PER_TOKEN}) AS "
        f"{u}_per_token," for u in ("chars", "bytes"))
    # The decision's size in tokens, how well the request's prompt fits it, and how far apart in time they are.
    scored = f"""SELECT *, {calibrated}
       multiIf(size_tokens IS NOT NULL, toFloat64(size_tokens), size_chars IS NOT NULL, size_chars / chars_per_token,
               size_bytes IS NOT NULL, size_bytes / bytes_per_token, NULL) AS in_tokens,
       ifNull(abs(log(in_tokens / prompt_tokens)), 0) AS misfit,
       log(multiIf(size_tokens IS NOT NULL, {MATCH_SIZE_RATIO}, size_chars IS NOT NULL AND NOT chars_learnt,
                   {MATCH_SIZE_RATIO_PRIOR}, size_chars IS NULL AND size_bytes IS NOT NULL AND NOT bytes_learnt,
                   {MATCH_SIZE_RATIO_PRIOR}, {MATCH_SIZE_RATIO})) AS misfit_limit,
       abs(toUnixTimestamp64Micro(arrival_ts) - toUnixTimestamp64Micro(ts)) AS gap_us
FROM ({pairs})"""
    # The id pairs, and the candidates: the other pairs whose prompt fits the size, `tied` where it fits it as well
    # as the best. A decision with an id pair is joined by id, whatever its candidates.
    kept = f"""SELECT *, NOT is_id AND misfit < minIf(misfit, NOT is_id) OVER (PARTITION BY decision_key)
                            + log({MATCH_SIZE_TIE}) AS tied
FROM ({scored})
WHERE is_id OR misfit <= misfit_limit"""
    best = f"""SELECT decision_key, max(is_id) AS by_id, groupArrayIf((engine, request_id, arrival_ts), is_id) AS named,
       any(in_tokens IS NOT NULL) AS sized, argMinIf((engine, request_id, arrival_ts), gap_us, tied) AS chosen,
       minIf(gap_us, tied) AS nearest_us, arraySort(groupArrayIf(gap_us, tied)) AS gaps,
       length(gaps) > 1 AND gaps[2] - gaps[1] < {round(MATCH_TIME_TIE_S * 1e6)} AS ambiguous
FROM ({kept})
GROUP BY decision_key"""
    return f"""(SELECT decision_key, named, chosen, multiIf(
    by_id, 'id', ambiguous, 'ambiguous',
    argMinIf(decision_key, nearest_us, NOT by_id AND NOT ambiguous) OVER (PARTITION BY chosen) = decision_key,
    if(sized, 'time_and_size', 'time'), 'taken') AS outcome
FROM ({best}))"""


def joined(columns: str, decided: str, request_columns: tuple[str, ...], where: str = "1") -> str:
    """`columns` of the decisions in the window that match `decided` (d) beside the engine requests they became
    (r: `request_columns` merged from the plugin's and the span's reports) on the backend each chose, matched by the
    id the gateway forwarded, else by time and size (`m.matched_by`: 'id', 'time_and_size', or 'time' for a
    decision that measured no size). Only requests on the backends decisions chose are read (none where no gateway
    reports)."""
    matches = ("(SELECT decision_key, outcome AS matched_by, arrayJoin(if(outcome = 'id', named, [chosen])) AS key, "
               "key.1 AS engine, key.2 AS request_id, key.3 AS arrival_ts\n"
               f"FROM {_outcomes()}\nWHERE outcome IN ('id', 'time_and_size', 'time'))")
    return (f"SELECT {columns}\nFROM (SELECT * FROM {_DECISIONS} WHERE {decided}) AS d\n"
            f"GLOBAL INNER JOIN {matches} AS m ON m.decision_key = d.decision_key\n"
            f"GLOBAL INNER JOIN {_requests(request_columns)} AS r\n"
            "    ON r.engine = m.engine AND r.request_id = m.request_id AND r.arrival_ts = m.arrival_ts\n"
            f"WHERE {where}\nORDER BY d.gateway, d.ts")


def join_outcomes(decided: str) -> str:
    """Per gateway, how many of the decisions in the window that match `decided` had each of JOIN_OUTCOMES: joined
    by id, by time and size, by time alone (no size measured), refused as ambiguous, refused as taken by a nearer
    decision, and not joined."""
    counts = "".join(f", countIf(o.outcome = '{o}') AS {o}" for o in JOIN_OUTCOMES[:-1])
    return (f"SELECT d.gateway{counts}, count() - {' - '.join(JOIN_OUTCOMES[:-1])} AS unjoined\n"
            f"FROM (SELECT * FROM {_DECISIONS} WHERE {decided}) AS d\n"
            f"GLOBAL LEFT JOIN {_outcomes()} AS o ON o.decision_key = d.decision_key\n"
            "GROUP BY d.gateway ORDER BY d.gateway")
