"""The stat-logger plugin: exact round trip to the receiver, counted drops, never a raise on vLLM's path."""

from __future__ import annotations

import logging
import math
import os
import socket
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry

from stepline.config.settings import Settings
from stepline.core.clock import ManualClock
from stepline.ingest.metrics import IngestMetrics
from stepline.ingest.runner import Runner
from stepline.ingest.writer import Writers
from stepline.model.rows import Event, Request, Row, Step, micros
from stepline.plugin import wire
from stepline.plugin.config import describe_config, token_from_env
from stepline.plugin.core import PluginCore, engine_name_from_env
from stepline.sim.config import EngineConfig
from stepline.sim.telemetry import Telemetry
from stepline.sources import registry as sources
from stepline.sources.base import SourceContext
from stepline.sources.plugin_receiver import PluginReceiver
from stepline.testing import vllm_standins as standins
from stepline.testing.sink import MemorySink

NOW = 1_790_000_000.25


@pytest.fixture
def receiver(sock_dir: str) -> Iterator[PluginReceiver]:
    r = PluginReceiver(SourceContext("node-1", ManualClock(NOW)), os.path.join(sock_dir, "plugin.sock"),
                       window_s=0.05)
    r.start()
    yield r
    r.stop()


def _poll(receiver: PluginReceiver) -> list[Row]:
    rows: list[Row] = []
    receiver.poll(rows.extend)
    return rows


def _step_stats(i: int = 7, running: int = 32) -> tuple[standins.SchedulerStats, standins.IterationStats]:
    sched = standins.SchedulerStats(
        num_running_reqs=running, num_waiting_reqs=3, num_skipped_waiting_reqs=1, kv_cache_usage=0.5,
        iteration_details=standins.SchedulerIterationDetails(i, 1, 8192, running - 1, running - 1, 412.5),
        prefix_cache_stats=standins.PrefixCacheStats(requests=1, queries=9000, hits=512),
        spec_decoding_stats=standins.SpecDecodingStats(num_drafts=4, num_draft_tokens=12, num_accepted_tokens=7),
    )
    it = standins.IterationStats(
        iteration_timestamp=NOW, num_generation_tokens=running, num_preempted_reqs=2,
        time_to_first_tokens_iter=[1.5], inter_token_latencies_iter=[0.4125] * (running - 1),
        finished_requests=[standins.FinishedRequestStats(
            standins.FinishReason.LENGTH, "cmpl-abc-0", e2e_latency=12.0, num_prompt_tokens=3000,
            num_generation_tokens=37, max_tokens_param=37, queued_time=2.0, prefill_time=1.5, inference_time=9.5,
            decode_time=8.0, mean_time_per_output_token=8.0 / 36, num_cached_tokens=2048, num_preemptions=1)],
    )
    return sched, it


def test_round_trip_is_exact(receiver: PluginReceiver) -> None:
    core = PluginCore("prod-a", receiver.socket_path)
    core.engine_initialized({"model": "Qwen/Qwen3-8B", "max_num_batched_tokens": 8192})
    core.record(*_step_stats(), engine_idx=1)
    core.flush()
    rows = _poll(receiver)
    (config,) = [r for r in rows if isinstance(r, Event)]
    assert config.kind == "engine_config" and config.engine == "prod-a"
    assert config.attributes["max_num_batched_tokens"] == "8192"
    (step,) = [r for r in rows if isinstance(r, Step)]
    # waiting: vLLM's 3 waiting plus its 1 deferred, as vllm:num_requests_waiting counts them; skipped_waiting: the 1.
    assert step._replace(ttft_seconds=[], itl_seconds=[]) == Step(micros(NOW), "node-1", "prod-a", 1, "Qwen/Qwen3-8B",
                                                                  7, 412.5, 1, 8192, 31, 31, 32, 4, 1, 0.5, 9000, 512,
                                                                  2, 4, 12, 7, [], [], False, 412.5, "elapsed")
    # The samples come as the wire carries them: float32 (stepline.plugin.wire._samples).
    assert list(step.ttft_seconds) == [1.5] and step.itl_seconds == pytest.approx([0.4125] * 31)
    (request,) = [r for r in rows if isinstance(r, Request)]
    assert request.request_id == "cmpl-abc-0" and request.source == "plugin" and request.finish_reason == "length"
    assert request.ts == micros(NOW) and request.arrival_ts == micros(NOW - 12.0)
    assert (request.prompt_tokens, request.cached_tokens, request.generation_tokens, request.max_tokens,
            request.preemptions) == (3000, 2048, 37, 37, 1)
    assert request.ttft_seconds == pytest.approx(4.0)  # e2e less decode
    assert request.queue_seconds == 2.0 and request.mean_tpot_seconds == pytest.approx(8.0 / 36)
    assert core.records_sent == 3 and core.dropped_total == 0
    assert receiver.stats()["steps"] == 1 and receiver.stats()["requests"] == 1


