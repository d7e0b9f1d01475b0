"""The `stepline` command line."""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

from clickhouse_connect.driver.exceptions import ClickHouseError

from stepline.config.settings import ROLES, Settings, SettingsError, size
from stepline.core.timeparse import parse_duration
from stepline.core.usage import UsageError
from stepline.model import schema
from stepline.store.discovery import RUNTIME_DIR_HELP, LocatedStore
from stepline.store.store import StoreError
from stepline.store.url import StoreUrlError

if TYPE_CHECKING:
    from stepline.store.reader import TimelineReader

log = logging.getLogger("stepline")

TABLE_WIDTH = 60  # characters of one value in `stepline query`'s table

STORE_HELP = ("store URL: chdb:///path (embedded ClickHouse) or http(s)://user:pass@host:8123/db "
              "(default: $STEPLINE_STORE, else chdb://./stepline-data)")
READ_STORE_HELP = ("store URL: chdb:///path (embedded ClickHouse) or http(s)://user:pass@host:8123/db (default: "
                   "$STEPLINE_STORE, else ./stepline-data when it exists, else the store of the running collector, "
                   f"found in its runtime file in {RUNTIME_DIR_HELP})")


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `stepline` console script."""
    args = build_parser(_command_named(sys.argv[1:] if argv is None else argv)).parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # chDB's client logs every engine-level query at INFO; that is not the operator's business.
    logging.getLogger("clickhouse_connect").setLevel(logging.ERROR)
    # urllib3 narrates its retries; the store error that follows says what matters, in one line.
    logging.getLogger("urllib3").setLevel(logging.ERROR)
    try:
        return int(args.func(args))
    except (UsageError, StoreError, StoreUrlError) as exc:
        print(f"stepline: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


def _command_named(argv: Sequence[str]) -> str | None:
    """The subcommand of a command line (its first word not an option), or None (`stepline --help`)."""
    return next((word for word in argv if not word.startswith("-")), None)


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The whole parser; with `command`, the modules behind the other commands are not imported: they cost the
    simulator, the collector, OpenTelemetry and the dashboards at every start (about a second on two busy cores)."""
    parser = argparse.ArgumentParser(
        prog="stepline",
        description="One ClickHouse timeline for vLLM engines: every step, every request, every GPU counter.",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log at debug level")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    collect = sub.add_parser("collect", help="run the collector sidecar",
                             description="Scrape engines into the store until SIGTERM/SIGINT, then drain and stop.")
    collect.add_argument("--engine", action="append", default=None, metavar="[NAME=]URL",
                         help="a vLLM server to scrape, e.g. http://127.0.0.1:8000 (repeat for several; "
                              "default $STEPLINE_ENGINES, comma-separated)")
    collect.add_argument("--role", choices=ROLES,
                         help="sidecar: beside one engine, every source (default); node: one per Kubernetes node, "
                              "GPUs and host only, each GPU tied to the pod the kubelet allocated it to "
                              "(default $STEPLINE_ROLE; run the sidecars with --disable-source gpu)")
    collect.add_argument("--pod-resources-socket", metavar="PATH",
                         help="the kubelet's pod-resources socket the node role asks "
                              "(default /var/lib/kubelet/pod-resources/kubelet.sock)")
    collect.add_argument("--store", help=STORE_HELP)
    collect.add_argument("--retention", type=int, dest="retention_days", metavar="DAYS",
                         help="days of data to keep; whole days expire at once (default 30)")
    collect.add_argument("--listen", help="address for the collector's own listeners (default 127.0.0.1)")
    collect.add_argument("--metrics-port", type=int, help="port of the collector's own /metrics (default 9465)")
    collect.add_argument("--query-port", type=int,
                         help="port of the read-only SQL endpoint over the embedded store (default 8124)")
    collect.add_argument("--scrape-interval", type=float, dest="scrape_interval_s", metavar="SECONDS",
                         help="how often to scrape each engine's /metrics (default 5)")
    collect.add_argument("--disable-source", action="append", default=None, metavar="NAME",
                         help="switch a source off (repeatable)")
    collect.add_argument("--host-name", help="name of this machine on the timeline (default: hostname)")
    collect.add_argument("--plugin-socket", metavar="PATH",
                         help="Unix datagram socket the vLLM stat-logger plugin sends to "
                              "(default /tmp/stepline-plugin.sock; vLLM side: STEPLINE_PLUGIN_SOCKET)")
    collect.add_argument("--engine-process", action="append", default=None, metavar="NAME=PID|NAME=cmdline:TEXT",
                         help="how to find an engine's process for host samples when its --engine port does not "
                              "tell (repeatable); GPUs used by it or its children are tied to NAME")
    collect.add_argument("--otlp-port", type=int,
                         help="port of the OTLP/HTTP trace receiver for vLLM's llm_request spans (default 4318)")
    collect.add_argument("--spool-dir", metavar="DIR",
                         help="where rows wait on disk until the store takes them (default: beside an embedded "
                              "store, else ./stepline-spool/HOST_PORT_DB)")
    collect.add_argument("--spool-max-bytes", type=size, metavar="SIZE",
                         help="the spool's bound; when full the oldest rows go first, counted (default 1G; 0: no "
                              "spool, rows wait in memory only)")
    collect.add_argument("--flush-interval", type=float, dest="flush_interval_s", metavar="SECONDS",
                         help="how often rows are cut into a batch, spooled and inserted; a kill -9 loses at most "
                              "this much (default 1)")
    collect.set_defaults(func=_collect)

    query = sub.add_parser("query", help="run read-only SQL against the timeline",
                           description="Through the running collector's endpoint when one holds the embedded "
                                       "store, else straight from the store.")
    query.add_argument("sql", help="the query, e.g. \"SELECT kind, count() FROM events GROUP BY kind\"")
    query.add_argument("--store", help=READ_STORE_HELP)
    query.add_argument("--format", default="table",
                       help="table (default), csv, tsv, json (one object per line), or any ClickHouse format name")
    query.set_defaults(func=_query)

    requests_p = sub.add_parser(
        "requests", help="the slowest finished requests, with the steps that slowed them",
        description="Join each of the slowest requests with the engine steps around it: time it queued while "
                    "prefill ran, tokens it decoded beside a long prefill chunk, and its step-time tail.")
    requests_p.add_argument("--slowest", type=_count, default=20, metavar="N", help="how many requests (default 20)")
    requests_p.add_argument("--by", choices=("e2e", "ttft", "tpot", "queue"), default="e2e",
                            help="what 'slowest' means: end-to-end, time to first token, time per output "
                                 "token, or queue time (default e2e)")
    requests_p.add_argument("--since", default="1h", metavar="DURATION",
                            help="how far back, e.g. 30m, 2h, 1d (default 1h)")
    requests_p.add_argument("--engine", default="", help="only this engine (default: all)")
    requests_p.add_argument("--long-prefill", type=_count, default=None, metavar="TOKENS",
                            help="a step carrying at least this many prefill tokens counts as a long prefill chunk "
                                 "(default: half of the engine's max_num_batched_tokens, else of its largest chunk)")
    requests_p.add_argument("--store", help=READ_STORE_HELP)
    requests_p.set_defaults(func=_requests)

    timeline_p = sub.add_parser(
        "timeline", help="engine steps beside GPU counters, around a moment",
        description="Each engine step beside the sample of each of its GPUs taken at or just before it "
                    "(the `timeline` view), from --window seconds before to --window seconds after --around.")
    timeline_p.add_argument("--around", required=True, metavar="TIME",
                            help="ISO 8601 (UTC unless it says otherwise), epoch seconds, or HH:MM:SS today (UTC)")
    timeline_p.add_argument("--window", type=float, default=30.0, metavar="SECONDS",
                            help="seconds on each side (default 30)")
    timeline_p.add_argument("--bucket", type=float, default=1.0, metavar="SECONDS",
                            help="aggregate per this many seconds; 0 prints every step (default 1)")
    timeline_p.add_argument("--engine", default="", help="only this engine (default: all)")
    timeline_p.add_argument("--store", help=READ_STORE_HELP)
    timeline_p.set_defaults(func=_timeline)

    status = sub.add_parser("status", help="sources up, rows per table, age of the newest row",
                            description="A one-screen health summary of the timeline and its collector.")
    status.add_argument("--store", help=READ_STORE_HELP)
    status.set_defaults(func=_status)

    schema_p = sub.add_parser("schema", help="print the DDL of the timeline",
                              description="Print the CREATE statements stepline runs, for one node or a cluster.")
    schema_p.add_argument("--cluster", metavar="NAME",
                          help="render ON CLUSTER: ReplicatedMergeTree local tables and Distributed tables over them")
    schema_p.add_argument("--database", default="stepline", help="database name (default stepline)")
    schema_p.add_argument("--retention", type=int, default=30, dest="retention_days", metavar="DAYS",
                          help="days of data to keep (default 30)")
    schema_p.add_argument("--markdown", action="store_true",
                          help="print the column reference (each table's columns, types and comments) as Markdown")
    schema_p.add_argument("--readme", metavar="PATH",
                          help="rewrite the column reference between the markers in this README")
    schema_p.set_defaults(func=_schema)

    # Commands whose options and behaviour live in their own module (add_arguments, run).
    for name, module, help_text, description in (
        ("diagnose", "stepline.cli.diagnose",
         "say what is wrong: ranked findings with evidence, SQL and the lever to pull",
         "Run every detector over a window of the timeline: prefill interference, head-of-line blocking, "
         "scheduler vs hardware, prefix-cache collapse, KV pressure, a wedged engine, configuration not in "
         "effect, GPU throttling and XIDs, speculative-decoding shifts. Exit code 1 when a finding is critical."),
        ("report", "stepline.cli.report",
         "write a self-contained HTML incident report (findings and plots on one time axis)",
         "Diagnose a window and write one HTML file that opens anywhere without a network: the findings, then "
         "step time, ITL, queue, KV, prefix-cache and GPU plots on one time axis with the findings' windows marked."),
        ("whatif", "stepline.cli.whatif", "what each scheduler lever would buy, replayed on the recorded window",
         "Fits the engine's step cost from its recorded steps (error on held-out steps), replays the window's "
         "requests through the simulator's scheduler under the recorded settings (the calibration check, beside "
         "the recording) and under each lever: chunk threshold, token budget, max_num_seqs, prefill interval, "
         "priority, shape-sharding, deadline-aware chunks. TTFT, ITL, decode rates and goodput, ranked."),
        ("matrix", "stepline.loadgen.matrix",
         "interference test: decode-only vs + long uncached prompt vs + cached prompt",
         "Against any OpenAI-compatible streaming endpoint: N decode-only streams; the same plus one long "
         "uncached prompt; the same with that prompt cached. Every token is timestamped on the client; TTFT and "
         "ITL p50/p95/p99 and the worst gap per run, with deltas. Results also go to the store as matrix_run "
         "events. With --sweep NAME=V1,V2 --launch 'COMMAND ... {NAME}' it starts the engine with each value, "
         "measures it (the matrix, or --replay of a recorded window), stops it, and prints one table."),
        ("replay", "stepline.loadgen.replay",
         "send a recorded window's request shape to an engine, at its arrival times",
         "Read a window's finished requests from the store and send the same shape to any OpenAI-compatible "
         "streaming endpoint: the same arrival offsets (divided by --speed), prompt and output lengths in tokens, "
         "and prefix-cache hits made to recur through shared token-id prefixes. Prints what was sent and what came "
         "back: requests completed and failed, tokens, client-side TTFT and ITL p50/p99."),
        ("alerts", "stepline.cli.alerts",
         "generate the alert rules, Alertmanager example and Grafana alert provisioning",
         "`stepline alerts build` regenerates everything in alerts/ from the one alert config: Prometheus rules, "
         "an Alertmanager example, Grafana-managed rules, contact point and policy."),
        ("dashboards", "stepline.cli.dashboards", "generate the Grafana dashboards",
         "`stepline dashboards build` regenerates the dashboards in dashboards/ from code: fleet overview, "
         "engine timeline, requests, GPU and collector health."),
        ("grafana-provisioning", "stepline.dashboards.provisioning",
         "write Grafana provisioning for the embedded store (datasource + dashboards)",
         "A local Grafana against `stepline collect`, with no ClickHouse server: a ClickHouse datasource "
         "(protocol http) pointing at the collector's query endpoint, and the dashboards."),
        ("sim", "stepline.cli.sim", "run the vLLM-compatible engine simulator",
         "Serve a simulated vLLM 0.33 engine's /metrics, plugin datagrams, OTLP spans and streaming completions: "
         "no GPU needed."),
        ("demo", "stepline.app.demo", "simulate a burst and collect it into the embedded store",
         "Start the simulator and the collector, run the burst workload, then print a summary and the "
         "diagnosis from SQL."),
    ):
        command_parser = sub.add_parser(name, help=help_text, description=description)
        if command is None or command == name:
            handler = importlib.import_module(module)
            handler.add_arguments(command_parser)
            command_parser.set_defaults(func=handler.run)
    return parser


