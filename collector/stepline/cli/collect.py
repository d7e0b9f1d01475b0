"""`stepline collect`: the collector sidecar, until SIGTERM/SIGINT."""

from __future__ import annotations

import argparse
import logging

from stepline.cli.options import OBJECTIVES_HELP
from stepline.config.settings import ROLES, Settings, SettingsError, size

HELP = "run the collector sidecar"
DESCRIPTION = "Scrape engines into the store until SIGTERM/SIGINT, then drain and stop."
STORE_HELP = ("store URL: chdb:///path (embedded ClickHouse) or http(s)://user:pass@host:8123/db "
              "(default: $STEPLINE_STORE, else chdb://./stepline-data)")

log = logging.getLogger("stepline")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The collector's settings that a command line may give (each else from the environment: config.settings)."""
    parser.add_argument("--engine", action="append", default=None, metavar="[NAME=]URL",
                        help="a vLLM server to scrape, e.g. http://127.0.0.1:8000 (repeat for several; "
                             "default $STEPLINE_ENGINES, comma-separated)")
    parser.add_argument("--gateway", action="append", default=None, metavar="[NAME=]URL",
                        help="a gateway in front of the engines whose /metrics to scrape into gateway_samples: a "
                             "LiteLLM proxy or vllm-router, e.g. router=http://127.0.0.1:29000 (repeat for several; "
                             "default $STEPLINE_GATEWAYS, comma-separated)")
    parser.add_argument("--lane-budget", action="append", default=None, metavar="LANE=SECONDS",
                        help="the least stall budget of the engines a gateway's decisions put in LANE, e.g. "
                             "heavy=300 for a lane slow by design (repeatable; $STEPLINE_LANE_BUDGETS, "
                             "comma-separated): its long work never pages, its crashes still do")
    parser.add_argument("--lane-bar", action="append", default=None, metavar="LANE=TOKENS",
                        help="the bar a gateway routes LANE by, where the router does not say (no stepline_threshold "
                             "in its decisions): prompts of TOKENS or more, as the engine counts them, belong on LANE, "
                             "e.g. heavy=100000 (repeatable; $STEPLINE_LANE_BARS, comma-separated); lane_leak judges "
                             "the decisions that carry no bar of their own against it")
    parser.add_argument("--backend", action="append", default=None, metavar="ADDRESS=ENGINE",
                        help="ENGINE stands behind a gateway's backend ADDRESS that it is not watched at, e.g. "
                             "vllm.default.svc:8000=vllm-0 for a service in front of replicas (repeat per replica; "
                             "$STEPLINE_BACKENDS, comma-separated): decisions to that backend join the requests of "
                             "the engines behind it by time and size")
    parser.add_argument("--objectives", default=None, metavar="FILE", help=OBJECTIVES_HELP)
    parser.add_argument("--role", choices=ROLES,
                        help="sidecar: beside one engine, every source (default); node: one per Kubernetes node, "
                             "GPUs and host only, each GPU tied to the pod the kubelet allocated it to "
                             "(default $STEPLINE_ROLE; run the sidecars with --disable-source gpu)")
    parser.add_argument("--pod-resources-socket", metavar="PATH",
                        help="the kubelet's pod-resources socket the node role asks "
                             "(default /var/lib/kubelet/pod-resources/kubelet.sock)")
    parser.add_argument("--store", help=STORE_HELP)
    parser.add_argument("--retention", type=int, dest="retention_days", metavar="DAYS",
                        help="days of data to keep; whole days expire at once (default 30)")
    parser.add_argument("--listen", help="address for the collector's own listeners (default 127.0.0.1)")
    parser.add_argument("--metrics-port", type=int, help="port of the collector's own /metrics (default 9465)")
    parser.add_argument("--query-port", type=int,
                        help="port of the read-only SQL endpoint over the embedded store (default 8124)")
    parser.add_argument("--scrape-interval", type=float, dest="scrape_interval_s", metavar="SECONDS",
                        help="how often to scrape each engine's /metrics (default 5)")
    parser.add_argument("--disable-source", action="append", default=None, metavar="NAME",
                        help="switch a source off (repeatable)")
    parser.add_argument("--host-name", help="name of this machine on the timeline (default: hostname)")
    parser.add_argument("--plugin-socket", metavar="PATH",
                        help="Unix datagram socket the vLLM stat-logger plugin sends to "
                             "(default /tmp/stepline-plugin.sock; vLLM side: STEPLINE_PLUGIN_SOCKET)")
    parser.add_argument("--engine-process", action="append", default=None, metavar="NAME=PID|NAME=cmdline:TEXT",
                        help="how to find an engine's process for host samples when its --engine port does not "
                             "tell (repeatable); GPUs used by it or its children are tied to NAME")
    parser.add_argument("--otlp-port", type=int,
                        help="port of the OTLP/HTTP trace receiver for vLLM's llm_request spans (default 4318)")
    parser.add_argument("--spool-dir", metavar="DIR",
                        help="where rows wait on disk until the store takes them (default: beside an embedded "
                             "store, else ./stepline-spool/HOST_PORT_DB)")
    parser.add_argument("--spool-max-bytes", type=size, metavar="SIZE",
                        help="the spool's bound; when full the oldest rows go first, counted (default 1G; 0: no "
                             "spool, rows wait in memory only)")
    parser.add_argument("--flush-interval", type=float, dest="flush_interval_s", metavar="SECONDS",
                        help="how often rows are cut into a batch, spooled and inserted; a kill -9 loses at most "
                             "this much (default 1 on the embedded store, 5 on a server)")


def settings_of(args: argparse.Namespace) -> Settings:
    """The collector's settings: what the command line gives, the environment the rest; SettingsError if bad."""
    return Settings.from_env(
        store=args.store, retention_days=args.retention_days, listen=args.listen, metrics_port=args.metrics_port,
        query_port=args.query_port, scrape_interval_s=args.scrape_interval_s, host_name=args.host_name,
        plugin_socket=args.plugin_socket, otlp_port=args.otlp_port, spool_dir=args.spool_dir,
        spool_max_bytes=args.spool_max_bytes, flush_interval_s=args.flush_interval_s,
        engine_processes=tuple(args.engine_process) if args.engine_process else None,
        engines=tuple(args.engine) if args.engine else None,
        gateways=tuple(args.gateway) if args.gateway else None,
        lane_budgets=tuple(args.lane_budget) if args.lane_budget else None,
        lane_bars=tuple(args.lane_bar) if args.lane_bar else None,
        backends=tuple(args.backend) if args.backend else None,
        disabled_sources=frozenset(args.disable_source) if args.disable_source else None,
        role=args.role, pod_resources_socket=args.pod_resources_socket, objectives_file=args.objectives,
    )


def run(args: argparse.Namespace) -> int:
    """Collect until signalled; 0 once drained, SettingsError (exit 2) for a bad setting or a taken port."""
    from stepline.app.collector import Collector
    from stepline.core import gctune

    settings = settings_of(args)
    collector = Collector(settings)
    try:
        collector.start()
    except OSError as exc:
        raise SettingsError(f"cannot listen on {settings.listen}: {exc.strerror}") from None
    gctune.tune()
    if not settings.engines and settings.role == "sidecar":
        log.warning("no --engine given: no /metrics is scraped; the plugin, OTLP, GPU and host sources still run")
    collector.run_until_signalled()
    return 0
