"""Garbage-collector settings for the sidecar: a process that moves hundreds of thousands of rows a second.

Rows are tuples and lists that never form cycles, but every one of them counts towards CPython's
automatic collections (generation 0 every 700 allocations), and each older-generation collection walks
every row still queued: at ingest rates that costs more CPU than decoding the rows. The sidecar turns
automatic collection off, leaves what start-up made out of collections for good, and collects on a
timer instead: the young generations every few seconds, everything every few minutes, so memory held
by the odd reference cycle (an exception and its traceback) is still given back.
"""

from __future__ import annotations

import gc
import threading

YOUNG_EVERY_S = 5.0
FULL_EVERY_S = 300.0


def tune() -> threading.Thread:
    """Call once the collector has started; returns the (daemon) thread that collects on the timer."""
    gc.freeze()
    gc.disable()
    thread = threading.Thread(target=_collect_on_a_timer, name="stepline-gc", daemon=True)
    thread.start()
    return thread


def _collect_on_a_timer() -> None:
    rounds_per_full = max(1, round(FULL_EVERY_S / YOUNG_EVERY_S))
    rounds = 0
    while True:
        threading.Event().wait(YOUNG_EVERY_S)
        rounds += 1
        gc.collect(2 if rounds % rounds_per_full == 0 else 1)