def test_steps_without_iteration_details_are_numbered_and_flagged(receiver: PluginReceiver) -> None:
    core = PluginCore("e", receiver.socket_path)
    for _ in range(3):
        core.record(standins.SchedulerStats(num_running_reqs=1), standins.IterationStats(iteration_timestamp=NOW))
    core.flush()
    steps = [r for r in _poll(receiver) if isinstance(r, Step)]
    assert [s.step for s in steps] == [0, 1, 2]
    assert all(math.isnan(s.elapsed_ms) for s in steps)


def test_no_sidecar_drops_are_counted_and_logged_once(sock_dir: str, caplog: pytest.LogCaptureFixture) -> None:
    clock = [0.0]
    core = PluginCore("e", os.path.join(sock_dir, "absent.sock"), log_interval_s=60, monotonic=lambda: clock[0])
    with caplog.at_level(logging.WARNING, logger="stepline.plugin"):
        for i in range(100):
            clock[0] = i * 0.1
            core.record(*_step_stats(i))
        clock[0] = 61.0
        core.flush()
        # The sender thread logs the drops on its next pass: on a busy machine, a while after flush() returns.
        deadline = time.monotonic() + 10
        while not _drop_warnings(caplog) and time.monotonic() < deadline:
            time.sleep(0.01)
    assert core.dropped["no_sidecar"] == 200  # 100 steps and 100 finished requests
    assert core.records_sent == 0
    warnings = _drop_warnings(caplog)
    assert len(warnings) == 1 and "200 (no_sidecar)" in warnings[0].getMessage()


def _drop_warnings(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if "dropped" in r.getMessage()]


def test_sidecar_arriving_later_gets_the_new_steps(sock_dir: str) -> None:
    path = os.path.join(sock_dir, "late.sock")
    clock = [0.0]
    core = PluginCore("e", path, reconnect_interval_s=1.0, monotonic=lambda: clock[0])
    core.record(*_step_stats(1))
    core.flush()
    assert core.dropped["no_sidecar"] == 2
    late = PluginReceiver(SourceContext("h", ManualClock(NOW)), path, window_s=0.05)
    late.start()
    try:
        clock[0] = 2.0
        core.record(*_step_stats(2))
        core.flush()
        rows = _poll(late)
        assert [r.step for r in rows if isinstance(r, Step)] == [2]
        # What the plugin dropped before this sidecar listened reaches the timeline with its first datagram.
        (event,) = [r for r in rows if isinstance(r, Event)]
        assert event.kind == "plugin_data_lost" and event.attributes["dropped_records"] == "2"
        assert late.stats()["plugin_dropped_records"] == 2
        core.record(*_step_stats(3))
        core.flush()
        rows = _poll(late)
        assert [r.step for r in rows if isinstance(r, Step)] == [3]
        assert not [r for r in rows if isinstance(r, Event)] and late.stats()["plugin_dropped_records"] == 2
    finally:
        late.stop()