def _collect(args: argparse.Namespace) -> int:
    from stepline.app.collector import Collector
    from stepline.core import gctune

    settings = Settings.from_env(
        store=args.store, retention_days=args.retention_days, listen=args.listen, metrics_port=args.metrics_port,
        query_port=args.query_port, scrape_interval_s=args.scrape_interval_s, host_name=args.host_name,
        plugin_socket=args.plugin_socket, otlp_port=args.otlp_port, spool_dir=args.spool_dir,
        spool_max_bytes=args.spool_max_bytes, flush_interval_s=args.flush_interval_s,
        engine_processes=tuple(args.engine_process) if args.engine_process else None,
        engines=tuple(args.engine) if args.engine else None,
        disabled_sources=frozenset(args.disable_source) if args.disable_source else None,
        role=args.role, pod_resources_socket=args.pod_resources_socket,
    )
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


def _query(args: argparse.Namespace) -> int:
    from stepline.clickhouse_http.protocol import SqlRefused, read_only_statement
    from stepline.core.texttable import render_table

    try:  # read-only whichever way the store is reached (an embedded store opened directly is writable)
        read_only_statement(args.sql)
    except SqlRefused as exc:
        print(f"stepline: query refused: {exc}", file=sys.stderr)
        return 1
    reader = _open(args.store)[0]
    try:
        fmt = args.format.lower()
        if fmt == "table":
            result = reader.client.query(args.sql)
            print(render_table(result.column_names, result.result_rows, TABLE_WIDTH,
                               f"(some values cut at {TABLE_WIDTH} characters; --format tsv or json shows them whole)"))
            print(f"({len(result.result_rows)} rows, via {reader.via})", file=sys.stderr)
            return 0
        names = {"csv": "CSVWithNames", "tsv": "TabSeparatedWithNames", "json": "JSONEachRow"}
        sys.stdout.write(reader.client.raw_query(args.sql, fmt=names.get(fmt, args.format)).decode("utf-8"))
        return 0
    except ClickHouseError as exc:
        print(f"stepline: query failed: {' '.join(str(exc).split())[:500]}", file=sys.stderr)
        return 1
    finally:
        reader.close()


