"""Days of 8-GPU nodes (one, or a fleet), synthesised inside ClickHouse with INSERT ... SELECT FROM numbers().

Every table gets rows shaped like the collector's: one engine per GPU stepping ~45 times a second
(decode steps of 10-40 ms with up to 64 running, 8192-token prefill chunks now and then, one ITL per
decoding request and one TTFT per first token), finished requests, /metrics scraped every 5 s, NVML at
10 Hz, psutil at 1 Hz and a few events. Load follows the time of day, so nights have quiet steps.
A gateway (LiteLLM-like, forwarding the request id) decided every request: one
decision each, from KEYS API keys in TEAMS teams, lane `heavy` above HEAVY_PROMPT prompt tokens, else `fast`.
Incidents near the end, on the first node: a 359k-token prefill on engine 2 (20 minutes before the end), an XID on
GPU 6 (10 minutes before the end), and a power cap on GPU 5 (from 3 h to 2 h 15 min before the end). Every other
node is healthy. Each engine's steps go in a day at a time, so that no INSERT makes more parts than a day's.
Pseudo-random values come from hashes of the row number: the same arguments give the same rows.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

from stepline.model.schema import TABLE_BY_NAME

HOST = "node-0"  # the node the incidents are on
MODEL = "llama-3.1-70b-instruct"
BUDGET = 8192  # max_num_batched_tokens: a full prefill chunk plus the step's decodes
MONSTER_ENGINE, MONSTER_PROMPT, MONSTER_STEP_S = 2, 359_000, 5.0
MONSTER_STEPS = math.ceil(MONSTER_PROMPT / (BUDGET - 64))
MONSTER_AGO_S, XID_AGO_S = 20 * 60, 10 * 60
CAP_GPU, CAP_FROM_AGO_S, CAP_TO_AGO_S = 5, 3 * 3600, 2 * 3600 + 15 * 60
SPEC_ENGINES = (6, 7)  # these draft with speculative decoding
DAY_S = 86_400
KEYS, TEAMS = 40, 8  # the gateway's API keys, and the teams they belong to (key k in team k % TEAMS)
HEAVY_PROMPT = 20_000  # prompt tokens above which the gateway sends a request to its heavy lane


@dataclass(frozen=True)
class Shape:
    """What to synthesise: `hours` ending at `end_s` (epoch seconds) for `hosts` nodes of `engines` engines, one
    per GPU."""

    end_s: int
    hours: float = 24.0
    engines: int = 8  # per host
    hosts: int = 1
    step_rate: float = 45.0  # steps per second per engine
    request_rate: float = 3.0  # finished requests per second per engine
    scrape_s: float = 5.0
    gpu_hz: float = 10.0
    # Steps only over the span's last this many hours (None: all of it): a store for the readers that read the
    # steps only near the end (usage_scale.py: the rollup's minutes and a report's edges), filled in minutes.
    steps_hours: float | None = None

    @property
    def start_s(self) -> int:
        return self.end_s - round(self.hours * 3600)

    @property
    def seconds(self) -> int:
        return self.end_s - self.start_s

    @staticmethod
    def host(h: int) -> str:
        return f"node-{h}"

    def engine(self, e: int, h: int = 0) -> str:
        return f"{self.host(h)}:{8000 + e}"

    def key(self, e: int, h: int = 0) -> int:
        """The engine's number across the fleet: what its pseudo-random values and its load's phase hash."""
        return h * self.engines + e

    @property
    def days(self) -> list[tuple[int, int]]:
        """(first second, seconds) of each day-long slice of the span, from its start."""
        return [(s, min(DAY_S, self.seconds - s)) for s in range(0, self.seconds, DAY_S)]

    @property
    def step_days(self) -> list[tuple[int, int]]:
        """`days`, cut to the last `steps_hours` of the span: the slices of it that get steps."""
        if self.steps_hours is None:
            return self.days
        first = max(0, self.seconds - round(self.steps_hours * 3600))
        return [(max(s, first), s + n - max(s, first)) for s, n in self.days if s + n > first]

    @property
    def monster_start_s(self) -> int:
        return self.end_s - MONSTER_AGO_S


def _u(e: str, i: str, salt: int, offset: int = 0) -> str:
    """A uniform [0, 1) from a hash of the engine, the row and a salt."""
    return f"(cityHash64({e}, {i}, {salt + offset}) % 1000003) / 1000003.0"


def _load(ts_s: str, e: str) -> str:
    """Diurnal load in [0.1, 1.0]; each engine's peak a little apart."""
    return f"(0.55 + 0.45 * sin(2 * pi() * ({ts_s} % {DAY_S}) / {DAY_S} + {e} * 0.3))"


