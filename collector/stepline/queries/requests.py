"""The merged read of `requests`: one row per request, however many of its reports the table holds yet.

The plugin and OTLP each report a finished request; each report is a row of `requests`, an AggregatingMergeTree
that merges the rows of one request (host, engine, request_id, arrival_ts) field by field in the background
(stepline.model.schema). Until it has, a reader that counts or filters requests reads them merged: `merged()`
merges every row of the table (filters apply to merged values), `merged_matching()` only the reports a condition
picks (cheaper over a long table). A request's moments and its prompt band, which several reads compute, are here too.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from stepline.model.schema import PROMPT_BANDS, TABLE_BY_NAME

_MERGE_FUNCTION = re.compile(r"SimpleAggregateFunction\((\w+),")


# FINAL merges rows of one key across partitions unless told not to; doing so, it cannot skip a partition by a
# condition on `ts` (a merged column: a skipped row might have merged with a kept one), so every read of a window
# read the whole table: an hour of a week of an 8-GPU node's requests took 22.7 s, 0.28 s with this setting
# (benchmarks/RESULTS.md, 2026-12-03). Background merges never cross partitions either (by day of `ts`); a request's
# two reports finish milliseconds apart, so only one whose reports straddle midnight UTC reads as two rows.
# https://clickhouse.com/docs/operations/settings/settings#do_not_merge_across_partitions_select_final
FINAL_WITHIN_PARTITIONS = "do_not_merge_across_partitions_select_final = 1"


def merged(table: str = "requests") -> str:
    """`table` (the requests table; qualified with its database for a client that has none) merged, as a table
    expression: one row per request (host, engine, request id and arrival), each field merged as the table merges
    it; a condition on the finish time outside reads only the partitions (days) it can hold."""
    # FINAL merges at read time what the background merges have not yet:
    # https://clickhouse.com/docs/sql-reference/statements/select/from#final-modifier
    return f"(SELECT * FROM {table} FINAL SETTINGS {FINAL_WITHIN_PARTITIONS})"


MERGED = merged()
# What tells one engine's requests apart (the table's key less host): request ids repeat (stepline.ingest.merge).
KEY = ("engine", "request_id", "arrival_ts")


def _merge(column: str) -> str:
    """The function the table merges `column`'s reports with: min for the finish time, max for every other
    field."""
    found = _MERGE_FUNCTION.match(dict(TABLE_BY_NAME["requests"].columns)[column])
    if found is None:
        raise ValueError(f"requests.{column} is part of the key: it does not merge")
    return found.group(1)


def merged_matching(where: str, columns: Sequence[str]) -> str:
    """The requests whose reports match `where`, merged: a table expression of one row per request (host, engine,
    request id and arrival), `columns` merged as the table merges them, read from those reports only (`merged()`
    merges every row first).

    `where` must hold alike for every report of a request that knows the fields it reads (engine, times, prompt
    tokens, queue time), never test a field only one report carries (cached tokens): a request whose reports it
    splits would be merged from part of them. Filter on merged values outside."""
    fields = [c for c in columns if c not in KEY and c != "host"]
    key = ", ".join(("host", *KEY))  # host too: a fleet's engines may share a name, and a cluster shards by host
    merged_columns = "".join(f", {_merge(c)}({c}) AS {c}" for c in fields)
    return (f"(SELECT {key}{merged_columns} FROM (SELECT {key}{''.join(f', {c}' for c in fields)} "
            f"FROM requests WHERE {where}) GROUP BY {key})")


# When a request was first scheduled (its prefill began: arrival plus queue time), and when its first token came.
SCHEDULED = "arrival_ts + toIntervalMicrosecond(toInt64(queue_seconds * 1e6))"
FIRST_TOKEN = "arrival_ts + toIntervalMicrosecond(toInt64(ttft_seconds * 1e6))"
# A request's prompt band by name (schema.PROMPT_BANDS; schema.PROMPT_BAND_INDEX is its index).
PROMPT_BAND = "multiIf(" + ", ".join(f"prompt_tokens < {bar}, '{name}'" for name, bar in PROMPT_BANDS if bar) + (
    f", '{PROMPT_BANDS[-1][0]}')")
