"""`stepline whatif` against the real vLLM engine (its CPU build, the tiny model of tests/realvllm).

    python benchmarks/whatif_real_vllm.py [--seconds 60] [--values 512,2048] [--threshold 256]
    python benchmarks/whatif_real_vllm.py --sweep-repeat 3 [--seconds 40] [--values 512,1024,2048]

Records a load under `--max-num-batched-tokens 1024` through the real plugin, OTLP and /metrics into the store:
1,500-token chat requests twice a second (half with 1,024 tokens of a cached prefix) and three long uncached
prompts among them. Runs `whatif` on it for max_num_batched_tokens 512 and 2048 and long_prefill_token_threshold
256; then launches the engine with each of those settings (and 1024 again: the run-to-run noise) and replays the
recorded window against it with `stepline replay`'s own code, recorded by the same collector. Prints the
predicted and the measured TTFT p50/p99, ITL p99 and goodput with the error, whether the ranking matches, and
the noise floor. Goodput's objectives are twice the recording's own TTFT and TPOT medians. Target: within 30%,
same ranking. Run it on a quiet machine: the engine shares the CPU with everything else. Exits 0: a report.

With `--sweep-repeat N` the same recording is checked the way an operator would, through the CLI: `stepline matrix
--sweep max_num_batched_tokens=VALUES --launch ... --replay --speed 1 --repeat N --whatif` (the recorded settings,
1024, among the values: the noise floor), which prices each value with whatif, launches vLLM with it, replays the
window N times on it and prints each figure's mean and 95% interval beside whatif's interval.
"""

from __future__ import annotations

import argparse
import shlex
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from stepline.core.texttable import render_table
from stepline.diagnosis.findings import Window
from stepline.loadgen.client import Endpoint
from stepline.loadgen.replay import Recorded, plan, replay
from stepline.store.reader import open_reader
from stepline.whatif.core import recorded_figures, whatif
from stepline.whatif.figures import Figures, Objectives, quantile
from stepline.whatif.levers import Lever
from stepline.whatif.trace import EngineTrace, load
from tests.realvllm import harness

TOLERANCE = 0.30
WARM_UP_S = 10.0
FIGURES = (("ttft_p50_s", "TTFT p50"), ("ttft_p99_s", "TTFT p99"), ("itl_p99_s", "ITL p99"),
           ("goodput_rps", "goodput"))


def load_shape(seconds: float, long_tokens: int) -> list[Recorded]:
    """The load as a recorded window, so `replay` sends it: exact token counts, cache hits where asked."""
    out = []
    t0 = 1_000_000.0
    for i in range(int(seconds * 2)):
        out.append(Recorded("load", f"chat-{i}", t0 + i * 0.5, 1500, 1024 if i % 2 else 0, 48, "length"))
    for k, at in enumerate((seconds * 0.2, seconds * 0.5, seconds * 0.75)):
        out.append(Recorded("load", f"long-{k}", t0 + at, long_tokens, 0, 16, "length"))
    return out


@contextmanager
def engine(setup: harness.Setup, args: Sequence[str]) -> Iterator[None]:
    with harness.engine(setup, extra_args=args):
        yield


def send(setup: harness.Setup, recorded: Sequence[Recorded]) -> tuple[datetime, datetime]:
    """Replay `recorded` against the running engine; the UTC window its requests arrived in."""
    the_plan = plan(recorded, vocab=256)  # the tiny model learned fewer than 1,000 tokens; 256 bytes it has
    started = datetime.now(UTC)
    report = replay(Endpoint(setup.engine_url, 300.0), the_plan, model=harness.SERVED_NAME, max_seconds=600)
    if report.failed:
        raise RuntimeError(f"{report.failed} requests failed: {report.first_error}")
    return started + timedelta(seconds=0.05), datetime.now(UTC)


def traces_of(setup: harness.Setup, window: tuple[datetime, datetime]) -> list[EngineTrace]:
    time.sleep(4)  # the plugin's last steps and the spans reach the store
    reader = open_reader(setup.store)
    try:
        traces = load(reader.client, Window(window[0], window[1] + timedelta(seconds=1), harness.SERVED_NAME))
    finally:
        reader.close()
    # The replay's warm-up request (the shared prefix, one token out) is not part of the load.
    return [replace(t, requests=[r for r in t.requests if r.generation_tokens > 1]) for t in traces]