def _load_integral(ts_s: str, e: str, start_s: int) -> str:
    """The load's integral from `start_s`: what a counter growing with the load has reached."""
    w = 2 * math.pi / DAY_S

    def phase(t: str) -> str:
        return f"({w} * ({t} % {DAY_S}) + {e} * 0.3)"

    return f"(0.55 * ({ts_s} - {start_s}) - {0.45 / w} * (cos({phase(ts_s)}) - cos({phase(str(start_s))})))"


def _columns(table: str, upto: str = "") -> str:
    """The table's columns in order, up to and including `upto` (the rest take their defaults)."""
    names = list(TABLE_BY_NAME[table].column_names)
    if upto:
        names = names[:names.index(upto) + 1]
    return ", ".join(f"`{c}`" for c in names)


def steps_sql(shape: Shape, e: int, h: int = 0, day: tuple[int, int] | None = None) -> str:
    """One engine's steps over `day` ((first second, seconds) of the span; all of it by default), leaving out the
    seconds its monster prefill occupies (inserted on its own)."""
    first_s, seconds = day or (0, shape.seconds)
    i0, n = round(first_s * shape.step_rate), round(seconds * shape.step_rate)
    period_us = 1e6 / shape.step_rate
    cap = shape.end_s - CAP_FROM_AGO_S, shape.end_s - CAP_TO_AGO_S
    m0 = shape.monster_start_s
    m1 = m0 + MONSTER_STEPS * MONSTER_STEP_S
    spec = 1 if e in SPEC_ENGINES else 0
    k = shape.key(e, h)
    u = partial(_u, str(k), "i")
    incidents = int(h == 0)
    return f"""
INSERT INTO steps ({_columns('steps', upto='is_dummy')})
SELECT fromUnixTimestamp64Micro(ts_us, 'UTC'), '{shape.host(h)}', '{shape.engine(e, h)}', 0, '{MODEL}', i, elapsed,
       ctx_requests, ctx_tokens, gen_requests, gen_requests + accepted, running, waiting, 0, kv,
       ctx_tokens, hits, preempted, drafts, drafts * 3, accepted,
       if(ctx_requests > 0 AND {u(9)} < 0.5, [toFloat32(0.05 + {u(10)} * 1.5)], []),
       arrayWithConstant(gen_requests, toFloat32(elapsed / 1000)), false
FROM (
    SELECT number AS i,
           {shape.start_s * 1_000_000} + toInt64(i * {period_us}) + toInt64({u(1)} * 2000) AS ts_us,
           ts_us / 1e6 AS ts_s,
           {_load('ts_s', str(k))} AS load,
           greatest(1, toUInt32(64 * load * load * (0.9 + 0.2 * {u(2)}))) AS running,
           {u(3)} < 0.02 + 0.06 * load AS has_prefill,
           toUInt32(has_prefill) AS ctx_requests,
           toUInt32(running - ctx_requests) AS gen_requests,
           -- a full chunk fills the token budget beside the decodes (and their draft tokens)
           if(has_prefill, if({u(4)} < 0.35, {BUDGET} - gen_requests * {1 + 3 * spec},
                              128 + toUInt32({u(5)} * 6000)), 0) AS ctx_tokens,
           toUInt32(floor(ctx_tokens * (0.55 + 0.4 * {u(6)}))) AS hits,
           if(load > 0.9, toUInt32({u(7)} * 8), 0) AS waiting,
           toFloat32(least(0.97, 0.15 + 0.7 * load + 0.05 * {u(8)})) AS kv,
           toUInt32(kv > 0.9 AND {u(11)} < 0.001) AS preempted,
           toUInt32({spec} * gen_requests) AS drafts,
           toUInt32(round(drafts * 3 * (0.45 + 0.25 * sin(ts_s / 3600)))) AS accepted,
           {incidents} AND {e} = {CAP_GPU} AND ts_s >= {cap[0]} AND ts_s < {cap[1]} AS capped,
           toFloat32((7 + 0.45 * gen_requests + ctx_tokens * 0.028 + 3 * {u(12)}) * if(capped, 1.6, 1.0)) AS elapsed
    FROM numbers({i0}, {n})
)
WHERE NOT ({incidents} AND {e} = {MONSTER_ENGINE} AND ts_s >= {m0} AND ts_s < {m1})"""


