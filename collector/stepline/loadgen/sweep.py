"""`stepline matrix --sweep NAME=V1,V2 --launch 'COMMAND ... {NAME}'`: one freshly launched engine per value.

For each value the command is split as a shell would (shlex) and the value replaces `{NAME}` in its words; it
starts in a process group of its own with its output in a log file. Once GET /health and /v1/models answer at
--engine, the matrix runs against it (or, with --replay, a replay of the recorded window, read from the store
once before the first launch); then the engine's own counters are read from its /metrics, and its group gets
SIGINT, then SIGKILL after STOP_GRACE_S. After the last value, one table holds every value's figures, with the
engine's counters beside what was sent: an engine that did not take a value shows it there, not only in a label.

With --replay and --repeat N, each value's engine replays the window N times in a row (each repeat with a shared
prefix of its own, so none finds an earlier one's in the prefix cache), the engine's counters read around each;
a second table gives each figure's mean over the N replays with its 95% confidence interval (Student's t): the
engine's own run-to-run noise, which any prediction of the value is to be read against.
"""

from __future__ import annotations

import contextlib
import os
import re
import shlex
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from stepline.core.stats import MEAN_CONFIDENCE, mean_interval
from stepline.loadgen import replay
from stepline.loadgen.client import Endpoint, MatrixError
from stepline.loadgen.matrix import MatrixResult
from stepline.loadgen.matrix import events as matrix_events
from stepline.model.rows import Event, micros

_POLL_S = 0.5
_TAIL_LINES = 3
_TAIL_CHARS = 400
COUNTERS = {"prompt_tokens": "vllm:prompt_tokens_total", "generation_tokens": "vllm:generation_tokens_total",
            "prefix_cache_hits": "vllm:prefix_cache_hits_total", "requests": "vllm:request_success_total"}
STOP_GRACE_S = 30.0  # a launched engine's time to stop on SIGINT before its process group is killed
INTERRUPTED = "interrupted (Ctrl-C)"  # the error of the value the user stopped the sweep at: not a failure

# How a value is measured once its engine answers (the matrix, or a replay of the recorded window): given the
# value's label and the repeat's index (from 0), it prints and returns what it measured.
Measure = Callable[[str, int], tuple[MatrixResult | None, replay.ReplayReport | None]]


class LaunchRefused(MatrixError):
    """What every value of the sweep would meet: the command cannot start, or something else answers at --engine."""


@dataclass(frozen=True, slots=True)
class EngineCounters:
    """The launched engine's own totals from its /metrics, summed over labels, read before it is stopped."""

    prompt_tokens: int
    generation_tokens: int
    prefix_cache_hits: int
    requests: int


@dataclass(frozen=True, slots=True)
class Repeat:
    """One replay of the recorded window on a value's engine, and the engine's counters' increase over it (None
    where its /metrics did not say)."""

    report: replay.ReplayReport
    counters: EngineCounters | None
    finished_ts: float


@dataclass(frozen=True, slots=True)
class SweepValue:
    """One value of the sweep: what measured it (the matrix, or its replays), the engine's counters at the end, or
    why it could not be measured."""

    label: str
    value: str
    log: Path
    matrix: MatrixResult | None = None
    replays: tuple[Repeat, ...] = ()
    counters: EngineCounters | None = None
    error: str = ""
    finished_ts: float = 0.0

    @property
    def failed(self) -> bool:
        """It was not measured, and not because the user stopped the sweep."""
        return bool(self.error) and self.error != INTERRUPTED

    @property
    def interrupted(self) -> bool:
        return self.error == INTERRUPTED or any(r.report.stopped_by == "interrupted" for r in self.replays)


def launch_words(command: str, name: str, value: str) -> list[str]:
    """The command's words with `value` in place of `{name}`; MatrixError when the command has no such place."""
    placeholder = "{" + name + "}"
    try:
        words = shlex.split(command)
    except ValueError as exc:
        raise MatrixError(f"--launch {command!r} does not split into words: {exc}") from None
    if not any(placeholder in word for word in words):
        raise MatrixError(f"--launch must hold {placeholder} where each --sweep value goes, e.g. "
                          f"'... --{name.replace('_', '-')} {placeholder}'")
    return [word.replace(placeholder, value) for word in words]