def as_recorded(traces: Sequence[EngineTrace]) -> list[Recorded]:
    return [Recorded(t.engine, r.request_id, r.arrival, r.prompt_tokens, r.cached_tokens, r.generation_tokens,
                     r.finish_reason) for t in traces for r in t.requests]


def _better(attr: str, f: Figures) -> float:
    """Sort key, best first: goodput higher, latencies lower."""
    return -f.goodput_rps if attr == "goodput_rps" else float(getattr(f, attr))


def _err(p: float, a: float) -> float:
    return p / a - 1.0 if a else (0.0 if p == 0 else float("inf"))


def sweep_check(setup: harness.Setup, window: tuple[datetime, datetime], objectives: Objectives,
                args: argparse.Namespace) -> int:
    """The recording checked through `stepline matrix --sweep ... --repeat N --whatif`, its output printed."""
    time.sleep(4)  # the last reports reach the store
    command = shlex.join(harness.engine_command(setup, budget="{max_num_batched_tokens}", collected=False))
    started = time.monotonic()
    out = harness.stepline(setup, "matrix", "--engine", setup.engine_url, "--sweep",
                           f"max_num_batched_tokens={args.values}", "--launch", command, "--launch-timeout", "300",
                           "--replay", "--from", f"{window[0].timestamp():.3f}", "--to",
                           f"{window[1].timestamp():.3f}", "--vocab", "256", "--speed", "1",
                           "--repeat", str(args.sweep_repeat), "--whatif", "--ttft", f"{objectives.ttft_s:.4f}",
                           "--tpot", f"{objectives.tpot_s:.4f}", "--store", setup.store, "--no-store",
                           timeout_s=3600, env=harness.engine_env(setup))
    print(out.stdout)
    print(out.stderr[-3000:], file=sys.stderr)
    print(f"matrix exit code {out.returncode} in {time.monotonic() - started:.0f} s; objectives TTFT "
          f"{objectives.ttft_s * 1e3:.1f} ms, TPOT {objectives.tpot_s * 1e3:.2f} ms")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=40.0)
    parser.add_argument("--long-tokens", type=int, default=12_000)
    parser.add_argument("--values", default="512,2048")
    parser.add_argument("--threshold", type=int, default=256)
    parser.add_argument("--sweep-repeat", type=int, default=0, metavar="N",
                        help="check whatif through `stepline matrix --sweep ... --repeat N --whatif` instead")
    args = parser.parse_args()
    venv = harness.install()
    values = [int(v) for v in args.values.split(",")]
    with tempfile.TemporaryDirectory(prefix="stepline-whatif-vllm-") as directory:
        work = Path(directory)
        setup = harness.Setup(work, venv, harness.build_model(venv, work / "model"))
        runs: dict[str, tuple[datetime, datetime]] = {}
        # Every engine serves WARM_UP_S of the same load before the window that counts: what is measured is a
        # warm engine, as an operator's recording is.
        warm_up = load_shape(WARM_UP_S, args.long_tokens)[: int(WARM_UP_S * 2)]
        with harness.collector(setup):
            with engine(setup, ["--max-num-batched-tokens", "1024"]):
                send(setup, warm_up)
                recorded_window = send(setup, load_shape(args.seconds, args.long_tokens))
            base = traces_of(setup, recorded_window)
            ttfts = sorted(r.ttft_s for t in base for r in t.requests)
            tpots = sorted(r.decode_s / (r.generation_tokens - 1) for t in base for r in t.requests
                           if r.generation_tokens > 1)
            # Twice the recording's own medians: objectives at a percentile of the recording itself would put
            # half the requests on a knife edge that the engine's run-to-run noise alone tips either way.
            objectives = Objectives(2 * quantile(ttfts, 0.5), 2 * quantile(tpots, 0.5))
            if args.sweep_repeat:
                return sweep_check(setup, recorded_window, objectives, args)
            levers = [Lever(f"max_num_batched_tokens={v}", "max_num_batched_tokens", {"max_num_batched_tokens": v})
                      for v in values]
            levers.append(Lever(f"long_prefill_token_threshold={args.threshold}", "long_prefill_token_threshold",
                                {"long_prefill_token_threshold": args.threshold}))
            levers.append(Lever("max_num_batched_tokens=1024 (again)", "max_num_batched_tokens", {}))
            started = time.monotonic()
            result = whatif(base, objectives, levers=levers)
            print(f"whatif in {time.monotonic() - started:.1f} s; objectives TTFT {objectives.ttft_s:.3f} s, "
                  f"TPOT {objectives.tpot_s * 1e3:.1f} ms")
            for name, f in result.fits.items():
                print(f"fit {name}: {f.describe()}; held-out median {f.median_error:.1%}, p90 {f.p90_error:.1%}, "
                      f"total {f.total_error:+.1%}")
            print("calibration: " + ", ".join(f"{k} {v:+.1%}" for k, v in result.calibration_errors.items()))
            shape = as_recorded(base)
            flags = {lv.name: (["--max-num-batched-tokens", str(lv.settings.get("max_num_batched_tokens", 1024))]
                               + (["--long-prefill-token-threshold", str(args.threshold)]
                                  if "long_prefill_token_threshold" in lv.settings else []))
                     for lv in levers}
            for lv in levers:
                with engine(setup, flags[lv.name]):
                    send(setup, warm_up)
                    runs[lv.name] = send(setup, shape)
            measured = {}
            for name, w in runs.items():
                run_traces = traces_of(setup, w)
                measured[name] = recorded_figures(run_traces, objectives)
                # whether the setting took effect as the simulator applies it: no step prefilled more than it
                print(f"{name}: largest prefill in one step "
                      f"{max((c for t in run_traces for c in t.steps.ctx_tokens), default=0)} tokens")
    rows, errors = [], []
    predicted: dict[str, Figures] = {}
    for p in result.levers:
        assert p.replay is not None
        predicted[p.lever.name] = p.replay.figures
        m = measured[p.lever.name]
        row = [p.lever.name]
        for attr, _ in FIGURES:
            e = _err(getattr(p.replay.figures, attr), getattr(m, attr))
            errors.append(e)
            row += [f"{getattr(p.replay.figures, attr):.3f}", f"{getattr(m, attr):.3f}", f"{e:+.0%}"]
        rows.append(row)
    print(render_table(["lever"] + [f"{label} {k}" for _, label in FIGURES for k in ("pred", "run", "err")], rows,
                       max_width=40))
    again = measured["max_num_batched_tokens=1024 (again)"]
    for attr, label in FIGURES[1:]:
        # Two runs whose figures differ by less than two runs of the same settings did cannot be ranked by the
        # runs themselves: the ranking is checked on the pairs the runs tell apart.
        noise = abs(_err(getattr(again, attr), getattr(result.recorded, attr)))
        names = list(measured)
        told = agree = 0
        for i, a in enumerate(names):
            for b in names[i + 1:]:
                ma, mb = getattr(measured[a], attr), getattr(measured[b], attr)
                if abs(ma - mb) <= noise * max(ma, mb):
                    continue
                told += 1
                agree += (ma - mb) * (getattr(predicted[a], attr) - getattr(predicted[b], attr)) > 0
        print(f"ranking by {label}: {agree}/{told} of the pairs the runs tell apart (by more than the noise floor, "
              f"{noise:.0%}) in the predicted order; predicted best "
              f"{min(predicted, key=lambda n: _better(attr, predicted[n]))}, measured best "
              f"{min(measured, key=lambda n: _better(attr, measured[n]))}")
    print("noise floor, the recorded settings run again against the recording: "
          + ", ".join(f"{label} {_err(getattr(again, attr), getattr(result.recorded, attr)):+.0%}"
                      for attr, label in FIGURES))
    within = sum(1 for e in errors if abs(e) <= TOLERANCE)
    print(f"{within}/{len(errors)} figures within {TOLERANCE:.0%}; worst {max(errors, key=abs):+.0%}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
