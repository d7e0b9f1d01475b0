"""`stepline matrix`: the interference test (decode-only, + an uncached long prompt, + the same prompt cached), once
or per --sweep value, on an engine that runs or on one launched per value (--launch)."""

from __future__ import annotations

import argparse
import socket
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING

from stepline.cli.replay import add_replay_arguments, replay_window, window_of
from stepline.config.settings import split_named_url
from stepline.config.slo import Slo

MATRIX_REPEAT = 3  # --repeat's default for the matrix: each run three times
REPLAY_REPEAT = 1  # and for a launched sweep's replays: once a value

if TYPE_CHECKING:
    from stepline.diagnosis.findings import Window
    from stepline.loadgen.matrix import MatrixResult
    from stepline.loadgen.replay import Recorded, ReplayReport
    from stepline.loadgen.sweep import Measure
    from stepline.model.rows import Event
    from stepline.whatif.core import WhatIf
    from stepline.whatif.figures import Objectives
    from stepline.whatif.levers import Lever

HELP = "interference test: decode-only vs + long uncached prompt vs + cached prompt"
DESCRIPTION = ("Against any OpenAI-compatible streaming endpoint: N decode-only streams; the same plus one long "
               "uncached prompt; the same with that prompt cached. Every token is timestamped on the client; TTFT "
               "and ITL p50/p95/p99 and the worst gap per run, with deltas. Results also go to the store as "
               "matrix_run events. With --sweep NAME=V1,V2 --launch 'COMMAND ... {NAME}' it starts the engine with "
               "each value, measures it (the matrix, or --replay of a recorded window), stops it, and prints one "
               "table.")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the `stepline matrix` options to `parser`."""
    from stepline.loadgen.client import DEFAULT_LONG_PROMPT_TOKENS
    from stepline.loadgen.sweep import STOP_GRACE_S

    parser.add_argument("--engine", required=True, metavar="[NAME=]URL",
                        help="OpenAI-compatible server, e.g. http://127.0.0.1:8000 (NAME labels the stored events; "
                             "default host:port)")
    parser.add_argument("--model", help="model to ask for (default: the first one /v1/models lists)")
    parser.add_argument("--streams", type=int, default=8, help="decode-only streams per run (default: %(default)s)")
    parser.add_argument("--prompt-tokens", type=int, default=64,
                        help="prompt of each decode stream, in tokens (default: %(default)s)")
    parser.add_argument("--max-tokens", type=int, default=256,
                        help="tokens each decode stream generates (default: %(default)s)")
    parser.add_argument("--long-prompt-tokens", type=int,
                        help="the long prompt, in tokens: about one token per word of generated text (default: "
                             f"{DEFAULT_LONG_PROMPT_TOKENS}; always cut to fit the model's max_model_len as "
                             "/v1/models reports it, with room for its output)")
    parser.add_argument("--repeat", type=int, metavar="N",
                        help=f"times each run of the matrix is repeated (default: {MATRIX_REPEAT}); with --replay, "
                             f"times each launched engine replays the window, for a mean and its 95%% confidence "
                             f"interval per figure (default: {REPLAY_REPEAT})")
    parser.add_argument("--timeout", type=float, default=300.0, dest="timeout_s", metavar="SECONDS",
                        help="longest wait for any answer or token (default: %(default)s)")
    parser.add_argument("--sweep", metavar="NAME=V1,V2",
                        help="run once per value: with --launch, each value on an engine started for it; without, "
                             "the value only labels the runs and you restart the engine with each when asked")
    parser.add_argument("--store", help="store URL for the matrix_run events (default: $STEPLINE_STORE, else "
                                        "./stepline-data when it exists, else the running collector's store); "
                                        "when a running collector holds it, the events go through that collector")
    parser.add_argument("--collector", metavar="URL",
                        help="hand the events to the collector whose events endpoint is at URL (`stepline collect` "
                             "logs it; the token is the collector's $STEPLINE_OTLP_TOKEN, read from the same "
                             "variable here) instead of finding it through its runtime file")
    parser.add_argument("--no-store", action="store_true", help="only print the results")
    launch = parser.add_argument_group("launching the engine per --sweep value")
    launch.add_argument("--launch", metavar="COMMAND",
                        help="the engine's command line, with {NAME} (the --sweep name in braces) where each value "
                             "goes, e.g. '... --max-num-batched-tokens {max_num_batched_tokens}'; it must serve at "
                             "--engine; started in a process group of its own, stopped with SIGINT (SIGKILL after "
                             f"{STOP_GRACE_S:g} s) once measured")
    launch.add_argument("--launch-timeout", type=float, default=600.0, metavar="SECONDS",
                        help="longest wait for the launched engine's /health and /v1/models (default: %(default)g)")
    launch.add_argument("--replay", action="store_true",
                        help="measure each value with a `stepline replay` of the recorded window (the options "
                             "below; read from --store once) instead of the matrix")
    launch.add_argument("--whatif", action="store_true",
                        help="with --replay: before the launches, price each value with `stepline whatif` over the "
                             "recorded window, and after them print each figure's predicted interval beside the "
                             "runs' mean and confidence interval (needs --speed 1: whatif predicts the recorded "
                             "pace)")
    slo = Slo()
    launch.add_argument("--ttft", type=float, default=slo.ttft_p99_seconds, metavar="SECONDS",
                        help="--whatif's goodput objective: time to first token (default: %(default)g)")
    launch.add_argument("--tpot", type=float, default=slo.tpot_seconds, metavar="SECONDS",
                        help="--whatif's goodput objective: time per output token (default: %(default)g)")
    add_replay_arguments(launch)


def parse_sweep(spec: str) -> tuple[str, list[str]]:
    """--sweep NAME=V1,V2,... as (NAME, [V1, V2, ...]); MatrixError otherwise."""
    from stepline.loadgen.client import MatrixError

    name, sep, values = spec.partition("=")
    listed = [v.strip() for v in values.split(",") if v.strip()]
    if not (name.strip() and sep and listed):
        raise MatrixError(f"--sweep {spec!r} must be NAME=V1,V2,...")
    return name.strip(), listed


def sweep_labels(spec: str | None) -> list[str | None]:
    """The label of each run of the matrix: NAME=V per --sweep value, or one unlabelled run."""
    if spec is None:
        return [None]
    name, values = parse_sweep(spec)
    return [f"{name}={value}" for value in values]


def run(args: argparse.Namespace) -> int:
    """Run the matrix, print it and store it; 0 on success, 2 when the engine or the store cannot be used."""
    from stepline.loadgen.client import Endpoint, MatrixError
    from stepline.loadgen.matrix import events

    if args.launch or args.replay:
        return _launched(args)
    name, url = split_named_url(args.engine)
    try:
        labels = sweep_labels(args.sweep)
        results: list[MatrixResult] = []
        for i, label in enumerate(labels):
            if label is not None:
                if i and not _ask(f"restart the engine with {label}, then press Enter (Ctrl-D stops the sweep)"):
                    break
                print(f"stepline matrix: {label} (the engine must already run with it)", flush=True)
            results.append(_matrix(args, url, label))
    except MatrixError as exc:
        print(f"stepline matrix: {exc}", file=sys.stderr)
        return 2
    if args.no_store or not results:
        return 0
    engine = name or Endpoint(url, 1.0).host_port
    return _store([row for result in results for row in events(result, engine, socket.gethostname())], args)


def _launched(args: argparse.Namespace) -> int:
    """The launched sweep: 0 when every value was measured, 2 when one could not be (or the results not stored)."""
    from stepline.core.usageerror import UsageError
    from stepline.loadgen import sweep
    from stepline.loadgen.client import Endpoint, MatrixError
    from stepline.loadgen.replay import load_window
    from stepline.store.errors import StoreError
    from stepline.store.url import StoreUrlError

    url = split_named_url(args.engine)[1]
    values: list[sweep.SweepValue] = []
    failed = False
    try:
        if not args.launch:
            raise MatrixError("--replay runs with --sweep NAME=V1,V2 --launch COMMAND; against an engine that "
                              "already runs, use `stepline replay`")
        if not args.sweep:
            raise MatrixError("--launch needs --sweep NAME=V1,V2,...: the values to launch the engine with")
        name, settings = parse_sweep(args.sweep)
        sweep.launch_words(args.launch, name, settings[0])
        Endpoint(url, 1.0)
        levers = _whatif_levers(args, name, settings) if args.whatif else []
        objectives = _objectives(args) if args.whatif else None
        predicted: WhatIf | None = None
        if args.replay:
            window = window_of(args)
            recorded = load_window(args.store, window)
            if objectives is not None:
                predicted = _predict(args, window, name, levers, objectives)
            measure = _replay_measure(args, url, recorded, window)
        else:
            measure = _matrix_measure(args, url)
        repeat = (args.repeat or REPLAY_REPEAT) if args.replay else 1
        for value in sweep.launch_each(args.launch, name, settings, url, measure, args.launch_timeout, repeat):
            values.append(value)  # one at a time: the values measured stay in the table when a later one raises
    except (MatrixError, StoreError, StoreUrlError, UsageError) as exc:
        print(f"stepline matrix: {exc}", file=sys.stderr)
        if not values:
            return 2
        failed = True
    if values:
        print(sweep.render_sweep(values, name), flush=True)
    if predicted is not None and objectives is not None and values:
        from stepline.whatif.checked import checks, recorded_again, render_checks

        found = checks(predicted, values, objectives)
        print("\n" + render_checks(found, predicted), flush=True)
        again = recorded_again(predicted, found, name)
        if again:
            print(again, flush=True)
    measured = [v for v in values if not v.error]
    if measured and not args.no_store:
        engine = split_named_url(args.engine)[0] or Endpoint(url, 1.0).host_port
        if _store(sweep.sweep_events(measured, engine, socket.gethostname()), args):
            failed = True
    return 2 if failed or any(v.failed for v in values) else 0


def _objectives(args: argparse.Namespace) -> Objectives:
    from stepline.core.usageerror import UsageError
    from stepline.whatif.figures import Objectives

    if not (args.ttft > 0 and args.tpot > 0):
        raise UsageError(f"--ttft and --tpot must be positive, got {args.ttft} and {args.tpot}")
    return Objectives(args.ttft, args.tpot)


def _whatif_levers(args: argparse.Namespace, name: str, settings: Sequence[str]) -> list[Lever]:
    """--whatif's lever per value, once the options allow it; MatrixError otherwise."""
    from stepline.loadgen.client import MatrixError
    from stepline.whatif.checked import sweep_levers

    if not args.replay:
        raise MatrixError("--whatif checks its prediction against --replay runs of the recorded window: add "
                          "--replay")
    if args.speed != 1:
        raise MatrixError(f"--whatif predicts the window at its recorded pace: run it with --speed 1, not "
                          f"{args.speed:g}")
    return sweep_levers(name, settings)