def test_a_slow_sidecar_bounds_the_buffer_and_counts(sock_dir: str) -> None:
    path = os.path.join(sock_dir, "slow.sock")
    server = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    server.bind(path)  # bound but never read: the kernel queue fills, sends hit EAGAIN
    try:
        core = PluginCore("e", path, max_buffer_bytes=200_000, flush_interval_s=0.0)
        for i in range(3000):
            core.record(*_step_stats(i))
        core.flush()
        assert core.datagrams_sent >= 1
        assert core.dropped.get("buffer_full", 0) > 0
        sent, dropped, held = core.accounting()  # read together: the sender thread moves records meanwhile
        assert sent + sum(dropped.values()) + held == 6000
    finally:
        server.close()


def test_an_oversized_record_is_dropped_and_counted(receiver: PluginReceiver) -> None:
    core = PluginCore("e", receiver.socket_path)
    sched, it = _step_stats()
    it.finished_requests[0].request_id = "x" * 100_000  # truncated to the wire's limit, still fits
    it.inter_token_latencies_iter = [0.01] * 20_000  # 80 KB of samples: capped by the wire format
    core.record(sched, it)
    core.flush()
    rows = _poll(receiver)
    assert len([r for r in rows if isinstance(r, Step)]) == 1
    (req,) = [r for r in rows if isinstance(r, Request)]
    assert len(req.request_id) == wire.MAX_REQUEST_ID


odd = st.one_of(st.none(), st.integers(-(2**70), 2**70), st.floats(allow_nan=True), st.text(max_size=5),
                st.lists(st.floats(allow_nan=True), max_size=3), st.just(object()))


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(values=st.dictionaries(st.sampled_from([
    "num_running_reqs", "num_waiting_reqs", "kv_cache_usage", "iteration_details", "prefix_cache_stats",
    "spec_decoding_stats", "iteration_timestamp", "finished_requests", "time_to_first_tokens_iter",
    "inter_token_latencies_iter", "num_preempted_reqs", "request_id", "e2e_latency", "finish_reason",
    "max_tokens_param", "num_prompt_tokens"]), odd, max_size=6), drop_scheduler=st.booleans())
def test_record_never_raises_whatever_vllm_hands_it(values: dict[str, Any], drop_scheduler: bool) -> None:
    sched, it = _step_stats()
    targets = (sched, it, it.finished_requests[0])
    for name, value in values.items():
        for target in targets:
            if hasattr(target, name):
                setattr(target, name, value)
    core = PluginCore("e", "/nonexistent/stepline.sock")
    core.record(None if drop_scheduler else sched, it)
    core.record(sched, None)
    core.flush()
    assert core.records_sent == 0  # nothing listens; and yet no exception escaped


@settings(max_examples=300, deadline=None)
@given(data=st.binary(max_size=2000))
def test_decode_rejects_garbage_cleanly(data: bytes) -> None:
    try:
        decoded = wire.decode(data)
    except wire.WireError as exc:
        assert str(exc)  # a clean error that names the problem
    else:
        assert isinstance(decoded.header, wire.Header)


@given(prefix=st.binary(min_size=0, max_size=40))
@settings(max_examples=200, deadline=None)
def test_decode_survives_mutated_real_datagrams(prefix: bytes) -> None:
    real = wire.encode_header(b"e", 1, 2, 3, 0) + wire.encode_step(wire.StepRecord(
        NOW, 1, 0, 5.0, 1, 2, 3, 4, 5, 6, 7, 0.5, 8, 9, 0, 0, 0, 0, False, (0.1,), (0.2, 0.3)))
    mutated = prefix + real[len(prefix):]
    try:
        decoded = wire.decode(mutated)
    except wire.WireError as exc:
        assert str(exc)  # a clean error that names the problem
    else:
        assert isinstance(decoded.header, wire.Header)