def monster_sql(shape: Shape) -> list[str]:
    """The monster's prefill: every step carries an 8128-token chunk beside 64 decodes, ~5 s a step; then the
    monster request and the short requests that queued behind it."""
    m0, e = shape.monster_start_s, MONSTER_ENGINE
    steps = f"""
INSERT INTO steps ({_columns('steps', upto='is_dummy')})
SELECT fromUnixTimestamp64Micro(toInt64(({m0} + (number + 1) * {MONSTER_STEP_S}) * 1e6), 'UTC'), '{HOST}',
       '{shape.engine(e)}', 0, '{MODEL}', 10000000 + number, toFloat32({MONSTER_STEP_S * 1000} + number % 7 * 13),
       1, least({BUDGET - 64}, {MONSTER_PROMPT} - number * {BUDGET - 64}), 64, 64, 65 + least(number, 30),
       least(number, 30), 0, 0.93, 8128, 0, 0, 0, 0, 0,
       if(number = {MONSTER_STEPS - 1}, [toFloat32({MONSTER_STEPS * MONSTER_STEP_S + 0.2})], []),
       arrayWithConstant(64, toFloat32({MONSTER_STEP_S})), false
FROM numbers({MONSTER_STEPS})"""
    ttft = MONSTER_STEPS * MONSTER_STEP_S + 0.2
    requests = f"""
INSERT INTO requests ({_columns('requests')})
SELECT fromUnixTimestamp64Micro(toInt64((arrival + ttft + decode) * 1e6), 'UTC'), '{HOST}', '{shape.engine(e)}', 0,
       '{MODEL}', id, 'plugin', 'stop', fromUnixTimestamp64Micro(toInt64(arrival * 1e6), 'UTC'), queue, ttft - queue,
       decode, ttft - queue + decode, ttft + decode, ttft, decode / gen, prompt, 0, gen, 4096, 0
FROM (
    SELECT if(number = 0, 'monster-359k', concat('behind-monster-', toString(number))) AS id,
           if(number = 0, {m0} - 0.2, {m0} + number * 5.0) AS arrival,
           if(number = 0, 0.2, {m0} + {ttft} - arrival) AS queue,
           if(number = 0, {ttft}, queue + 0.3) AS ttft,
           if(number = 0, 124, 40) AS gen, gen * 0.03 AS decode,
           if(number = 0, {MONSTER_PROMPT}, 3000) AS prompt
    FROM numbers(31)
)"""
    return [steps, requests]


def requests_sql(shape: Shape, e: int, h: int = 0) -> str:
    """One engine's finished requests: p50 prompt ~3,000 tokens, p50 output ~37, a few >100k prompts. Ids are
    unique per engine, and each row's arrival (part of the table's key) is its finish less its e2e."""
    n = round(shape.seconds * shape.request_rate)
    k = shape.key(e, h)
    u = partial(_u, str(k), "i", offset=100)
    return f"""
INSERT INTO requests ({_columns('requests')})
SELECT fromUnixTimestamp64Micro(toInt64(finish * 1e6), 'UTC'), '{shape.host(h)}', '{shape.engine(e, h)}', 0,
       '{MODEL}',
       concat('req-{e}-', toString(i)), 'plugin', if({u(1)} < 0.9, 'stop', 'length'),
       fromUnixTimestamp64Micro(toInt64((finish - e2e) * 1e6), 'UTC'), queue, prefill, decode, prefill + decode, e2e,
       ttft, tpot, prompt, cached, gen, 4096, 0
FROM (
    SELECT number AS i, {shape.start_s} + (i + {u(2)}) / {shape.request_rate} AS finish,
           {_load('finish', str(k))} AS load,
           sqrt(-2 * log({u(3)} + 1e-9)) AS r,
           if({u(4)} < 0.0005, 100000 + toUInt32({u(5)} * 150000),
              least(250000, toUInt32(3000 * exp(1.3 * r * cos(2 * pi() * {u(6)}))))) AS prompt,
           toUInt32(if({u(7)} < 0.8, prompt * (0.5 + 0.45 * {u(8)}), 0)) AS cached,
           least(4096, greatest(1, toUInt32(37 * exp(0.9 * r * sin(2 * pi() * {u(6)}))))) AS gen,
           0.005 + if(load > 0.85, {u(9)} * 0.5, {u(9)} * 0.02) AS queue,
           (prompt - cached) / 25000 + 0.02 AS prefill,
           queue + prefill AS ttft,
           (7 + 0.45 * 64 * load * load) / 1000 * (0.9 + 0.2 * {u(10)}) AS tpot,
           gen * tpot AS decode, ttft + decode AS e2e
    FROM numbers({n})
)"""


