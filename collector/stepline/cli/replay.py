"""`stepline replay`: send a recorded window's request shape to an engine, at its arrival times, and report."""

from __future__ import annotations

import argparse
import dataclasses
import json
import signal
import sys
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from types import FrameType
from typing import TYPE_CHECKING

from stepline.config.settings import split_named_url

if TYPE_CHECKING:
    from stepline.diagnosis.findings import Window
    from stepline.loadgen.replay import Recorded, ReplayReport

HELP = "send a recorded window's request shape to an engine, at its arrival times"
DESCRIPTION = ("Read a window's finished requests from the store and send the same shape to any OpenAI-compatible "
               "streaming endpoint: the same arrival offsets (divided by --speed), prompt and output lengths in "
               "tokens, and prefix-cache hits made to recur through shared token-id prefixes. Prints what was sent "
               "and what came back: requests completed and failed, tokens, client-side TTFT and ITL p50/p99.")
DEFAULT_SINCE = "30m"


def add_replay_arguments(parser: argparse._ActionsContainer) -> None:
    """The window and pacing options, shared by `stepline replay` and `stepline matrix --replay`."""
    from stepline.loadgen.replay import DEFAULT_MAX_REQUESTS, DEFAULT_MAX_SECONDS, DEFAULT_VOCAB

    parser.add_argument("--since", default=DEFAULT_SINCE, metavar="DURATION",
                        help=f"replay the requests that arrived this far back (90s, 30m, 2h, 1d; default "
                             f"{DEFAULT_SINCE})")
    parser.add_argument("--from", dest="from_", metavar="T",
                        help="window start (ISO 8601, epoch, HH:MM[:SS] UTC)")
    parser.add_argument("--to", metavar="T", help="window end (default now)")
    parser.add_argument("--source-engine", default="", metavar="E",
                        help="only the requests recorded on this engine (default: every engine)")
    parser.add_argument("--speed", type=float, default=1.0,
                        help="divide the recorded arrival offsets by this (2: twice as fast; default 1)")
    parser.add_argument("--max-requests", type=int, default=DEFAULT_MAX_REQUESTS, metavar="N",
                        help="send at most the first N requests (default %(default)s)")
    parser.add_argument("--max-seconds", type=float, default=DEFAULT_MAX_SECONDS, metavar="S",
                        help="stop after S seconds, abandoning streams still in flight (default %(default)g)")
    parser.add_argument("--vocab", type=int, default=DEFAULT_VOCAB, metavar="N",
                        help="prompt token ids are drawn from [0, N): at most the model's vocabulary "
                             "(default %(default)s)")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the `stepline replay` options to `parser`."""
    from stepline.loadgen.replay import DEFAULT_TIMEOUT_S

    parser.add_argument("--engine", required=True, metavar="[NAME=]URL",
                        help="OpenAI-compatible server to replay against, e.g. http://127.0.0.1:8000")
    add_replay_arguments(parser)
    parser.add_argument("--store", help="store URL the window is read from (default: $STEPLINE_STORE, else "
                                        "./stepline-data when it exists, else the running collector's store)")
    parser.add_argument("--model", help="model to ask for (default: the first one /v1/models lists)")
    parser.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S, dest="timeout_s", metavar="SECONDS",
                        help="longest wait for any answer or token of one request (default: %(default)g)")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")


def window_of(args: argparse.Namespace) -> Window:
    """The recorded window the arguments of add_replay_arguments name; UsageError when it does not run forward."""
    from stepline.analysis.window import window_from

    return window_from(args.since, args.from_, args.to, args.source_engine)


def replay_window(args: argparse.Namespace, url: str, recorded: Sequence[Recorded], window: Window,
                  stop: threading.Event | None = None, repeat: int = 0) -> ReplayReport:
    """Replay `recorded` against `url` as add_replay_arguments, --model and --timeout say; `repeat` > 0 draws its
    shared prefix anew, so that it finds nothing of the earlier repeats in the engine's prefix cache."""
    from stepline.loadgen import replay

    return replay.replay_window(url, recorded, window, speed=args.speed, vocab=args.vocab,
                                max_requests=args.max_requests, max_seconds=args.max_seconds,
                                timeout_s=args.timeout_s, model=args.model, stop=stop,
                                corpus_seed=replay.repeat_corpus_seed(repeat))


@contextmanager
def ctrl_c_stops(stop: threading.Event) -> Iterator[None]:
    """While the block runs, Ctrl-C sets `stop` (the replay sends nothing more, abandons its streams and reports);
    a second Ctrl-C interrupts at once. Only an event is set, where a KeyboardInterrupt would be raised wherever the
    main thread happens to be (inside an HTTP read, a thread's start): the replay then stops at its next poll."""
    def on_sigint(signum: int, frame: FrameType | None) -> None:
        if stop.is_set():
            raise KeyboardInterrupt
        stop.set()

    previous = signal.signal(signal.SIGINT, on_sigint)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def run(args: argparse.Namespace) -> int:
    """Replay and print the report: 0 when every request completed, 1 when some failed, 130 on Ctrl-C, 2 when the
    store, the window or the engine cannot be used."""
    from stepline.core.usageerror import UsageError
    from stepline.loadgen.client import Endpoint, MatrixError
    from stepline.loadgen.replay import load_window, render
    from stepline.store.errors import StoreError
    from stepline.store.url import StoreUrlError

    url = split_named_url(args.engine)[1]
    try:
        Endpoint(url, 1.0)  # a malformed URL is refused before the store is read
        window = window_of(args)
        recorded = load_window(args.store, window)
        stop = threading.Event()
        with ctrl_c_stops(stop):
            report = replay_window(args, url, recorded, window, stop=stop)
        if stop.is_set():
            report = dataclasses.replace(report, stopped_by="interrupted")
    except (MatrixError, StoreError, StoreUrlError, UsageError) as exc:
        print(f"stepline replay: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(report.as_dict(), indent=2) if args.json else render(report), flush=True)
    if report.stopped_by == "interrupted":
        return 130
    return 1 if report.failed else 0
