"""`stepline sim`: serve a simulated vLLM 0.33 engine's /metrics until Ctrl-C or SIGTERM."""

from __future__ import annotations

import argparse
import signal
import sys
import threading
from types import FrameType

from stepline.sim.config import DEFAULT_MODEL, EngineConfig
from stepline.sim.workloads import WORKLOAD_NAMES, make_workload

HELP = "run the vLLM-compatible engine simulator"
DESCRIPTION = ("Serve a simulated vLLM 0.33 engine's /metrics, plugin datagrams, OTLP spans and streaming "
               "completions: no GPU needed.")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the `stepline sim` options to `parser`."""
    defaults = EngineConfig()
    parser.add_argument(
        "--workload",
        choices=(*WORKLOAD_NAMES, "idle"),
        default="steady",
        help="traffic to simulate: steady chat, a reported production burst with monster prompts, idle (only "
        "what clients send to /v1/completions), or one "
        "isolated 512k-token request decoding alone (default: %(default)s)",
    )
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default: %(default)s)")
    parser.add_argument("--port", type=int, default=8000, help="TCP port, 0 for any free one (default: %(default)s)")
    parser.add_argument("--model", default=DEFAULT_MODEL, help="model_name label to report (default: %(default)s)")
    parser.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=defaults.max_num_batched_tokens,
        help="token budget of one engine step, in tokens (default: %(default)s)",
    )
    parser.add_argument(
        "--max-num-seqs",
        type=int,
        default=defaults.max_num_seqs,
        help="most requests running at once (default: %(default)s)",
    )
    parser.add_argument(
        "--long-prefill-token-threshold",
        type=int,
        default=defaults.long_prefill_token_threshold,
        help="most prompt tokens one request may prefill in one step, 0 for no cap (default: %(default)s)",
    )
    parser.add_argument(
        "--num-gpu-blocks",
        type=int,
        default=defaults.num_gpu_blocks,
        help=f"KV-cache capacity in blocks of {defaults.block_size} tokens (default: %(default)s)",
    )
    parser.add_argument("--seed", type=int, default=0, help="workload random seed (default: %(default)s)")
    parser.add_argument(
        "--speed",
        type=float,
        default=1.0,
        help="simulated seconds per wall-clock second; 10 runs ten times faster (default: %(default)s)",
    )
    parser.add_argument(
        "--duration",
        type=float,
        default=None,
        help="workload length in seconds, rescaling its arrivals "
        "(default: the workload's own: steady 300, burst 600, isolated 60)",
    )
    parser.add_argument(
        "--plugin-socket",
        metavar="PATH",
        help="also send every step through stepline's vLLM stat-logger plugin to this sidecar socket "
        "(e.g. /tmp/stepline-plugin.sock; default: off)",
    )
    parser.add_argument(
        "--otlp-endpoint",
        metavar="URL",
        help="also export an llm_request span per finished request over OTLP/HTTP to this base URL "
        "(e.g. http://127.0.0.1:4318; default: off)",
    )
    parser.add_argument(
        "--engine-name",
        default="vllm",
        help="engine name the plugin and the spans report (default: %(default)s)",
    )
    parser.add_argument(
        "--once",
        action="store_true",
        help="play the workload once and then idle (default: repeat it for as long as the server runs)",
    )


def run(args: argparse.Namespace) -> int:
    """Serve until interrupted; 0 on a clean stop, 2 on a bad setting, 1 if the port cannot be bound."""
    from stepline.sim.telemetry import Telemetry
    from stepline.sim.vllm_server import idle_workload, serve

    try:
        workload = (idle_workload(args.duration or 60.0) if args.workload == "idle"
                    else make_workload(args.workload, seed=args.seed, duration_s=args.duration))
        config = EngineConfig(
            model=args.model,
            max_num_batched_tokens=args.max_num_batched_tokens,
            max_num_seqs=args.max_num_seqs,
            long_prefill_token_threshold=args.long_prefill_token_threshold,
            num_gpu_blocks=args.num_gpu_blocks,
        )
        telemetry = Telemetry(args.engine_name, config, plugin_socket=args.plugin_socket,
                              otlp_endpoint=args.otlp_endpoint)
        server = serve(workload, config, host=args.host, port=args.port, speed=args.speed, repeat=not args.once,
                       on_step=telemetry.on_step)
    except ValueError as error:
        print(f"stepline sim: {error}", file=sys.stderr)
        return 2
    except OSError as error:
        print(f"stepline sim: cannot listen on {args.host}:{args.port}: {error}", file=sys.stderr)
        return 1

    stop = threading.Event()

    def on_signal(signum: int, frame: FrameType | None) -> None:
        stop.set()

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        print(
            f"stepline sim: {workload.name} workload, model {config.model}, metrics at {server.url}/metrics",
            flush=True,
        )
        stop.wait()
    finally:
        server.stop()
        telemetry.close()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return 0