# (metric, kind, label, label value, bucket bound or scale): a realistic subset of one engine's /metrics.
_TTFT_LE = (0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1, 2.5, 5, 7.5, 10, 20, 40, 80, 160, 640)
_ITL_LE = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1, 2.5, 5, 7.5, 10, 20, 40, 80)
_E2E_LE = (0.3, 0.5, 0.8, 1, 1.5, 2, 2.5, 5, 10, 15, 20, 30, 40, 50, 60, 120, 240, 480, 960, 1920, 7680)


def _metric_specs(spec: bool) -> list[tuple[str, str, str, str, float]]:
    specs: list[tuple[str, str, str, str, float]] = [
        ("vllm:num_requests_running", "gauge", "", "", 64.0),
        ("vllm:num_requests_waiting", "gauge", "", "", 8.0),
        ("vllm:kv_cache_usage_perc", "gauge", "", "", 0.7),
        ("vllm:num_requests_waiting_by_reason", "gauge", "reason", "capacity", 6.0),
        ("vllm:num_requests_waiting_by_reason", "gauge", "reason", "deferred", 2.0),
        ("vllm:cache_config_info", "info", "block_size", "16", 1.0),
        ("vllm:prompt_tokens_total", "counter", "", "", 21000.0),
        ("vllm:generation_tokens_total", "counter", "", "", 2600.0),
        ("vllm:prefix_cache_queries_total", "counter", "", "", 21000.0),
        ("vllm:prefix_cache_hits_total", "counter", "", "", 15000.0),
        ("vllm:num_preemptions_total", "counter", "", "", 0.01),
        ("vllm:request_success_total", "counter", "finished_reason", "stop", 2.7),
        ("vllm:request_success_total", "counter", "finished_reason", "length", 0.3),
        ("vllm:request_success_total", "counter", "finished_reason", "abort", 0.0),
    ]
    if spec:
        specs += [("vllm:spec_decode_num_drafts_total", "counter", "", "", 800.0),
                  ("vllm:spec_decode_num_draft_tokens_total", "counter", "", "", 2400.0),
                  ("vllm:spec_decode_num_accepted_tokens_total", "counter", "", "", 1400.0)]
    for name, bounds, scale in (("vllm:time_to_first_token_seconds", _TTFT_LE, 0.4),
                                ("vllm:inter_token_latency_seconds", _ITL_LE, 0.03),
                                ("vllm:e2e_request_latency_seconds", _E2E_LE, 2.0)):
        specs += [(f"{name}_bucket", "bucket", "le", str(le), float(le)) for le in bounds]
        specs += [(f"{name}_bucket", "bucket", "le", "+Inf", math.inf), (f"{name}_sum", "sum", "", "", scale),
                  (f"{name}_count", "count", "", "", 1.0)]
    return specs


def engine_samples_sql(shape: Shape, e: int, h: int = 0) -> str:
    """One engine's scrapes: gauges follow the load, counters its integral, histograms an exponential CDF."""
    n = math.floor(shape.seconds / shape.scrape_s)
    started = shape.start_s - 3600
    specs = ", ".join(f"('{m}', '{k}', '{lk}', '{lv}', {'inf' if math.isinf(p) else p})"
                      for m, k, lk, lv, p in _metric_specs(e in SPEC_ENGINES))
    k = str(shape.key(e, h))
    integral = partial(_load_integral, e=k, start_s=started)
    # Requests finished so far, and in the last scrape interval; a histogram bucket holds count * CDF(le).
    return f"""
INSERT INTO engine_samples ({_columns('engine_samples')})
SELECT fromUnixTimestamp64Micro(toInt64(ts_s * 1e6), 'UTC'), '{shape.host(h)}', '{shape.engine(e, h)}', '0', '{MODEL}',
       spec.1, spec.2, if(spec.3 = '', map(), map(spec.3, spec.4)),
       multiIf(spec.2 = 'gauge', spec.5 * load, spec.2 = 'info', 1, spec.2 = 'counter', spec.5 * so_far,
               spec.2 = 'bucket', 3 * so_far * cdf, spec.2 = 'sum', 3 * so_far * spec.5, 3 * so_far),
       multiIf(spec.2 = 'counter', spec.5 * last, spec.2 = 'bucket', 3 * last * cdf,
               spec.2 = 'sum', 3 * last * spec.5, spec.2 = 'count', 3 * last, 0)
FROM (
    SELECT {shape.start_s} + (number + 1) * {shape.scrape_s} AS ts_s, {_load('ts_s', k)} AS load,
           {integral('ts_s')} AS so_far, so_far - {integral(f'(ts_s - {shape.scrape_s})')} AS last,
           arrayJoin([{specs}]) AS spec,
           if(isInfinite(spec.5), 1, 1 - exp(-spec.5 / multiIf(spec.1 LIKE '%first_token%', 0.4,
                                                               spec.1 LIKE '%inter_token%', 0.03, 2.0))) AS cdf
    FROM numbers({n})
)"""