@pytest.mark.parametrize(
    ("data", "fragment"),
    [
        (b"GET / HTTP/1.1\r\n\r\n" + b"\0" * 40, "bad magic"),
        (wire.HEADER.pack(wire.MAGIC, 9, 0, 1, 1, 1, 0, 0) + b"e", "datagram version 9"),
        (b"STPL", "shorter than a header"),
        (wire.encode_header(b"e", 1, 1, 0, 0) + b"\x07\x00\x00", "unknown record type 7"),
        (wire.encode_header(b"e", 1, 1, 0, 0) + wire.RECORD.pack(1, 500) + b"x", "runs past the datagram"),
        (wire.encode_header(b"e", 1, 1, 0, 0) + wire.RECORD.pack(1, 3) + b"xyz", "step record of 3 bytes"),
        (b"STPL" + b"\0" * (wire.MAX_DATAGRAM + 10), "exceeds"),
    ],
)
def test_receiver_counts_and_skips_malformed_datagrams(receiver: PluginReceiver, data: bytes, fragment: str,
                                                       caplog: pytest.LogCaptureFixture) -> None:
    sender = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sender.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 1 << 20)
    sender.connect(receiver.socket_path)
    with caplog.at_level(logging.WARNING):
        sender.send(data)
        core = PluginCore("e", receiver.socket_path)
        core.record(*_step_stats())
        core.flush()
        rows = _poll(receiver)
    sender.close()
    assert receiver.stats()["malformed"] == 1
    assert fragment in caplog.text
    assert len([r for r in rows if isinstance(r, Step)]) == 1  # the good datagram after it still lands


def test_lost_and_dropped_data_reaches_the_timeline(receiver: PluginReceiver) -> None:
    sender = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sender.connect(receiver.socket_path)
    sender.send(wire.encode_header(b"e", 5, 9, 0, 0))
    sender.send(wire.encode_header(b"e", 5, 9, 4, 120))  # datagrams 1-3 never came; 120 records dropped
    sender.close()
    rows = _poll(receiver)
    assert receiver.stats()["lost_datagrams"] == 3 and receiver.stats()["plugin_dropped_records"] == 120
    (event,) = [r for r in rows if isinstance(r, Event)]
    assert event.kind == "plugin_data_lost" and event.attributes["dropped_records"] == "120"


def test_loss_within_the_minute_is_told_with_the_next_event_or_at_stop(sock_dir: str) -> None:
    clock = ManualClock(NOW)
    receiver = PluginReceiver(SourceContext("node-1", clock), os.path.join(sock_dir, "loss.sock"), window_s=0.05)
    receiver.start()
    sender = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sender.connect(receiver.socket_path)

    def losses(*headers: tuple[int, int]) -> list[tuple[str, str]]:
        for sequence, dropped in headers:
            sender.send(wire.encode_header(b"e", 5, 9, sequence, dropped))
        return [(r.attributes["dropped_records"], r.attributes["lost_datagrams"]) for r in _poll(receiver)
                if isinstance(r, Event)]

    try:
        assert losses((0, 0), (1, 10)) == [("10", "0")]  # told at once
        assert losses((2, 25), (5, 25)) == []  # within the minute: counted, not yet told
        clock.advance(61)
        assert losses((6, 25)) == [("15", "2")]  # the minute's loss, with the next datagram after it
        assert losses((7, 30)) == []
    finally:
        sender.close()
        receiver.stop()
    assert [(r.attributes["dropped_records"], r.kind) for r in _poll(receiver) if isinstance(r, Event)] == [
        ("5", "plugin_data_lost")]  # nothing counted is left off the timeline
    assert receiver.stats()["plugin_dropped_records"] == 30 and receiver.stats()["lost_datagrams"] == 2


def test_a_stopping_receiver_refuses_new_datagrams_so_the_plugin_counts_them(receiver: PluginReceiver) -> None:
    core = PluginCore("e", receiver.socket_path)
    core.record(*_step_stats(1))
    core.flush()  # connected, one datagram queued in the kernel
    receiver.stop()
    core.record(*_step_stats(2))
    core.flush()  # refused at once (EPIPE or ECONNREFUSED), never silently queued and discarded
    assert core.dropped == {"no_sidecar": 2} and core.records_sent == 2
    assert [r.step for r in _poll(receiver) if isinstance(r, Step)] == [1]


