"""Garbage-collector settings for the sidecar: a process that moves hundreds of thousands of rows a second.

Rows are tuples and lists that never form cycles, but every one of them counts towards CPython's
generation-0 threshold (700 allocations), and each full collection walks every row still queued. At
ingest rates that costs more CPU than decoding the rows. The sidecar collects less often, and leaves
what start-up made (modules, settings, sources) out of collections altogether.
"""

from __future__ import annotations

import gc

GEN0_THRESHOLD = 50_000


def tune() -> None:
    """Call once the collector has started."""
    gc.freeze()
    _, gen1, gen2 = gc.get_threshold()
    gc.set_threshold(GEN0_THRESHOLD, max(gen1, 20), max(gen2, 100))
