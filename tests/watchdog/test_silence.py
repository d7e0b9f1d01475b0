"""A plugin that goes silent while its engine works: judged from counter moves no step followed, exported per
engine, told on the timeline when it falls silent and when it is back; a wedge, an idle engine and a plugin that
keeps up are not silent."""

from __future__ import annotations

from stepline.model.rows import Event
from stepline.watchdog.silence import PluginSilence
from tests.watchdog.test_tap import E, Harness


def test_moves_no_step_followed_are_a_silence_once_it_lasts() -> None:
    s = PluginSilence(after_s=30.0, delivery_s=5.0)
    s.moved(E, since=100.0, at=105.0)
    assert s.silent_s(E, 108.0) is None  # the steps of that move may still be on their way
    assert s.silent_s(E, 129.0) is None  # silent 29 s: not yet
    assert s.silent_s(E, 131.0) == 31.0
    s.moved(E, since=130.0, at=135.0)  # the silence dates from its first move
    assert s.silent_s(E, 140.0) == 40.0
    s.heard(E, 141.0)
    assert s.silent_s(E, 141.0) is None and s.heard_at(E) == 141.0


def test_a_step_that_arrives_after_the_scrape_accounts_for_its_move() -> None:
    s = PluginSilence(after_s=30.0, delivery_s=5.0)
    s.heard(E, 100.0)
    s.moved(E, since=104.0, at=109.0)  # the counters moved after the last step...
    s.heard(E, 109.5)  # ...whose steps arrive half a second after the scrape
    s.moved(E, since=109.0, at=114.0)  # a step arrived after 109: this move has its steps
    assert s.silent_s(E, 200.0) is None


def test_a_restart_or_an_engine_gone_down_is_judged_afresh() -> None:
    s = PluginSilence(after_s=30.0, delivery_s=5.0)
    s.moved(E, since=0.0, at=5.0)
    assert s.silent_s(E, 40.0) == 40.0
    s.forget(E)
    assert s.silent_s(E, 41.0) is None and s.heard_at(E) is None


def scrape(h: Harness, tokens: float, moved: float, running: int = 2, engine: str = E) -> None:
    h.sample("vllm:num_requests_running", running, engine=engine)
    h.sample("vllm:num_requests_waiting", 0, engine=engine)
    h.sample("vllm:generation_tokens_total", tokens, moved, engine=engine)


def events(h: Harness, kind: str) -> list[Event]:
    return [r for r in h.emitted if isinstance(r, Event) and r.kind == kind]


def test_an_engine_working_without_steps_has_a_silent_plugin_until_its_steps_come_back() -> None:
    # As after vLLM's elastic EP scale-up: /metrics goes on counting, the plugin was dropped.
    h = Harness(expect_plugin=True)
    for i in range(3):  # steps arrive as the counters move
        h.clock.advance(5.0)
        h.step()
        scrape(h, 100.0 * i, 100.0)
        h.tick(0.0)
    assert h.value("stepline_engine_plugin_silent_seconds") == 0
    silence_from = h.now  # the last scrape before the moves that no step follows
    for i in range(3, 12):
        h.clock.advance(5.0)
        scrape(h, 100.0 * i, 100.0)
        h.tick(0.0)
    silent = h.value("stepline_engine_plugin_silent_seconds")
    assert silent is not None and silent == h.now - silence_from >= 30.0
    [event] = events(h, "plugin_silent")
    assert (event.engine, event.severity, event.source) == (E, "warning", "watchdog")
    assert "its /metrics counters moved over the last 30s with no step from its stat-logger plugin" in event.message
    assert "its last step arrived 30s ago" in event.message and "elastic EP" in event.message
    assert event.attributes["steps_arrive_as"] == ""
    assert h.state() == "progressing"  # the engine is fine: the counters say so
    h.clock.advance(1.0)
    h.step()
    h.tick(0.0)
    assert h.value("stepline_engine_plugin_silent_seconds") == 0
    [back] = events(h, "plugin_resumed")
    assert back.severity == "info" and back.attributes["silent_s"] == f"{h.now - silence_from:.1f}"


def test_steps_under_another_name_are_named_in_the_event() -> None:
    h = Harness(expect_plugin=True)
    for i in range(10):
        h.clock.advance(5.0)
        h.step(engine="vllm")  # STEPLINE_ENGINE left at its default
        scrape(h, 100.0 * i, 100.0 if i else 0.0)
        h.tick(0.0)
    [event] = events(h, "plugin_silent")
    assert "no step from it yet" in event.message and "steps arrive as engine 'vllm'" in event.message
    assert event.attributes["steps_arrive_as"] == "vllm"


def test_a_wedge_an_idle_engine_and_a_collector_without_plugins_see_no_silence() -> None:
    # A wedge holds requests running and moves no counter: the stall is the watchdog's page, not a silent plugin.
    wedged = Harness(expect_plugin=True)
    idle = Harness(expect_plugin=True)
    unexpected = Harness()  # the plugin source is off: nobody expects steps
    for i in range(20):
        for h in (wedged, idle, unexpected):
            h.clock.advance(5.0)
        scrape(wedged, 1000.0, 0.0, running=4)
        scrape(idle, 1000.0, 0.0, running=0)
        scrape(unexpected, 100.0 * i, 100.0 if i else 0.0)
        for h in (wedged, idle, unexpected):
            h.tick(0.0)
    assert wedged.state() == "stalled"
    for h in (wedged, idle, unexpected):
        assert events(h, "plugin_silent") == []
    assert wedged.value("stepline_engine_plugin_silent_seconds") == 0
    assert unexpected.value("stepline_engine_plugin_silent_seconds") is None


def test_an_engine_that_went_down_is_no_silent_plugin() -> None:
    h = Harness(expect_plugin=True)
    for i in range(10):
        h.clock.advance(5.0)
        scrape(h, 100.0 * i, 100.0 if i else 0.0)
        h.tick(0.0)
    assert h.value("stepline_engine_plugin_silent_seconds") != 0
    h.event("engine_down")
    h.tick(1.0)
    assert h.value("stepline_engine_plugin_silent_seconds") == 0
    assert events(h, "plugin_resumed") == []  # it did not come back: the engine went away