def test_stop_keeps_what_was_queued(receiver: PluginReceiver) -> None:
    core = PluginCore("e", receiver.socket_path)
    core.record(*_step_stats())
    core.flush()
    receiver.stop()
    assert len([r for r in _poll(receiver) if isinstance(r, Step)]) == 1
    assert not os.path.exists(receiver.socket_path)


def test_a_path_that_is_not_a_socket_is_refused(sock_dir: str) -> None:
    path = Path(sock_dir) / "file"
    path.write_text("x")
    with pytest.raises(OSError, match="exists and is not a socket"):
        PluginReceiver(SourceContext("h", ManualClock()), str(path)).start()


def test_engine_name_and_configuration() -> None:
    assert engine_name_from_env({"STEPLINE_ENGINE": "a", "OTEL_SERVICE_NAME": "b"}) == "a"
    assert engine_name_from_env({"OTEL_SERVICE_NAME": "b"}) == "b"
    assert engine_name_from_env({}) == "vllm"

    class Section:
        def __init__(self, **kw: Any) -> None:
            self.__dict__.update(kw)

    config = Section(model_config=Section(model="m", max_model_len=32768),
                     scheduler_config=Section(max_num_batched_tokens=8192, max_num_seqs=256,
                                              enable_chunked_prefill=True, long_prefill_token_threshold=0,
                                              policy=Section()),
                     cache_config=Section(block_size=16, num_gpu_blocks=None), speculative_config=None)
    described = describe_config(config, 2)
    assert described["max_num_batched_tokens"] == 8192 and described["engine_index"] == 2
    assert "num_gpu_blocks" not in described and described["speculative_decoding"] is False
    assert isinstance(described["scheduling_policy"], str)


def test_the_entry_point_is_declared_and_loads_a_real_stat_logger_subclass(tmp_path: Path) -> None:
    # A stand-in `vllm` package with vLLM's module path and ABC, as vLLM's plugin loader would see it.
    standins.write_vllm_package(tmp_path)
    script = textwrap.dedent("""
        from importlib.metadata import entry_points
        from vllm.v1.metrics.loggers import StatLoggerBase
        (ep,) = [e for e in entry_points(group="vllm.stat_logger_plugins") if e.name == "stepline"]
        cls = ep.load()
        assert issubclass(cls, StatLoggerBase), cls
        logger = cls(object(), 0)
        logger.record(None, None)
        logger.log_engine_initialized()
        logger.log()
        print(ep.value)
    """)
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
           "STEPLINE_PLUGIN_SOCKET": str(tmp_path / "none.sock")}
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "stepline.plugin.vllm_logger:SteplineStatLogger"


# -- the datagram token -----------------------------------------------------------------------------------------

TOKEN = "tok-9f2c1e7a-not-a-real-secret"


def _token_receiver(sock_dir: str, token: str | None) -> PluginReceiver:
    r = PluginReceiver(SourceContext("node-1", ManualClock(NOW)), os.path.join(sock_dir, "auth.sock"), token=token,
                       window_s=0.05)
    r.start()
    return r


def _send_one(path: str, token: str | None, engine: str = "e") -> PluginCore:
    core = PluginCore(engine, path, token=token)
    core.record(*_step_stats())
    core.flush()
    assert core.datagrams_sent == 1 and core.dropped_total == 0
    return core


def test_a_datagram_with_the_right_token_is_accepted(sock_dir: str) -> None:
    receiver = _token_receiver(sock_dir, TOKEN)
    try:
        _send_one(receiver.socket_path, TOKEN)
        rows = _poll(receiver)
    finally:
        receiver.stop()
    assert len([r for r in rows if isinstance(r, Step)]) == 1 and len([r for r in rows if isinstance(r, Request)]) == 1
    assert receiver.stats()["unauthorized"] == 0 and receiver.stats()["steps"] == 1