def _predict(args: argparse.Namespace, window: Window, name: str, levers: Sequence[Lever],
             objectives: Objectives) -> WhatIf:
    """whatif's price of each value over the recorded window, printed; MatrixError where it cannot price them."""
    from stepline.loadgen.client import MatrixError
    from stepline.store.reader import open_located
    from stepline.whatif.checked import render_predicted
    from stepline.whatif.core import WhatIfError, whatif
    from stepline.whatif.trace import load

    reader, _ = open_located(args.store)
    try:
        traces = load(reader.client, window)
    finally:
        reader.close()
    try:
        result = whatif(traces, objectives, levers=levers)
    except WhatIfError as exc:
        raise MatrixError(f"--whatif: {exc}") from None
    print(render_predicted(result, name), flush=True)
    return result


def _matrix(args: argparse.Namespace, url: str, label: str | None) -> MatrixResult:
    """One matrix run as the options say, printed; `label` names the --sweep value it measures."""
    from stepline.loadgen.matrix import render, run_matrix

    result = run_matrix(url, streams=args.streams, prompt_tokens=args.prompt_tokens, max_tokens=args.max_tokens,
                        long_prompt_tokens=args.long_prompt_tokens, repeat=args.repeat or MATRIX_REPEAT,
                        timeout_s=args.timeout_s,
                        model=args.model, sweep=label)
    print(render(result), flush=True)
    return result


