"""Which request a report is of, and which reports are worth writing.

A request's identity. vLLM reports a finished request under the id the client or gateway chose
(`X-Request-Id`; it adds random characters only to its internal id, which neither report carries:
vllm/v1/engine/input_processor.py assign_request_id, output_processor.py passes `external_req_id` to both), and
retries reuse that header: two requests minutes apart, or running side by side, can share an id on one engine. The
store keys `requests` by (host, engine, request_id, arrival_ts) (stepline.model.schema), so what makes two reports
one row is the arrival this module gives them.

Both reports carry vLLM's one `arrival_time` of the request: the span starts at it (`int(arrival_time * 1e9)`,
output_processor.py do_tracing), and the plugin's arrival is its finishing step's `iteration_timestamp` less
`e2e_latency`, which vLLM computes as that same timestamp less `arrival_time` (vllm/v1/metrics/stats.py
update_from_finished_request) and the plugin's wire carries as float32. So the two arrivals of one request agree to
within microseconds: rounding to microseconds on each side, plus float32's rounding of e2e (`arrival_tolerance_us`).
Two requests that share an id differ by at least the time one HTTP request takes to be accepted, far more. The
prompt and output token counts, which both report, must also agree; and a request has at most one report of each
source, so a second plugin report (or span) under a known id is another request, unless it is the same report again
(same source, same arrival to the microsecond: a retried batch, a replayed spool).

The first report of a request fixes its arrival; later reports of it are written with that arrival, so that they
share its key and the store merges them field by field (each column keeps its largest value), whatever their
order. This memory is what lets a later report find its request; it is rebuilt after a restart from what the store
and the spool hold (stepline.ingest.identity.RequestPlacement.remember): a collector that restarts, or replays its
spool, places every report it sees again exactly as the first process did, because a replayed report matches its own
arrival and the other source's report matches within the tolerance. A report too old for the memory to be sure of
(it finished before what the memory covers: forgotten by age or count, or before the store was read) is looked up in
the store first (`needs_lookup`). A report that matches nothing starts a request of its own.

What this module adds beyond identity is economy: a report that carries no field its request's earlier reports left
unknown (the span of a request the plugin already gave, a retry) is not written at all, so that most requests are
one row from the start and the merged read (stepline.queries.requests) has little to merge.
"""

from __future__ import annotations

import math
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from itertools import compress
from operator import eq, itemgetter
from typing import Any, get_type_hints

from stepline.model.rows import Request

# The fields that merge: all but the key (host, engine, request_id, arrival_ts) and the finish time, which both
# reports carry.
_MERGED = tuple(i for i, name in enumerate(Request._fields)
                if name not in ("ts", "host", "engine", "request_id", "arrival_ts"))
_BIT = {i: 1 << bit for bit, i in enumerate(_MERGED)}
_SOURCE = Request._fields.index("source")
_ARRIVAL_FIELD = Request._fields.index("arrival_ts")
_make_request = Request._make
_SOURCE_BIT = _BIT[_SOURCE]
# Seconds are known unless NaN (0.0 is a time); counts and text unless 0 or empty.
_TYPES = get_type_hints(Request)
_SECONDS = tuple(i for i in _MERGED if _TYPES[Request._fields[i]] is float)
_PLAIN = tuple(i for i in _MERGED if i not in _SECONDS and i != _SOURCE)
_SECONDS_BITS = tuple(_BIT[i] for i in _SECONDS)
_ALL_SECONDS = sum(_SECONDS_BITS)
_PLAIN_BITS = tuple(_BIT[i] for i in _PLAIN)
_seconds_fields = itemgetter(*_SECONDS)
_plain_fields = itemgetter(*_PLAIN)
# Both sides round to the microsecond; vLLM's span start truncates to the nanosecond first.
_ROUNDING_US = 2
# float32 (the plugin wire's e2e) keeps 24 significant bits: its rounding of e2e is at most e2e * 2^-24; twice that,
# for room.
_FLOAT32_SLACK = 2.0 ** -23


