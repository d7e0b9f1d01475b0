"""The sidecar's garbage collection: automatic collection off, start-up frozen, the generations collected on a timer.

tune() changes the interpreter's collector for good, so every check runs in a process of its own.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

from stepline.core import gctune

# Rounds of 20 ms, a full collection every third; six rounds are awaited (a loaded machine may take longer).
SCRIPT = textwrap.dedent("""
    import gc, json, threading, time
    import MODULE as gctune
    gctune.YOUNG_EVERY_S, gctune.FULL_EVERY_S = 0.02, 0.06
    collected = []
    gc.callbacks.append(lambda phase, info: phase == "stop" and collected.append(info["generation"]))
    unfrozen = gc.get_freeze_count()
    thread = gctune.tune()
    frozen = gc.get_freeze_count()
    deadline = time.monotonic() + 10
    while len(collected) < 6 and time.monotonic() < deadline:
        time.sleep(0.01)
    print(json.dumps({"enabled": gc.isenabled(), "unfrozen": unfrozen, "frozen": frozen, "name": thread.name,
                      "daemon": thread.daemon, "alive": thread.is_alive(), "collected": collected[:6]}))
""").replace("MODULE", gctune.__name__)


def test_tune_turns_automatic_collection_off_and_collects_on_a_timer() -> None:
    done = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr
    seen = json.loads(done.stdout)
    assert seen["enabled"] is False
    assert seen["unfrozen"] == 0 and seen["frozen"] > 0  # what start-up made is out of every collection
    assert (seen["name"], seen["daemon"], seen["alive"]) == ("stepline-gc", True, True)
    # The young generations every round, everything every FULL_EVERY_S / YOUNG_EVERY_S rounds.
    assert seen["collected"] == [1, 1, 2, 1, 1, 2]