def _requests(args: argparse.Namespace) -> int:
    from stepline.analysis import perrequest

    since = max(0.0, time.time() - parse_duration(args.since))
    reader = _open(args.store)[0]
    try:
        found = perrequest.slowest(reader.client, since=since, limit=args.slowest, by=args.by, engine=args.engine,
                                   long_prefill_tokens=args.long_prefill)
    finally:
        reader.close()
    if not found:
        print(f"no finished requests in the last {args.since}"
              + (f" on engine {args.engine}" if args.engine else "") + " (the plugin or OTLP fills `requests`)")
        return 0
    print(perrequest.render(found))
    return 0


def _timeline(args: argparse.Namespace) -> int:
    from stepline.analysis import timeline

    moment = timeline.parse_moment(args.around)
    reader = _open(args.store)[0]
    try:
        print(timeline.around(reader.client, reader.database, moment, window_s=args.window, engine=args.engine,
                              bucket_s=args.bucket))
    finally:
        reader.close()
    return 0


def _count(text: str) -> int:
    """A whole number 1..2^32-1: it is bound to a UInt32 query parameter."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if not 1 <= value < 1 << 32:
        raise argparse.ArgumentTypeError(f"{value} is not between 1 and {(1 << 32) - 1}")
    return value


def _status(args: argparse.Namespace) -> int:
    from stepline.core.texttable import render_table
    from stepline.store.reader import table_status

    reader, located = _open(args.store)
    try:
        found = f" (found in {located.runtime_file})" if located.runtime_file else ""
        print(f"timeline: {reader.via}{found}")
        _print_sources(reader.collector.metrics_url if reader.collector else _announced_metrics(located))
        tables = table_status(reader.client)
        print(render_table(("table", "rows", "newest row"),
                           [(t.table, t.rows, _age(t.newest_age_s)) for t in tables]))
    finally:
        reader.close()
    return 0


def _open(store: str | None) -> tuple[TimelineReader, LocatedStore]:
    """A reader of the store --store names, else the one the environment, the current directory or the running
    collector's runtime file does (runtimefile.locate_store)."""
    from stepline.store.reader import open_located

    return open_located(store)