class LaunchedEngine:
    """An engine command running in a process group of its own, its output in `log`."""

    def __init__(self, words: list[str], log: Path) -> None:
        self.words = words
        self.log = log
        self._out: IO[bytes] = log.open("wb")
        try:
            self.process = subprocess.Popen(words, stdout=self._out, stderr=subprocess.STDOUT,
                                            stdin=subprocess.DEVNULL, start_new_session=True)
        except OSError as exc:
            self._out.close()
            raise LaunchRefused(f"cannot launch {shlex.join(words)[:200]}: {exc.strerror or exc}") from None

    def wait_healthy(self, endpoint: Endpoint, timeout_s: float, label: str) -> None:
        """Until /health and /v1/models answer; MatrixError when it exits first or takes over `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        while True:
            code = self.process.poll()
            if code is not None:
                raise MatrixError(f"{label}: the launched engine exited with code {code} before it answered at "
                                  f"{endpoint.url}; its log ends: {self.tail()} (all of it: {self.log})")
            if endpoint.healthy():
                return
            if time.monotonic() >= deadline:
                raise MatrixError(f"{label}: the launched engine did not answer /health and /v1/models at "
                                  f"{endpoint.url} within {timeout_s:g} s (--launch-timeout); its log ends: "
                                  f"{self.tail()} (all of it: {self.log})")
            time.sleep(_POLL_S)

    def tail(self) -> str:
        """The last few lines of its log, on one line."""
        try:
            with self.log.open("rb") as log:
                log.seek(max(0, self.log.stat().st_size - 8192))
                text = log.read().decode(errors="replace")
        except OSError:
            return "(unreadable)"
        lines = [" ".join(line.split()) for line in text.splitlines() if line.strip()]
        tail = " | ".join(lines[-_TAIL_LINES:])
        return ("..." + tail[-_TAIL_CHARS:] if len(tail) > _TAIL_CHARS else tail) or "(empty)"

    def stop(self, grace_s: float = STOP_GRACE_S) -> int:
        """SIGINT to its group; SIGKILL to what is left of it after `grace_s`. Returns the command's exit code."""
        group = self.process.pid
        if self.process.poll() is None or _group_alive(group):
            _signal_group(group, signal.SIGINT)
            deadline = time.monotonic() + grace_s
            while self.process.poll() is None or _group_alive(group):
                if time.monotonic() >= deadline:
                    _signal_group(group, signal.SIGKILL)
                    break
                time.sleep(0.1)
        code = self.process.wait()
        self._out.close()
        return code


