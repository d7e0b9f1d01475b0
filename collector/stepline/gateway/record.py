"""Decision records from a home-made router: a few lines in its routing hook, sent as OTLP/JSON spans.

    from stepline.gateway.record import DecisionRecorder
    decisions = DecisionRecorder("http://127.0.0.1:4318/v1/traces", gateway="router")
    try:
        lane = "heavy" if len(body) > THRESHOLD_CHARS else "fast"
    except Exception as exc:              # the branch that must say what it swallowed
        lane, swallowed = "fast", exc
    decisions.record(request_id=rid, lane=lane, backend=url, size_chars=len(body), threshold=THRESHOLD_CHARS,
                     threshold_unit="chars", start_s=t0, end_s=time.time(), status=200, swallowed=swallowed)

`record` never blocks the hook and never raises: it queues (bounded), and a background thread posts batches to
the collector's OTLP/HTTP receiver (the same endpoint as vLLM's spans). What it cannot queue or deliver it counts
(`stats()`) and logs, rate limited: the recorder must not fail open itself.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import threading
import time
import urllib.request
from collections import deque
from collections.abc import Sequence
from typing import Any

from stepline.core.ratelimit import RateLimitedLog
from stepline.gateway import decisions as d

log = logging.getLogger(__name__)
_BATCH = 512


def _value(value: Any) -> dict[str, Any]:
    """An OTLP/JSON AnyValue (ints as strings, as the OTLP/JSON mapping writes int64)."""
    if isinstance(value, bool):
        return {"boolValue": value}
    if isinstance(value, int):
        return {"intValue": str(value)}
    if isinstance(value, float):
        return {"doubleValue": value}
    if isinstance(value, list | tuple):
        return {"arrayValue": {"values": [_value(v) for v in value]}}
    return {"stringValue": str(value)}


class DecisionRecorder:
    """Queues decision spans and posts them to `url` (an OTLP/HTTP traces endpoint) from a thread of its own."""

    def __init__(self, url: str, gateway: str, *, max_pending: int = 10_000, timeout_s: float = 2.0,
                 interval_s: float = 0.5, token: str | None = None) -> None:
        if max_pending < 1:
            raise ValueError(f"decision recorder: max_pending must be at least 1, got {max_pending}")
        self.url, self.gateway = url, gateway
        self._timeout_s, self._interval_s = timeout_s, interval_s
        self._headers = {"Content-Type": "application/json"}
        if token:
            self._headers["Authorization"] = f"Bearer {token}"
        self._pending: deque[dict[str, Any]] = deque()
        self._max_pending = max_pending
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._closed = False
        self._sending = False  # a batch is out: flush waits for it
        self._counts = {"recorded": 0, "sent": 0, "dropped_full": 0, "dropped_unsent": 0, "send_failures": 0}
        self._log = RateLimitedLog(log)
        self._thread = threading.Thread(target=self._run, name="stepline-decisions", daemon=True)
        self._thread.start()
        # A gateway that exits without closing (LiteLLM's proxy never tells its callbacks) still sends what it queued,
        # or counts and logs what it could not: the daemon thread alone would drop the last batch unsaid.
        atexit.register(self.close)

    def record(self, *, request_id: str = "", lane: str = "", backend: str = "", start_s: float,
               end_s: float | None = None, attempt: int = 1, candidates: Sequence[str] = (),
               size_chars: int | None = None, size_bytes: int | None = None, size_tokens: int | None = None,
               threshold: float | None = None, threshold_unit: str = "", health: str = "",
               in_flight: int | None = None, status: int = 0, error_type: str = "",
               client_disconnected: bool = False, first_byte_s: float | None = None,
               swallowed: BaseException | str | None = None, model: str = "", key: str = "", team: str = "",
               user: str = "", end_user: str = "") -> None:
        """Queue one attempt's decision (times are Unix seconds); never raises, never waits. `key` is the API key's
        alias or another name for it, never the key."""
        try:
            attrs: dict[str, Any] = {d.REQUEST_ID: request_id, d.LANE: lane, d.BACKEND: backend, d.ATTEMPT: attempt,
                                     d.CANDIDATES: list(candidates), d.HEALTH: health, d.STATUS: status,
                                     d.ERROR_TYPE: error_type, d.CLIENT_DISCONNECTED: client_disconnected,
                                     d.THRESHOLD_UNIT: threshold_unit}
            for attr, who in ((d.MODEL, model), (d.KEY, key), (d.TEAM, team), (d.USER, user), (d.END_USER, end_user)):
                if who:
                    attrs[attr] = who
            for key, value in ((d.SIZE_CHARS, size_chars), (d.SIZE_BYTES, size_bytes), (d.SIZE_TOKENS, size_tokens),
                               (d.IN_FLIGHT, in_flight),
                               (d.THRESHOLD, None if threshold is None else float(threshold)),
                               (d.FIRST_BYTE, None if first_byte_s is None else round(first_byte_s * 1e9))):
                if value is not None:
                    attrs[key] = value
            if swallowed is not None:
                attrs[d.SWALLOWED] = (f"{type(swallowed).__name__}: {swallowed}"
                                      if isinstance(swallowed, BaseException) else str(swallowed))
            span = {"traceId": os.urandom(16).hex(), "spanId": os.urandom(8).hex(), "name": d.DECISION_SPAN,
                    "kind": 1, "startTimeUnixNano": str(round(start_s * 1e9)),
                    "endTimeUnixNano": str(round((start_s if end_s is None else end_s) * 1e9)),
                    "attributes": [{"key": k, "value": _value(v)} for k, v in attrs.items()]}
        except Exception as exc:  # a bad argument from the hook: counted and logged, the hook goes on
            self._drop("dropped_unsent", 1, "decision recorder: a decision could not be encoded: %s", exc)
            return
        with self._lock:
            if len(self._pending) >= self._max_pending:
                self._counts["dropped_full"] += 1
                full = True
            else:
                self._pending.append(span)
                self._counts["recorded"] += 1
                full = False
        if full:
            self._log.warning("full", "decision recorder: %d decisions pending, dropping (collector at %s slow or "
                                      "down)", self._max_pending, self.url)

    def stats(self) -> dict[str, int]:
        """recorded, sent, dropped_full (queue full), dropped_unsent (never delivered), send_failures."""
        with self._lock:
            return dict(self._counts)

    def flush(self, timeout_s: float = 5.0) -> bool:
        """Wait until every queued decision was sent (or given up on); True when none is left."""
        deadline = time.monotonic() + timeout_s
        self._wake.set()
        while time.monotonic() < deadline:
            with self._lock:
                if not self._pending and not self._sending:
                    return True
            time.sleep(0.01)
        return False

    def close(self, timeout_s: float = 5.0) -> None:
        """Send what is queued, then stop; what is still queued after `timeout_s` is counted as unsent."""
        atexit.unregister(self.close)
        self.flush(timeout_s)
        self._closed = True
        self._wake.set()
        self._thread.join(timeout_s)
        with self._lock:
            left, self._pending = len(self._pending), deque()
        if left:
            self._drop("dropped_unsent", left, "decision recorder: %d decisions unsent at close", left)

    def _run(self) -> None:
        while not self._closed:
            self._wake.wait(self._interval_s)
            self._wake.clear()
            while True:
                with self._lock:
                    batch = [self._pending.popleft() for _ in range(min(_BATCH, len(self._pending)))]
                    self._sending = bool(batch)
                if not batch:
                    break
                self._post(batch)
                with self._lock:
                    self._sending = False

    def _post(self, batch: list[dict[str, Any]]) -> None:
        body = json.dumps({"resourceSpans": [{
            "resource": {"attributes": [{"key": "service.name", "value": {"stringValue": self.gateway}}]},
            "scopeSpans": [{"scope": {"name": "stepline.gateway"}, "spans": batch}]}]}).encode()
        request = urllib.request.Request(self.url, body, self._headers, method="POST")
        try:
            with urllib.request.urlopen(request, timeout=self._timeout_s) as response:
                reply = json.loads(response.read() or b"{}")
        except Exception as exc:  # the collector down or refusing: these decisions are lost, and said so
            with self._lock:
                self._counts["send_failures"] += 1
            self._drop("dropped_unsent", len(batch), "decision recorder: %d decisions not delivered to %s: %s",
                       len(batch), self.url, exc)
            return
        rejected = int((reply.get("partialSuccess") or {}).get("rejectedSpans") or 0)
        with self._lock:
            self._counts["sent"] += len(batch) - rejected
        if rejected:
            self._drop("dropped_unsent", rejected, "decision recorder: the collector rejected %d decisions: %s",
                       rejected, (reply.get("partialSuccess") or {}).get("errorMessage", ""))

    def _drop(self, counter: str, n: int, message: str, *args: Any) -> None:
        with self._lock:
            self._counts[counter] += n
        self._log.warning(counter, message, *args)