def gpu_samples_sql(shape: Shape, h: int = 0) -> str:
    """NVML at `gpu_hz` for every GPU of one node; GPU 5 of the first node power-capped for 45 minutes."""
    n = round(shape.seconds * shape.gpu_hz) * shape.engines
    cap = shape.end_s - CAP_FROM_AGO_S, shape.end_s - CAP_TO_AGO_S
    g = "toUInt8(number % " + str(shape.engines) + ")"
    u = partial(_u, "g", "number", offset=200 + 1000 * h)
    host = shape.host(h)
    return f"""
INSERT INTO gpu_samples ({_columns('gpu_samples', upto='processes')})
SELECT fromUnixTimestamp64Micro(toInt64(ts_s * 1e6), 'UTC'), '{host}', concat('{host}:', toString(8000 + g)), g,
       concat('GPU-5f3c7e1a-0000-4000-8000-{h:08d}000', toString(g)), 'NVIDIA H200',
       if(capped, 1250 + 30 * {u(1)}, 1980 - 15 * {u(1)}), 3201, power, toUInt64(ts_s * 1000 * 550),
       40 + 35 * load, 45 + 40 * load, 100 * least(1, load + 0.2), 30 * load,
       toUInt64(130e9), toUInt64(141e9), 2e9 * load, 1.5e9 * load, 0, 60e9 * load, 60e9 * load,
       if(capped, 4, 0), if(capped, ['sw_power_cap'], if(load < 0.15, ['gpu_idle'], [])),
       80 * load, 55 * load, 40 * load, map(toUInt32(4000 + g), toUInt64(130e9))
FROM (
    SELECT number, {g} AS g, {shape.start_s} + intDiv(number, {shape.engines}) / {shape.gpu_hz} AS ts_s,
           {_load('ts_s', f'({h * shape.engines} + g)')} AS load,
           {int(h == 0)} AND ts_s >= {cap[0]} AND ts_s < {cap[1]} AND g = {CAP_GPU} AS capped,
           if(capped, 400 - 3 * {u(2)}, 120 + 560 * load + 20 * {u(2)}) AS power
    FROM numbers({n})
)"""


def host_samples_sql(shape: Shape, h: int = 0) -> str:
    """psutil at 1 Hz: one host row (per-core CPU of 96 cores) and one row per engine process, of one node."""
    per = shape.engines + 1
    host = shape.host(h)
    return f"""
INSERT INTO host_samples ({_columns('host_samples')})
SELECT fromUnixTimestamp64Micro(toInt64(ts_s * 1e6), 'UTC'), '{host}',
       if(k = 0, '', concat('{host}:', toString(7999 + k))), if(k = 0, 'host', 'process'), if(k = 0, 0, 3999 + k),
       20 + 10 * sin(ts_s / 600),
       if(k = 0, arrayWithConstant(96, toFloat32(20 + 10 * sin(ts_s / 600))), []), 12.5, toUInt64(400e9),
       toUInt64(1.6e12), toUInt64(2e12), 0, if(k = 0, 0, toUInt64(30e9)), if(k = 0, 0, 180), if(k = 0, 0, 900),
       map('eth0', toUInt64(ts_s * 1e7)), map('eth0', toUInt64(ts_s * 2e7)), map('eth0', toUInt64(0)),
       toUInt64(ts_s * 1e6), toUInt64(ts_s * 3e6)
FROM (SELECT number % {per} AS k, {shape.start_s} + intDiv(number, {per}) AS ts_s
      FROM numbers({shape.seconds * per}))"""