def test_wrong_or_missing_token_is_rejected_counted_and_logged_without_the_token(
        sock_dir: str, caplog: pytest.LogCaptureFixture) -> None:
    receiver = _token_receiver(sock_dir, TOKEN)
    try:
        with caplog.at_level(logging.DEBUG):
            _send_one(receiver.socket_path, "another-token")
            _send_one(receiver.socket_path, None)  # a plugin without a token (or from before tokens): version 1
            _send_one(receiver.socket_path, TOKEN[:-1])
            rows = _poll(receiver)
            _send_one(receiver.socket_path, TOKEN)  # the right one still gets through afterwards
            accepted = _poll(receiver)
    finally:
        receiver.stop()
    assert rows == [] and receiver.stats()["unauthorized"] == 3
    assert receiver.stats()["steps"] == 1 and len([r for r in accepted if isinstance(r, Step)]) == 1
    # Nothing of a rejected datagram counts: not its steps, not its sender's sequence or drops.
    assert receiver.stats()["plugin_dropped_records"] == 0 and receiver.stats()["malformed"] == 0
    rejections = [r for r in caplog.records if "rejected a plugin datagram" in r.getMessage()]
    assert len(rejections) == 1  # rate-limited: one line for three rejections
    assert "no credential" not in rejections[0].getMessage()  # the first one carried another token's credential
    for secret in (TOKEN, TOKEN[:-1], "another-token", wire.credential_for(TOKEN).hex(),
                   wire.credential_for("another-token").hex()):
        assert secret not in caplog.text


def test_a_tokenless_collector_accepts_plugins_with_and_without_a_token(receiver: PluginReceiver) -> None:
    _send_one(receiver.socket_path, TOKEN, engine="with")
    _send_one(receiver.socket_path, None, engine="without")
    rows = _poll(receiver)
    assert sorted(r.engine for r in rows if isinstance(r, Step)) == ["with", "without"]
    assert receiver.stats()["unauthorized"] == 0


def test_versions_a_plugin_writes_the_lowest_that_says_what_it_sends() -> None:
    credential = wire.credential_for(TOKEN)
    plain, signed = wire.encode_header(b"e", 1, 2, 3, 4), wire.encode_header(b"e", 1, 2, 3, 4, credential)
    assert (plain[4], plain[5]) == (1, 0)  # byte-for-byte what a collector from before tokens reads
    assert (signed[4], signed[5]) == (2, wire.FLAG_CREDENTIAL) and signed.endswith(b"e" + credential)
    assert TOKEN.encode() not in signed
    header, offset = wire.decode_header(signed)
    assert header.credential == credential and header.version == 2 and offset == len(signed)
    assert wire.decode_header(plain)[0].credential == b""
    assert len(credential) == wire.CREDENTIAL_SIZE and credential != wire.credential_for(TOKEN + "x")
    for bad, fragment in ((bytes([*signed[:5], 0x03, *signed[6:]]), "unknown flags"),
                          (bytes([*plain[:5], wire.FLAG_CREDENTIAL, *plain[6:]]), "unknown flags"),
                          (signed[:-1], "credential does not fit")):
        with pytest.raises(wire.WireError, match=fragment):
            wire.decode_header(bad)
    with pytest.raises(ValueError, match="16 bytes"):
        wire.encode_header(b"e", 1, 2, 3, 4, b"short")


