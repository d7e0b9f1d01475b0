"""Whether an engine's stat-logger plugin has gone silent while the engine works.

vLLM moves its generated-, prompt- and iteration-token counters only in the steps it runs, and a loaded plugin
reports every step it is handed (stepline.plugin.core), so counters that moved on /metrics while no step arrived
say the plugin is not reporting. Causes met: vLLM 0.33's elastic EP scale-up rebuilds its StatLoggerManager with
`custom_stat_loggers=None` (vllm/v1/engine/async_llm.py, `AsyncLLM._scale_elastic_ep`, line 1323 of v0.33.0): the
default Prometheus logger goes on counting while every plugin is dropped; a plugin that failed to load; a plugin
whose STEPLINE_PLUGIN_SOCKET is not the collector's, or whose STEPLINE_ENGINE names the engine otherwise.

A queue gauge alone (requests running) is no such evidence: a wedged engine holds requests, runs no step and moves
no counter, and that is the stall watchdog's to page, not a silent plugin's.

Every time here is the collector's clock: a scrape's ts, and when a step arrived (never the step's own ts, which is
the engine's clock).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from stepline.model.rows import Event, micros

CAUSES = ("vLLM's elastic EP scale-up rebuilt its stat loggers without custom ones (restart the engine), the plugin "
          "did not load (VLLM_PLUGINS, vLLM's start-up log), its STEPLINE_PLUGIN_SOCKET is not the collector's, or "
          "it names the engine otherwise (STEPLINE_ENGINE)")


@dataclass
class _Engine:
    heard_at: float | None = None  # when its latest step arrived
    unheard_since: float | None = None  # the scrape before the first counter move that no step has followed
    unheard_seen: float = 0.0  # the scrape that saw that move


class PluginSilence:
    """Per engine, the counter moves on its /metrics that no step from its plugin has followed."""

    def __init__(self, after_s: float = 30.0, delivery_s: float = 5.0) -> None:
        """`after_s`: silence this long, from the scrape before the first unexplained move, is a silent plugin;
        `delivery_s`: how long a step the engine ran before a scrape may take to reach the collector."""
        self._after_s = after_s
        self._delivery_s = delivery_s
        self._engines: dict[str, _Engine] = {}

    def heard(self, engine: str, at: float) -> None:
        """A step of `engine` arrived at `at`: every move seen so far is accounted for."""
        e = self._engines.get(engine)
        if e is None:
            e = self._engines[engine] = _Engine()
        e.heard_at, e.unheard_since = at, None

    def moved(self, engine: str, since: float, at: float) -> None:
        """The scrape at `at` saw a progress counter of `engine` move since the scrape at `since`."""
        e = self._engines.get(engine)
        if e is None:
            e = self._engines[engine] = _Engine()
        if (e.heard_at is None or e.heard_at <= since) and e.unheard_since is None:
            e.unheard_since, e.unheard_seen = since, at

    def forget(self, engine: str) -> None:
        """The engine went down or restarted: its next moves are judged afresh."""
        self._engines.pop(engine, None)

    def silent_s(self, engine: str, now: float) -> float | None:
        """Seconds since `engine` began working with no step from its plugin, once that is a silent plugin; else
        None."""
        e = self._engines.get(engine)
        if e is None or e.unheard_since is None or now < e.unheard_seen + self._delivery_s:
            return None
        silent = now - e.unheard_since
        return silent if silent >= self._after_s else None

    def heard_at(self, engine: str) -> float | None:
        """When the latest step of `engine` arrived (None: none since the collector started, or since it was
        forgotten)."""
        e = self._engines.get(engine)
        return None if e is None else e.heard_at


def silent_event(host: str, engine: str, now: float, silent_s: float, heard_at: float | None,
                 unscraped: Sequence[str]) -> Event:
    """The `plugin_silent` event: what was seen, and the causes to look at (a name the plugin uses instead first)."""
    last = "no step from it yet" if heard_at is None else f"its last step arrived {now - heard_at:.0f}s ago"
    named = f"; steps arrive as engine {', '.join(repr(e) for e in unscraped)}, which the collector does not " \
            "scrape: set STEPLINE_ENGINE in vLLM's environment to this engine's name" if unscraped else ""
    message = (f"engine {engine}: its /metrics counters moved over the last {silent_s:.0f}s with no step from its "
               f"stat-logger plugin ({last}){named}; causes: {CAUSES}")
    attributes = {"silent_s": f"{silent_s:.1f}", "last_step_s_ago": "" if heard_at is None else
                  f"{now - heard_at:.1f}", "steps_arrive_as": ",".join(unscraped)}
    return Event(micros(now), host, engine, "watchdog", "plugin_silent", "warning", message[:500], attributes)


def resumed_event(host: str, engine: str, now: float, silent_s: float) -> Event:
    """The `plugin_resumed` event: steps arrive again after a silence."""
    return Event(micros(now), host, engine, "watchdog", "plugin_resumed", "info",
                 f"engine {engine}: steps from its stat-logger plugin arrive again after {silent_s:.0f}s of silence",
                 {"silent_s": f"{silent_s:.1f}"})