def events_sql(shape: Shape, h: int = 0) -> str:
    """Start-up (engine_up, engine_config) for every engine of one node, an alert now and then, the first node's
    XID."""
    host = shape.host(h)
    xid_at = shape.end_s - XID_AGO_S
    config = ("map('max_num_batched_tokens', '8192', 'long_prefill_token_threshold', '0', 'max_num_seqs', '64', "
              "'enable_chunked_prefill', 'True')")
    return f"""
INSERT INTO events ({_columns('events')})
SELECT fromUnixTimestamp64Micro(toInt64(ts_s * 1e6), 'UTC'), '{host}', engine, source, kind, severity, message, attrs
FROM (
    SELECT {shape.start_s - 3600} + number % 2 AS ts_s, concat('{host}:', toString(8000 + intDiv(number, 2))) AS engine,
           if(number % 2 = 0, 'vllm_metrics', 'plugin') AS source,
           if(number % 2 = 0, 'engine_up', 'engine_config') AS kind, 'info' AS severity,
           concat(kind, ' ', engine) AS message, if(number % 2 = 0, map(), {config}) AS attrs
    FROM numbers({shape.engines * 2})
    UNION ALL
    SELECT {shape.start_s} + number * 1800 + 7 + {h} AS ts_s,
           concat('{host}:', toString(8000 + number % {shape.engines})),
           'watchdog', 'alert', if(number % 5 = 0, 'warning', 'info'), 'queue deeper than usual', map()
    FROM numbers({math.floor(shape.seconds / 1800)})
    UNION ALL
    SELECT {xid_at}, '{HOST}:8006', 'nvml', 'gpu_xid', 'critical', 'XID 79 on GPU 6: GPU has fallen off the bus',
           map('xid', '79', 'gpu', '6')
    WHERE {int(h == 0)}
)"""


def gateway_decisions_sql(shape: Shape, h: int = 0) -> str:
    """The gateway's decision for every request of one node, read back from `requests` (so they join by id, as a
    gateway that forwards X-Request-Id does: stepline.queries.gateway): decided 3 ms before the engine saw it,
    answered 200 at its first token and ended 2 ms after it finished; the key from a hash of the request id."""
    key = f"cityHash64(request_id, 300) % {KEYS}"
    return f"""
INSERT INTO gateway_decisions (ts, host, engine, gateway, request_id, attempt, lane, candidates, size_tokens,
                               threshold, threshold_unit, health, status, first_byte_ts, end_ts, model, `key`, team,
                               `user`)
SELECT arrival_ts - toIntervalMillisecond(3), host, engine, 'litellm', request_id, 1,
       if(prompt_tokens > {HEAVY_PROMPT}, 'heavy', 'fast'), [engine], prompt_tokens, {HEAVY_PROMPT}, 'tokens',
       'healthy',
       200, arrival_ts + toIntervalMicrosecond(toInt64(ttft_seconds * 1e6)), ts + toIntervalMillisecond(2),
       model_name, concat('key-', toString({key})), concat('team-', toString({key} % {TEAMS})),
       concat('user-', toString({key}))
FROM requests WHERE host = '{shape.host(h)}'"""


def statements(shape: Shape) -> list[tuple[str, str]]:
    """(label, SQL) in the order to run them; a label starts with its table's name."""
    out: list[tuple[str, str]] = []
    nodes = range(shape.hosts)
    for h in nodes:
        for e in range(shape.engines):
            for d, day in enumerate(shape.step_days):
                out.append((f"steps {shape.engine(e, h)} day {d + 1}", steps_sql(shape, e, h, day)))
    if shape.engines > MONSTER_ENGINE:
        out += [(f"{table} monster prefill", sql) for table, sql in zip(("steps", "requests"), monster_sql(shape),
                                                                         strict=True)]
    out += [(f"requests {shape.engine(e, h)}", requests_sql(shape, e, h)) for h in nodes for e in range(shape.engines)]
    out += [(f"engine_samples {shape.engine(e, h)}", engine_samples_sql(shape, e, h))
            for h in nodes for e in range(shape.engines)]
    out += [(f"gpu_samples {shape.host(h)}", gpu_samples_sql(shape, h)) for h in nodes]
    out += [(f"host_samples {shape.host(h)}", host_samples_sql(shape, h)) for h in nodes]
    out += [(f"events {shape.host(h)}", events_sql(shape, h)) for h in nodes]
    out += [(f"gateway_decisions {shape.host(h)}", gateway_decisions_sql(shape, h)) for h in nodes]
    return out


def synthesise(run: Callable[[str, str], object], shape: Shape) -> None:
    """Run every statement through `run(label, sql)`."""
    for label, sql in statements(shape):
        run(label, sql)