def _signal_group(group: int, signum: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(group, signum)


def _group_alive(group: int) -> bool:
    """Whether a process of the group still runs (zombies not counted: nobody here may reap them)."""
    try:
        entries = os.listdir("/proc")
    except OSError:
        try:
            os.killpg(group, 0)
        except (ProcessLookupError, PermissionError):
            return False
        return True
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as stat:
                fields = stat.read().rsplit(b")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if len(fields) > 2 and int(fields[2]) == group and fields[0] != b"Z":
            return True
    return False


def increase(before: EngineCounters | None, after: EngineCounters | None) -> EngineCounters | None:
    """What the counters grew by between two reads; None when either read said nothing."""
    if before is None or after is None:
        return None
    return EngineCounters(*(getattr(after, k) - getattr(before, k) for k in COUNTERS))


def engine_counters(url: str, timeout_s: float = 5.0) -> EngineCounters | None:
    """The engine's token and request counters from its /metrics; None when it has none to give."""
    base = url.rstrip("/").removesuffix("/v1")
    try:
        with urllib.request.urlopen(f"{base}/metrics", timeout=timeout_s) as response:
            text = response.read().decode(errors="replace")
    except (OSError, ValueError):
        return None
    totals = dict.fromkeys(COUNTERS.values(), 0.0)
    seen = False
    for line in text.splitlines():
        name = re.split(r"[{ ]", line, maxsplit=1)[0]
        if name in totals:
            try:
                totals[name] += float(line.rsplit(" ", 1)[1])
                seen = True
            except (IndexError, ValueError):
                continue
    if not seen:
        return None
    return EngineCounters(*(round(totals[COUNTERS[field]]) for field in COUNTERS))


def launch_each(command: str, name: str, values: Sequence[str], url: str, measure: Measure,
                launch_timeout_s: float, repeat: int = 1) -> Iterator[SweepValue]:
    """Per value: launch `command` with it in place of `{name}`, measure the engine `repeat` times once it answers at
    `url`, stop it.

    Yields each value as it is done, its error set where it could not be measured; stops after a Ctrl-C. Raises
    LaunchRefused when no value could be: the command cannot start, or something else already answers at `url`."""
    if repeat < 1:
        raise MatrixError(f"--repeat must be at least 1, got {repeat}")
    logs = Path(tempfile.mkdtemp(prefix="stepline-sweep-"))
    for value in values:
        label = f"{name}={value}"
        log = logs / f"{re.sub(r'[^A-Za-z0-9._-]', '_', label)}.log"
        try:
            done = _one_value(launch_words(command, name, value), url, label, value, log, measure, launch_timeout_s,
                              repeat)
        except LaunchRefused:
            raise  # every value would meet it
        except MatrixError as exc:
            print(f"stepline matrix: {exc}", file=sys.stderr, flush=True)
            done = SweepValue(label, value, log, error=str(exc))
        except KeyboardInterrupt:
            yield SweepValue(label, value, log, error=INTERRUPTED)
            return
        yield done
        if done.interrupted:
            return


def _one_value(words: list[str], url: str, label: str, value: str, log: Path, measure: Measure,
               launch_timeout_s: float, repeat: int) -> SweepValue:
    if Endpoint(url, 2.0).healthy():
        raise LaunchRefused(f"something already answers at {url}: stop it first (each --sweep value must be measured "
                          "on the engine launched for it)")
    print(f"stepline matrix: {label}: launching {shlex.join(words)[:300]}", flush=True)
    engine = LaunchedEngine(words, log)
    try:
        engine.wait_healthy(Endpoint(url, 2.0), launch_timeout_s, label)
        matrix: MatrixResult | None = None
        replays: list[Repeat] = []
        # The engine was launched for this value: before the first measure it has served nothing, whether or not
        # its /metrics lists the counters yet.
        before: EngineCounters | None = engine_counters(url) or EngineCounters(0, 0, 0, 0)
        after = before
        for k in range(repeat):
            result, report = measure(label if repeat == 1 else f"{label} (run {k + 1} of {repeat})", k)
            after = engine_counters(url)
            matrix = matrix or result
            if report is not None:
                replays.append(Repeat(report, increase(before, after), time.time()))
                if report.stopped_by == "interrupted":
                    break
            before = after
        # The last read, right after the last measure, is the value's counters.
        return SweepValue(label, value, log, matrix, tuple(replays), after, finished_ts=time.time())
    finally:
        code = engine.stop()
        print(f"stepline matrix: {label}: the engine stopped (exit code {code}); its log: {log}", flush=True)


def sweep_events(values: list[SweepValue], engine: str, host: str) -> list[Event]:
    """matrix_run events for the matrix's runs, one replay_run event per replayed value."""
    rows: list[Event] = []
    for value in values:
        if value.matrix is not None:
            rows.extend(matrix_events(value.matrix, engine, host))
        rows.extend(replay_event(value, k, engine, host) for k in range(len(value.replays)))
    return rows


def replay_event(value: SweepValue, k: int, engine: str, host: str) -> Event:
    """The value's k-th replay, and the engine's counters' increase over it, as one `replay_run` event's
    attributes."""
    run = value.replays[k]
    report = run.report
    attributes = {"sweep": value.label, "run": f"{k + 1}/{len(value.replays)}",
                  **{key: "" if v is None else str(v) for key, v in report.as_dict().items()}}
    if run.counters is not None:
        attributes.update({f"engine_{key}": str(getattr(run.counters, key)) for key in COUNTERS})
    runs = f" (run {k + 1} of {len(value.replays)})" if len(value.replays) > 1 else ""
    message = (f"replay {value.label}{runs}: {report.completed}/{report.planned} completed, TTFT p99 "
               f"{report.ttft_p99_s * 1e3:.1f} ms, ITL p50/p99 {report.itl_p50_s * 1e3:.1f}/"
               f"{report.itl_p99_s * 1e3:.1f} ms")
    return Event(micros(run.finished_ts), host, engine, "matrix", "replay_run", "info", message, attributes)


def render_sweep(values: list[SweepValue], name: str) -> str:
    """One table of every value's figures, milliseconds, client-side; the engine's own counters beside them."""
    width = max(8, *(len(v.value) + 6 for v in values))
    lines = [f"sweep of {name}: one engine launched per value; milliseconds, client-side"]
    replayed = any(v.replays for v in values)
    if replayed:
        lines.append(f"{'value':<{width}}{'sent':>6}{'done':>6}{'failed':>7}{'TTFT p50':>10}{'p99':>8}"
                     f"{'ITL p50':>9}{'p99':>8}{'prompt sent/engine':>21}{'output got/engine':>20}"
                     f"{'prefix hits':>13}{'s':>7}")
    else:
        lines.append(f"{'value':<{width}}{'run':<27}{'TTFT p50':>10}{'p99':>8}{'ITL p50':>9}{'p99':>8}{'worst':>8}"
                     f"{'engine prompt/output tokens':>29}")
    for v in values:
        if v.error:
            lines.append(f"{v.value:<{width}}not measured: {v.error[:160]}")
        elif v.replays:
            for k, repeated in enumerate(v.replays):
                r, c = repeated.report, repeated.counters
                shown = v.value if len(v.replays) == 1 else f"{v.value} #{k + 1}"
                prompt = f"{r.prompt_tokens_sent + r.warmup_prompt_tokens}/{c.prompt_tokens if c else '?'}"
                output = f"{r.generation_tokens_received}/{c.generation_tokens if c else '?'}"
                lines.append(f"{shown:<{width}}{r.sent:>6}{r.completed:>6}{r.failed:>7}"
                             f"{r.ttft_p50_s * 1e3:>10.1f}{r.ttft_p99_s * 1e3:>8.1f}{r.itl_p50_s * 1e3:>9.1f}"
                             f"{r.itl_p99_s * 1e3:>8.1f}{prompt:>21}{output:>20}"
                             f"{c.prefix_cache_hits if c else '?':>13}{r.duration_s:>7.1f}")
        elif v.matrix is not None:
            c = v.counters
            counted = f"{c.prompt_tokens}/{c.generation_tokens}" if c else "?"
            for i, run in enumerate(v.matrix.runs):
                lines.append(f"{v.value if i == 0 else '':<{width}}{run.key + ' ' + run.label:<27}"
                             f"{run.ttft_p50 * 1e3:>10.1f}{run.ttft_p99 * 1e3:>8.1f}{run.itl_p50 * 1e3:>9.1f}"
                             f"{run.itl_p99 * 1e3:>8.1f}{run.worst_gap * 1e3:>8.1f}{counted if i == 0 else '':>29}")
    if replayed:
        lines.append("prompt sent includes the warm-up request (the longest shared prefix); 'engine' columns are "
                     "the engine's own vllm:prompt_tokens_total, generation_tokens_total and prefix_cache_hits_total "
                     "(their increase over each run)")
    if any(len(v.replays) > 1 for v in values):
        lines += ["", render_means(values, width)]
    return "\n".join(lines)


# The client-side figures a repeated replay gives a mean and an interval for: (ReplayReport field, heading).
REPEATED_FIGURES = (("ttft_p50_s", "TTFT p50"), ("ttft_p99_s", "TTFT p99"), ("itl_p50_s", "ITL p50"),
                    ("itl_p99_s", "ITL p99"))


def render_means(values: Sequence[SweepValue], width: int) -> str:
    """Each replayed value's figures as mean [low-high] over its runs, the 95% interval of the mean."""
    cell = 24
    lines = [f"mean [{MEAN_CONFIDENCE:.0%} confidence interval of the mean, Student's t] over each value's runs; "
             "milliseconds, client-side",
             f"{'value':<{width}}{'runs':>5}  " + "".join(f"{heading:<{cell}}" for _, heading in REPEATED_FIGURES)]
    for v in values:
        if not v.replays or v.error:
            continue
        cells = []
        for field_name, _ in REPEATED_FIGURES:
            m = mean_interval([getattr(r.report, field_name) * 1e3 for r in v.replays if r.report.completed], 0.0)
            cells.append(f"{m.mean:.1f}" + (f" [{m.low:.1f}-{m.high:.1f}]" if m.n > 1 else ""))
        lines.append(f"{v.value:<{width}}{len(v.replays):>5}  " + "".join(f"{c:<{cell}}" for c in cells))
    return "\n".join(lines)
