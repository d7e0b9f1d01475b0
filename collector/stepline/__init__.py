"""stepline: one ClickHouse timeline for vLLM engines: every step, every request, every GPU counter.

The package is laid out in layers, lowest first; a module imports only from its own layer or one listed before it
(tests/test_layout.py holds the tree to this):

    core/             clocks, rate-limited logging, the HTTP listener, self-metrics, statistics, small helpers
    model/            the rows sources yield, the timeline's DDL and its column reference
    queries/          the SQL the readers share, each once (the merged requests read, steps in a window, baselines)
    store/            the store (chDB or a ClickHouse server), its URL, errors, migrations, batches, discovery, reader
    config/           the collector's settings and the service-level objectives
    clickhouse_http/  ClickHouse's HTTP protocol without sockets: SQL guard, bodies, settings, Native blocks, formats
    plugin/           the vLLM stat-logger plugin (standard library only)
    gateway/          gateways in front of the engines: the decision record a router sends, and its row
    sources/          what the collector reads: vLLM /metrics, plugin datagrams, OTLP, NVML, host, pod resources
    ingest/           the runner, the writers, the spool, the request merge
    endpoints/        the query endpoint and the events endpoint
    diagnosis/        detectors over the timeline, and their findings
    analysis/         per-minute summaries, the timeline around a moment, per-request figures, windows
    watchdog/         the progress watchdog and its budget
    alerting/         alert rules generated from one config
    dashboards/       Grafana dashboards generated from code, and provisioning
    testing/          test doubles, public: in-memory sink, fake NVML/psutil//proc, vLLM stand-ins, a store server
    loadgen/          load against an engine: the interference matrix, sweeps and replays
    sim/              the vLLM-compatible engine simulator
    whatif/           what each scheduler lever would buy
    app/              the collector wired and run, and the demo
    drills/           incidents with a known cause run through the real collector, and time to truth
    cli/              one module per `stepline` command
"""
