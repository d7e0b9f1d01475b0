"""stepline: one ClickHouse timeline for vLLM engines: every step, every request, every GPU counter.

The package is laid out in layers; a module imports only from its own layer or the ones above it in this list:

    core/             clocks, rate-limited logging, the HTTP listener, self-metrics, statistics, small helpers
    model/            the rows sources yield, the timeline's DDL and its column reference
    config/           the collector's settings and the service-level objectives
    store/            the store (chDB or a ClickHouse server), its URL, its Native batches, discovery, the reader
    queries/          the named SQL the readers share (requests merged, steps in a window, engine baselines)
    clickhouse_http/  ClickHouse's HTTP protocol without sockets: SQL guard, bodies, Native blocks, formats
    sources/  plugin/ what the collector reads (vLLM /metrics, plugin, OTLP, NVML, host) and the vLLM plugin
    ingest/           the runner, the writers, the spool, the request merge
    endpoints/        the query endpoint and the events endpoint
    analysis/         per-minute summaries, the timeline around a moment, per-request figures
    diagnosis/  watchdog/  alerting/  dashboards/
    app/              the collector wired and run, and the demo
    loadgen/          the interference matrix, sweeps and replays against an engine
    sim/  whatif/     the engine simulator, and what each scheduler lever would buy
    cli/              one module per `stepline` command
    testing/          test doubles, public: in-memory sink, fake NVML and psutil, vLLM stand-ins, a store server
"""