def test_the_collector_settings_token_reaches_the_receiver_and_its_count_is_exported(sock_dir: str) -> None:
    settings = Settings(plugin_socket=os.path.join(sock_dir, "c.sock"), plugin_token=TOKEN)
    (spec,) = [s for s in sources.REGISTRY if s.name == "plugin"]
    (receiver,) = spec.build(settings, SourceContext("node-1", ManualClock(NOW)))
    assert isinstance(receiver, PluginReceiver)
    metrics = IngestMetrics(CollectorRegistry())
    runner = Runner([], Writers(MemorySink(), metrics), metrics, "node-1")
    receiver.start()
    try:
        _send_one(receiver.socket_path, "wrong")
        _send_one(receiver.socket_path, TOKEN)
        runner.poll_once(receiver)
    finally:
        receiver.stop()
    assert metrics.registry.get_sample_value(
        "stepline_source_counts_total", {"source": "plugin", "counter": "unauthorized"}) == 1
    assert metrics.registry.get_sample_value(
        "stepline_source_counts_total", {"source": "plugin", "counter": "steps"}) == 1


def test_the_plugin_reads_the_token_as_the_collector_does(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    secret = tmp_path / "token"
    secret.write_text(f"{TOKEN}\n")
    assert token_from_env({}) is None
    assert token_from_env({"STEPLINE_PLUGIN_TOKEN": "direct", "STEPLINE_PLUGIN_TOKEN_FILE": str(secret)}) == "direct"
    assert token_from_env({"STEPLINE_PLUGIN_TOKEN_FILE": str(secret)}) == TOKEN
    assert Settings.from_env({"STEPLINE_PLUGIN_TOKEN_FILE": str(secret)}).plugin_token == TOKEN
    # A file the engine cannot read must not stop vLLM: no token, one clear line, and never the secret.
    unreadable = tmp_path / "missing"
    empty = tmp_path / "empty"
    empty.write_text("\n")
    with caplog.at_level(logging.ERROR, logger="stepline.plugin"):
        assert token_from_env({"STEPLINE_PLUGIN_TOKEN_FILE": str(unreadable)}) is None
        assert token_from_env({"STEPLINE_PLUGIN_TOKEN_FILE": str(empty)}) is None
    assert "cannot read STEPLINE_PLUGIN_TOKEN_FILE" in caplog.text and "is empty" in caplog.text
    assert TOKEN not in caplog.text


def test_the_simulator_sends_the_token_of_its_environment(sock_dir: str, monkeypatch: pytest.MonkeyPatch) -> None:
    receiver = _token_receiver(sock_dir, TOKEN)
    try:
        monkeypatch.setenv("STEPLINE_PLUGIN_TOKEN", TOKEN)
        from_env = Telemetry("sim-env", EngineConfig(), plugin_socket=receiver.socket_path)
        given = Telemetry("sim-given", EngineConfig(), plugin_socket=receiver.socket_path, plugin_token="wrong")
        from_env.close()
        given.close()
        rows = _poll(receiver)
    finally:
        receiver.stop()
    assert {r.engine for r in rows if isinstance(r, Event) and r.kind == "engine_config"} == {"sim-env"}
    assert receiver.stats()["unauthorized"] == 1


def test_a_batch_queued_engines_steps_last_from_step_end_to_step_end(receiver: PluginReceiver) -> None:
    """Async scheduling (vLLM 0.33's default on GPUs): vLLM's elapsed_ms is the core's wait for a launched step; the
    row's elapsed_ms is the time since the core's previous step ended, with vLLM's reading kept beside it."""
    core = PluginCore("prod-a", receiver.socket_path, batch_queue=True)
    for i, (offset, waited) in enumerate(((0.0, 3.0), (0.250, 241.0), (0.262, 0.1))):
        sched, it = _step_stats(7 + i)
        assert sched.iteration_details is not None
        sched.iteration_details.elapsed_ms = waited
        it.iteration_timestamp = NOW + offset
        core.record(sched, it)
    core.flush()
    steps = [r for r in _poll(receiver) if isinstance(r, Step)]
    assert [(s.step_time, s.vllm_elapsed_ms) for s in steps] == [("wait", 3.0), ("cadence", 241.0),
                                                                 ("cadence", pytest.approx(0.1))]
    assert [s.elapsed_ms for s in steps] == pytest.approx([3.0, 250.0, 12.0], abs=1e-3)