def known_fields(request: Request) -> int:
    """A bit per merged field this report gives a value: text not empty, a count not 0, seconds not NaN.

    These are exactly the values that can raise the store's per-field maximum over what a report that lacks
    them wrote; `source` counts only as 'plugin', the value that outranks 'otlp'.
    """
    # On the writer's path for every report (two thirds of a busy engine's rows): the fields are tested in C
    # (NaN is the one value not equal to itself, and a sum holding one is NaN: most reports know every time; compress
    # keeps the bits of the truthy counts and texts): 0.6 us a report (timeit), 1.2 without the sum first.
    seconds = _seconds_fields(request)
    total = sum(seconds)
    known_seconds = _ALL_SECONDS if total == total else sum(compress(_SECONDS_BITS, map(eq, seconds, seconds)))
    mask = known_seconds + sum(compress(_PLAIN_BITS, _plain_fields(request)))
    return mask | _SOURCE_BIT if request[_SOURCE] == "plugin" else mask


def arrival_tolerance_us(request: Request) -> int:
    """How far, in microseconds, the other report's arrival of this request can lie from this one's."""
    e2e = request.e2e_seconds
    if not 0 <= e2e < math.inf:  # NaN (a span without gen_ai.latency.e2e): what its times say
        e2e = max(0.0, (request.ts - request.arrival_ts) / 1e6)
    return _ROUNDING_US + math.ceil(e2e * _FLOAT32_SLACK * 1e6)


# A request as its reports so far told it, kept as a plain tuple of numbers and strings:
#     (arrival_ts that keys it, prompt_tokens, generation_tokens, latest finish ts, known_fields of its reports,
#      source, that report's arrival_ts[, source, arrival_ts ...])
# The garbage collector stops following a tuple of numbers and strings at its first pass; objects, lists, dicts and
# named tuples it follows at every full collection, with the GIL held. Held as a dataclass, a dict and a list per
# request, the 500,000 requests this memory may hold were 1.5M objects and 0.3 s a full collection (gctune's,
# every 5 minutes); and freeing a discarded memory took the young collection 0.5 s. (benchmarks/RESULTS.md)
Known = tuple[Any, ...]
_ARRIVAL, _PROMPT, _GENERATION, _TS, _MASK, _REPORTS = range(6)


def _known(report: Request, mask: int) -> Known:
    return (report.arrival_ts, report.prompt_tokens, report.generation_tokens, report.ts, mask, report.source,
            report.arrival_ts)


def _takes(known: Known, report: Request) -> bool:
    """Whether `report` is of the request `known` (the rule the module's docstring states)."""
    source = report.source
    sources = known[_REPORTS::2]
    if source in sources:  # the same report again; any other report of its source is another request's
        own: int = known[_REPORTS + 2 * sources.index(source) + 1]
        return own == report.arrival_ts
    return (abs(report.arrival_ts - known[_ARRIVAL]) <= arrival_tolerance_us(report)
            and _agree(known[_PROMPT], report.prompt_tokens)
            and _agree(known[_GENERATION], report.generation_tokens))


def _joined(known: Known, report: Request, mask: int) -> Known:
    """`known` with `report` taken in; `mask`: the report's known_fields."""
    reports = known[_REPORTS:]
    if report.source not in reports[::2]:
        reports = (*reports, report.source, report.arrival_ts)
    return (known[_ARRIVAL], known[_PROMPT] or report.prompt_tokens, known[_GENERATION] or report.generation_tokens,
            max(known[_TS], report.ts), known[_MASK] | mask, *reports)


def _agree(known: int, reported: int) -> bool:
    return not known or not reported or known == reported


def closest(candidates: Sequence[Known], report: Request) -> int | None:
    """Which of the known requests `report` is of (an index of `candidates`): of those that take it, the one whose
    arrival is closest."""
    if len(candidates) == 1:  # one request under the id, as nearly always
        return 0 if _takes(candidates[0], report) else None
    best: int | None = None
    for i, known in enumerate(candidates):
        if _takes(known, report) and (best is None or abs(known[_ARRIVAL] - report.arrival_ts)
                                      < abs(candidates[best][_ARRIVAL] - report.arrival_ts)):
            best = i
    return best