def _announced_metrics(located: LocatedStore) -> str:
    """The /metrics of the running collector that writes the located store (a server store has no file beside it)."""
    from stepline.store.discovery import collector_for, store_without_password
    from stepline.store.url import parse_store_url

    if located.collector is not None:
        return located.collector.metrics_url
    running = collector_for(store_without_password(parse_store_url(located.url)))
    return running.metrics_url if running is not None else ""


def _print_sources(metrics_url: str) -> None:
    from stepline.core.texttable import render_table
    from stepline.store.reader import source_health

    if not metrics_url:
        print("collector: not running")
        return
    try:
        health = source_health(metrics_url)
    except OSError as exc:
        print(f"sources: cannot read {metrics_url}: {exc}")
        return
    rows = [(name, "up" if h.up else "DOWN", h.error) for name, h in sorted(health.items())]
    # The reason is the whole point of a DOWN line: it gets a wider cell than query output.
    print(render_table(("source", "state", "last error"), rows, 200) if rows else "sources: none configured")


def _age(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    for unit, span in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= span:
            return f"{seconds / span:.1f}{unit} ago"
    return f"{seconds:.1f}s ago"


def _schema(args: argparse.Namespace) -> int:
    from pathlib import Path

    from stepline.model import schemadoc

    if args.readme:
        try:
            changed = schemadoc.update_readme(Path(args.readme))
        except (OSError, ValueError) as exc:
            raise SettingsError(f"cannot update {args.readme}: {exc}") from None
        print(f"{args.readme}: column reference {'updated' if changed else 'already current'}")
        return 0
    if args.markdown:
        sys.stdout.write(schemadoc.markdown())
        return 0
    for statement in schema.ddl(args.database, args.retention_days, cluster=args.cluster):
        print(statement + ";\n")
    return 0

