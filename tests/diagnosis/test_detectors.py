"""Detectors over synthetic timelines in a real embedded store, and the demo's burst end to end."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from stepline.cli import diagnose as diagnose_cli
from stepline.core.usageerror import UsageError
from stepline.diagnosis.baseline import LONG_PROMPT_CHUNKS
from stepline.diagnosis.detectors import as_json, diagnose, render
from stepline.diagnosis.findings import Finding, Window
from stepline.model import schema
from stepline.model.rows import Event, GpuSample, Request, Step, micros
from stepline.store.store import Store

ENGINE = "e0"
NOW = datetime.now(UTC).replace(microsecond=0)
T0 = NOW - timedelta(minutes=10)


def _ts(offset_s: float) -> int:
    return micros(T0.timestamp() + offset_s)


def step(t: float, elapsed_ms: float = 10.0, *, prefill: int = 0, decoding: int = 2, waiting: int = 0,
         itl: list[float] | None = None, kv: float = 0.3, queries: int = 1000, hits: int = 950,
         preempted: int = 0, drafts: int = 0, drafted: int = 0, accepted: int = 0, n: int = 0) -> Step:
    return Step(_ts(t), "h", ENGINE, 0, "m", n, elapsed_ms, 1 if prefill else 0, prefill, decoding, decoding,
                decoding + (1 if prefill else 0), waiting, 0, kv, queries, hits, preempted, drafts, drafted,
                accepted, [], itl if itl is not None else [elapsed_ms / 1000] * decoding, False)


def request(rid: str, arrival: float, queue: float, ttft: float, decode: float, prompt: int,
            gen: int = 100, cached: int = 0) -> Request:
    return Request(_ts(arrival + ttft + decode), "h", ENGINE, 0, "m", rid, "plugin", "stop", _ts(arrival), queue,
                   ttft - queue, decode, ttft - queue + decode, ttft + decode, ttft, decode / gen, prompt, cached,
                   gen, 200, 0)


def gpu(t: float, util: float = 60.0, clock: float = 1900.0, flags: tuple[str, ...] = ()) -> GpuSample:
    """A sample with NVML's clock-event bitmask and its bits' names, as the GPU source writes them."""
    nan = float("nan")
    reasons = sum(bit for bit, name in schema.CLOCK_EVENT_FLAGS if name in flags)
    return GpuSample(_ts(t), "h", ENGINE, 0, "u0", "H100", clock, 2600.0, 400.0, 0, 60.0, 60.0, util, 0.0, 0, 0,
                     0.0, 0.0, 0, 0.0, 0.0, reasons, list(flags), nan, nan, nan, {})


def config(t: float = 0.0, **attrs: Any) -> Event:
    base = {"max_num_batched_tokens": "8192", "long_prefill_token_threshold": "0"}
    base.update({k: str(v) for k, v in attrs.items()})
    return Event(_ts(t), "h", ENGINE, "plugin", "engine_config", "info", "configured", base)


def insert(store: Store, rows: list[Any]) -> None:
    by_table: dict[str, list[Any]] = {}
    for row in rows:
        table = {Step: "steps", Request: "requests", GpuSample: "gpu_samples", Event: "events"}[type(row)]
        by_table.setdefault(table, []).append(row)
    for table, rs in by_table.items():
        store.insert(table, rs, rs[0]._fields)


def steady(seconds: int = 600, every: float = 0.5) -> list[Any]:
    """A healthy engine: 10 ms decode steps, a few short requests, GPUs busy, a high prefix-cache hit rate."""
    rows: list[Any] = [config()]
    rows += [step(i * every, n=i) for i in range(int(seconds / every))]
    rows += [gpu(float(i)) for i in range(seconds)]
    rows += [request(f"r{i}", 5.0 * i, 0.01, 0.05, 1.0, 2000) for i in range(100)]
    return rows


WINDOW = Window(T0 - timedelta(seconds=5), NOW, ENGINE)


def kinds(findings: list[Finding], at_least: str = "warning") -> set[str]:
    levels = ("info", "warning", "critical")
    return {f.kind for f in findings if levels.index(f.severity) >= levels.index(at_least)}


def test_healthy_timeline_has_nothing_above_info(store: Store) -> None:
    insert(store, steady())
    findings = diagnose(store, WINDOW)
    assert kinds(findings) == set(), render(findings)
    assert "detector_failed" not in kinds(findings, "info")


def _monster(store: Store, threshold: int = 0) -> None:
    rows: list[Any] = [config(long_prefill_token_threshold=threshold)]
    rows += [step(i * 0.1, n=i) for i in range(1000)]  # 0..100 s: decode only
    rows += [step(100 + i, 1200.0, prefill=8192, decoding=4, waiting=30, n=1000 + i) for i in range(30)]
    rows += [step(136 + i * 0.1, n=2000 + i) for i in range(1000)]
    rows += [gpu(float(i)) for i in range(230)]
    rows.append(request("monster", 100.0, 0.0, 30.0, 20.0, 250_000, 120))
    rows += [request(f"short{i}", 100.0 + i, 30.0 - i, 30.5 - i, 2.0, 3000, 30) for i in range(20)]
    rows += [request(f"quiet{i}", 5.0 * i, 0.0, 0.05, 1.0, 2000) for i in range(15)]
    insert(store, rows)


def test_prefill_interference_names_the_monster_and_head_of_line(store: Store) -> None:
    _monster(store)
    findings = diagnose(store, WINDOW)
    top = findings[0]
    assert (top.kind, top.severity) == ("prefill_interference", "critical"), render(findings)
    assert top.evidence["request_id"] == "monster"
    assert top.evidence["uncached_tokens"] == 250_000
    assert top.evidence["chunk_tokens"] == 8192
    assert top.evidence["itl_p99_inside_s"] == pytest.approx(1.2, rel=0.01)
    assert top.evidence["itl_p99_outside_s"] == pytest.approx(0.01, rel=0.01)
    assert "long_prefill_token_threshold=0" in top.lever and "max_num_batched_tokens=8192" in top.lever
    # One cause, one finding: the requests queued behind the monster, and the slow decode rate under load, are
    # symptoms attached to the monster's finding, not findings of their own.
    assert "head_of_line_blocking" not in kinds(findings, "info"), render(findings)
    hol = [s for s in top.evidence["symptoms"] if s["kind"] == "head_of_line_blocking"]
    assert hol and hol[0]["queued_requests"] == 20
    assert hol[0]["queue_max_s"] == pytest.approx(30.0, abs=0.1)
    assert top.score == pytest.approx(4 * 1.2 * 30 + hol[0]["request_s"], rel=0.01)
    assert "scheduler_vs_hardware" in {s["kind"] for s in top.evidence["symptoms"]}
    # The SQL stands alone: pasted into the store it answers.
    assert store.query(top.sql).result_rows[0][0] == 30


def test_config_not_in_effect_when_chunks_exceed_threshold(store: Store) -> None:
    _monster(store, threshold=2048)
    found = [f for f in diagnose(store, WINDOW) if f.kind == "config_not_in_effect"]
    assert found and found[0].evidence["steps_over_threshold"] == 30


def test_config_in_effect_is_quiet(store: Store) -> None:
    rows = steady()
    rows[0] = config(long_prefill_token_threshold=2048)
    rows += [step(300 + i * 0.01, 12.0, prefill=2048, n=9000 + i) for i in range(5)]
    insert(store, rows)
    assert "config_not_in_effect" not in kinds(diagnose(store, WINDOW), "info")


def test_wedged_engine_is_critical(store: Store) -> None:
    rows: list[Any] = [step(i * 0.5, n=i) for i in range(600)]  # steps stop at 300 s, window ends at 600 s
    rows.append(step(300, waiting=12, n=700))
    rows += [gpu(float(i), util=0.0) for i in range(600)]
    insert(store, rows)
    wedged = [f for f in diagnose(store, WINDOW) if f.kind == "wedged_engine"]
    assert wedged and wedged[0].severity == "critical" and wedged[0].evidence["waiting"] == 12


def test_legitimately_slow_engine_is_not_wedged(store: Store) -> None:
    rows: list[Any] = [step(i * 0.5, n=i) for i in range(1000)]
    # A long-context decode: a 20 s step, then 2 s steps until now, with requests waiting.
    rows += [step(520 + i * 2, 2000.0 if i else 20_000.0, waiting=5, decoding=1, n=2000 + i) for i in range(40)]
    rows += [gpu(float(i), util=95.0) for i in range(600)]
    insert(store, rows)
    findings = diagnose(store, WINDOW)
    assert "wedged_engine" not in kinds(findings, "info")
    slow = [f for f in findings if f.kind == "legitimately_slow"]
    assert slow and slow[0].evidence["slowdown"] == "200.0x (slow from 10x)"


def _cached_chat(first: float, last: float, cached_share: float, prefix: str) -> list[Any]:
    """A 2,000-token request every 2 s from `first` to `last`, `cached_share` of each prompt a prefix-cache hit."""
    return [request(f"{prefix}{i}", first + 2.0 * i, 0.01, 0.05, 1.0, 2000, cached=round(2000 * cached_share))
            for i in range(int((last - first) / 2))]


def test_prefix_cache_collapse_against_own_baseline(store: Store) -> None:
    # Per request, against the engine's usual rate: requests 95% cached, then 2% cached from 400 s on.
    rows = [r for r in steady() if not isinstance(r, Request)]
    rows += _cached_chat(0, 400, 0.95, "cached") + _cached_chat(400, 590, 0.02, "fresh")
    insert(store, rows)
    found = [f for f in diagnose(store, WINDOW) if f.kind == "prefix_cache_collapse"]
    assert found and found[0].evidence["hit_rate_usual"] == pytest.approx(0.95, abs=0.01)
    assert found[0].evidence["hit_rate_low"] < 0.1


def test_one_uncached_monster_is_no_prefix_cache_collapse(store: Store) -> None:
    # Token-weighted, one uncached 300k-token prompt is the whole bucket's lookups; per request it is one request.
    rows = [r for r in steady() if not isinstance(r, Request)]
    rows += _cached_chat(0, 590, 0.95, "cached")
    rows += [step(450.05, 50.0, prefill=8192, n=9000, queries=300_000, hits=0),
             request("monster", 450.0, 0.0, 40.0, 5.0, 300_000, 50)]
    insert(store, rows)
    assert not [f for f in diagnose(store, WINDOW) if f.kind == "prefix_cache_collapse"]


def test_kv_pressure_needs_preemptions(store: Store) -> None:
    rows = steady()
    rows += [step(300 + i, kv=0.99, n=8000 + i) for i in range(10)]
    insert(store, rows)
    assert "kv_pressure" not in kinds(diagnose(store, WINDOW), "info")
    insert(store, [step(320, kv=0.99, preempted=3, n=8100)])
    found = [f for f in diagnose(store, WINDOW) if f.kind == "kv_pressure"]
    assert found and found[0].evidence["preemptions"] == 3


def test_gpu_xid_is_critical(store: Store) -> None:
    rows = steady()
    rows.append(Event(_ts(200), "h", ENGINE, "nvml", "gpu_xid", "critical", "XID 79 on GPU 0", {"xid": "79"}))
    insert(store, rows)
    found = [f for f in diagnose(store, WINDOW) if f.kind == "gpu_xid"]
    assert found and found[0].severity == "critical" and found[0].evidence["xids"] == ["79"]
    # Slow steps around it are slow for this engine: ten of its 10 ms decode-only steps.
    assert (found[0].evidence["slow_step_from_ms"], found[0].evidence["slow_steps_in_window"]) == (100.0, 0)


def test_spec_decode_shift_from_window_deltas(store: Store) -> None:
    rows = steady()
    assert "spec_decode_acceptance_shift" not in kinds(diagnose(store, WINDOW), "info")  # no drafts: silent
    rows += [step(10 + i, drafts=10, drafted=40, accepted=32, n=7000 + i) for i in range(100)]
    rows += [step(400 + i, drafts=10, drafted=40, accepted=12, n=7200 + i) for i in range(100)]
    insert(store, rows)
    found = [f for f in diagnose(store, WINDOW) if f.kind == "spec_decode_acceptance_shift"]
    assert found and found[0].evidence["acceptance_max"] == pytest.approx(0.8, abs=0.01)
    assert found[0].evidence["acceptance_min"] == pytest.approx(0.3, abs=0.01)


def test_failing_detector_is_reported_and_others_run(store: Store) -> None:
    _monster(store)

    def broken(reader: Any, window: Window) -> list[Finding]:
        raise RuntimeError("boom")

    from stepline.diagnosis.detectors import DETECTORS
    findings = diagnose(store, WINDOW, (("broken", broken), *DETECTORS))
    assert findings[0].kind == "prefill_interference"
    failed = [f for f in findings if f.kind == "detector_failed"]
    assert failed and failed[0].evidence["detector"] == "broken" and failed[0].severity == "info"


def test_render_fits_and_json_round_trips(store: Store) -> None:
    _monster(store)
    findings = diagnose(store, WINDOW)
    text = render(findings)
    prose = [line for line in text.splitlines() if not line.startswith("     ")]  # SQL lines stay whole to paste
    assert all(len(line) <= 80 for line in prose), [line for line in prose if len(line) > 80]
    assert "CRITICAL  prefill_interference" in text
    assert json.loads(as_json(findings))[0]["evidence"]["request_id"] == "monster"
    assert render([]).startswith("no findings")


def test_cli_window_and_bad_input() -> None:
    parser = argparse.ArgumentParser()
    diagnose_cli.add_arguments(parser)
    w = diagnose_cli.window_of(parser.parse_args(["--since", "30m", "--engine", "x"]), NOW)
    assert (w.end - w.start, w.engine) == (timedelta(minutes=30), "x")
    w = diagnose_cli.window_of(parser.parse_args(["--from", "2026-01-01T00:00:00", "--to", "2026-01-01T01:00:00"]))
    assert w.start == datetime(2026, 1, 1, tzinfo=UTC)
    for bad in (["--since", "soon"], ["--from", "2026-01-01T02:00:00", "--to", "2026-01-01T01:00:00"]):
        with pytest.raises(UsageError):
            diagnose_cli.window_of(parser.parse_args(bad))


def test_demo_burst_top_finding_is_the_monster(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, "-m", "stepline", "demo", "--fast", "--duration", "120"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    # chDB hosts one store path per process and this session's is taken: diagnose in a process of its own.
    script = ("import argparse, sys; from stepline.cli import diagnose as cli; p = argparse.ArgumentParser(); "
              "cli.add_arguments(p); sys.exit(cli.run(p.parse_args(sys.argv[1:])))")
    done = subprocess.run([sys.executable, "-c", script, "--since", "1h", "--json", "--store",
                           f"chdb://{tmp_path}/stepline-data"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 1, done.stderr[-2000:]  # a critical finding
    top = json.loads(done.stdout)[0]
    assert top["kind"] == "prefill_interference", done.stdout[:3000]
    assert top["evidence"]["request_id"].startswith("burst-") and top["evidence"]["prompt_tokens"] >= 100_000


def _engine_like_vllm_cpu(store: Store, scale: float, budget: int, *, configured: bool = True) -> None:
    """Like the real vLLM CPU engine (scale 1): 7 ms decode-only steps, 1,024-token chunks of ~230 ms, and a
    request's queue time ending 0.13 s before its first chunk (vLLM's queue time leaves out tokenisation).
    `scale` slows every step by that much (and `budget` sets the chunk): the same engine, only slower."""
    decode_ms, chunk_ms = 7.0 * scale, 230.0 * scale
    prompt = 6 * budget - 200  # six chunks
    rows: list[Any] = [config(max_num_batched_tokens=budget)] if configured else []
    n = 0

    def decode_until(t: float, end: float) -> float:
        nonlocal n
        while t < end:
            t += decode_ms / 1000
            rows.append(step(t, decode_ms, decoding=4, n=n))
            n += 1
        return t

    # The uncached prompt: arrives, queues 0.1 s, is tokenised for 0.13 s more while decode-only steps run, then
    # prefills in six chunks beside the four decoding requests; its first token comes with the last chunk.
    t = decode_until(0.0, 20.0)
    arrival = t - 0.1
    t = decode_until(t, t + 0.13)
    for left in range(prompt, 0, -budget):
        t += chunk_ms / 1000
        rows.append(step(t, chunk_ms, prefill=min(budget, left), decoding=4, n=n))
        n += 1
    rows.append(request("long-uncached", arrival, 0.1, t - arrival, 0.7 * scale, prompt))
    # The same prompt again as a prefix-cache hit: all but its last block is cached, one short step prefills it.
    t = decode_until(t, 40.0)
    arrival = t - 0.1
    t = decode_until(t, t + 0.13)
    t += decode_ms * 1.2 / 1000
    rows.append(step(t, decode_ms * 1.2, prefill=16, decoding=4, n=n))
    n += 1
    rows.append(request("long-cached", arrival, 0.1, t - arrival, 0.7 * scale, prompt, cached=prompt - 16))
    decode_until(t, 60.0 * max(1.0, scale / 4))
    insert(store, rows)


@pytest.mark.parametrize(("scale", "budget", "severity"), [(1.0, 1024, "warning"), (10.0, 8192, "critical")])
def test_interference_on_a_fast_engine_is_found_as_on_a_slow_one(store: Store, scale: float, budget: int,
                                                                  severity: str) -> None:
    _engine_like_vllm_cpu(store, scale, budget)
    findings = diagnose(store, WINDOW)
    found = [f for f in findings if f.kind == "prefill_interference"]
    # The uncached prompt is found; the same prompt as a prefix-cache hit is not.
    assert [f.evidence["request_id"] for f in found] == ["long-uncached"], render(findings)
    top = found[0]
    # A 33x slowdown: critical only where a reader sees stalls (ITL p99 >= 1 s), a warning on the fast engine.
    assert top.severity == severity
    e = top.evidence
    # The window is the steps that carried the prefill, not the decode-only steps of its tokenisation before them.
    assert e["step_p50_inside_ms"] == pytest.approx(230.0 * scale)
    assert e["step_p50_decode_only_outside_ms"] == pytest.approx(7.0 * scale)
    assert e["step_slowdown"] == "32.9x (interference from 5x)"
    assert e["itl_p99_inside_s"] == pytest.approx(0.23 * scale, rel=0.01)
    assert e["itl_p99_outside_s"] == pytest.approx(0.007 * scale, rel=0.01)
    assert e["itl_p99_slowdown"].startswith("32.9x")
    assert e["first_chunk_after_queue_end_s"] == pytest.approx(0.13, abs=0.01 * scale)
    assert (e["token_budget"], e["token_budget_from"]) == (budget, "engine_config")
    assert e["long_from_uncached_tokens"] == LONG_PROMPT_CHUNKS * budget and e["uncached_tokens"] == 6 * budget - 200
    assert e["chunk_tokens"] == budget
    assert "32.9x" in render(findings)  # the compared figures are among those a terminal shows
    # The SQL stands alone: it counts the six chunk steps, none of the decode-only steps before them.
    assert store.query(top.sql).result_rows[0][0] == 6


def test_without_a_config_the_budget_is_the_largest_chunk_seen(store: Store) -> None:
    _engine_like_vllm_cpu(store, 1.0, 1024, configured=False)
    found = [f for f in diagnose(store, WINDOW) if f.kind == "prefill_interference"]
    assert [f.evidence["request_id"] for f in found] == ["long-uncached"]
    assert (found[0].evidence["token_budget"], found[0].evidence["token_budget_from"]) == (1024, "largest chunk seen")


def test_a_fast_engine_slowed_tenfold_is_legitimately_slow_not_wedged(store: Store) -> None:
    # 1 ms decode steps, then 40 ms steps with requests waiting: slow for this engine, though far below a second.
    rows: list[Any] = [step(i * 0.5, 1.0, n=i) for i in range(1000)]
    rows += [step(560 + i * 0.1, 40.0, waiting=5, decoding=1, n=2000 + i) for i in range(400)]
    rows += [gpu(float(i), util=95.0) for i in range(600)]
    insert(store, rows)
    findings = diagnose(store, WINDOW)
    slow = [f for f in findings if f.kind == "legitimately_slow"]
    assert slow and "wedged_engine" not in kinds(findings, "info"), render(findings)
    assert slow[0].evidence["baseline_decode_step_p50_ms"] == 1.0
    assert slow[0].evidence["slowdown"] == "40.0x (slow from 10x)"