class RecentRequests:
    """Remembers the requests of each (engine, request id) reported within a window; bounded in count.

    The plugin reports a request when its last step ends; OTLP exporters batch spans for a few seconds. A
    ten-minute window covers that gap with room to spare; past it (or past `max_entries` ids) the oldest are
    forgotten, so memory stays bounded whatever the traffic. `needs_lookup` then says which reports may be of a
    forgotten request: the store has it (`remember` what it answers before `place`).
    """

    WINDOW_S = 600.0

    def __init__(self, window_s: float = WINDOW_S, max_entries: int = 500_000,
                 monotonic: Callable[[], float] = time.monotonic, wall: Callable[[], float] = time.time) -> None:
        self._window_s = window_s
        self.max_entries = max_entries
        self._monotonic = monotonic
        self._wall = wall
        # (engine, request id) -> (when first seen, Known, ...): plain tuples, which the garbage collector leaves be.
        self._seen: OrderedDict[tuple[str, str], tuple[Any, ...]] = OrderedDict()
        self._oldest_at = monotonic()  # when the oldest entry was seen: nothing to forget before window_s after it
        # Reports finished before this (µs) may be of requests this memory never saw or forgot: until the store is
        # read (`remembered_window`), everything before this process started.
        self._complete_since = round(wall() * 1_000_000)
        self._lock = threading.Lock()

    def place(self, report: Request) -> Request | None:
        """The report as it is to be written, its arrival that of the request it is of; None when it adds no
        field to what that request's earlier reports gave (a repeat, or the span of a request the plugin
        reported)."""
        key = (report.engine, report.request_id)
        mask = known_fields(report)
        with self._lock:
            seen = self._seen
            entry = seen.get(key)
            if entry is None:
                now = self._monotonic()
                seen[key] = (now, _known(report, mask))
                if len(seen) > self.max_entries or now - self._oldest_at > self._window_s:
                    self._forget(now)
                return report
            # The entry keeps its place (an OrderedDict's value replaced): forgotten when its first report would be.
            found = closest(entry[1:], report)
            if found is None:
                seen[key] = (*entry, _known(report, mask))
                return report
            known = entry[1 + found]
            joined = _joined(known, report, mask)
            seen[key] = (*entry[:1 + found], joined, *entry[2 + found:])
            if not mask & ~known[_MASK]:
                return None
            arrival = known[_ARRIVAL]
            if report.arrival_ts == arrival:
                return report
            return _make_request((*report[:_ARRIVAL_FIELD], arrival, *report[_ARRIVAL_FIELD + 1:]))  # a fast _replace

    def remember(self, reports: Iterable[Request]) -> None:
        """Reports already written (the store's merged rows) or waiting in the spool, oldest first."""
        for report in reports:
            self.place(report)

    def remembered_window(self) -> None:
        """The store's requests finished within the window (window_s up to now) have been remembered: read
        after them, the window's start is no later than that of the read."""
        with self._lock:
            self._complete_since = min(self._complete_since, round((self._wall() - self._window_s) * 1_000_000))

    def needs_lookup(self, report: Request) -> bool:
        """Whether `report` may be of a request this memory does not hold: it finished before what the memory
        covers and matches nothing the memory has."""
        if report.ts >= self._complete_since:
            return False
        with self._lock:
            entry = self._seen.get((report.engine, report.request_id))
            return entry is None or closest(entry[1:], report) is None

    def _forget(self, now: float) -> None:
        """Under the lock: drop entries past the window or beyond the bound, oldest first."""
        seen = self._seen
        while seen:
            oldest_key, entry = next(iter(seen.items()))
            at = entry[0]
            if now - at <= self._window_s and len(seen) <= self.max_entries:
                self._oldest_at = at
                return
            del seen[oldest_key]
            # A report finished up to a second after a forgotten one may be its request's other report.
            self._complete_since = max(self._complete_since, max(r[_TS] for r in entry[1:]) + 1_000_000)
        self._oldest_at = now

    def __len__(self) -> int:
        return len(self._seen)