def _matrix_measure(args: argparse.Namespace, url: str) -> Measure:
    def measure(label: str, repeat: int) -> tuple[MatrixResult | None, ReplayReport | None]:
        return _matrix(args, url, label), None

    return measure


def _replay_measure(args: argparse.Namespace, url: str, recorded: Sequence[Recorded], window: Window) -> Measure:
    from stepline.loadgen.replay import render

    def measure(label: str, repeat: int) -> tuple[MatrixResult | None, ReplayReport | None]:
        report = replay_window(args, url, recorded, window, repeat=repeat)
        print(f"{label}:\n{render(report)}", flush=True)
        return None, report

    return measure


def _store(rows: Sequence[Event], args: argparse.Namespace) -> int:
    """Deliver the events (loadgen.matrix.deliver) and say where they went; 2 when they could not be stored."""
    from stepline.endpoints.events import EventsRefused
    from stepline.loadgen.matrix import deliver
    from stepline.store.errors import StoreError, StoreLocked
    from stepline.store.url import StoreUrlError

    try:
        print(f"stepline matrix: {deliver(rows, args.store, args.collector)}")
    except StoreLocked:
        print("stepline matrix: not stored: the embedded store is held by a running collector that announced no "
              "events endpoint (no runtime file of it here, or an older stepline): --collector URL sends them "
              "through it (the collector still records the timeline)", file=sys.stderr)
    except (StoreError, StoreUrlError, EventsRefused) as exc:
        print(f"stepline matrix: not stored: {exc}", file=sys.stderr)
        return 2
    return 0


def _ask(prompt: str) -> bool:
    print(prompt, flush=True)
    try:
        return bool(sys.stdin.readline())
    except KeyboardInterrupt:
        return False
