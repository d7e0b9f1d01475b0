"""`stepline timeline --around T`: engine steps and GPU counters side by side, ±30 s around a moment."""

from __future__ import annotations

import math
from datetime import UTC, datetime, timedelta

from stepline.core.usageerror import UsageError
from stepline.model.schema import timeline_sql
from stepline.queries.query import moment
from stepline.store.reads import Reads, named

MAX_WINDOW_S = 7 * 86400.0  # a week each side: a larger window is a query, not a timeline
# The GPU side is read from a little before the window so the first steps find their sample.
_BOUNDS_STEPS = (f" AND s.ts >= {moment('from_us')}"
                 f" AND s.ts <= {moment('to_us')}"
                 " AND ({engine:String} = '' OR s.engine = {engine:String})")
_BOUNDS_GPU = (" AND ts >= fromUnixTimestamp64Micro({from_us:Int64} - 10000000, 'UTC')"
               f" AND ts <= {moment('to_us')}")
# The view joins steps to their engine's GPUs, so an engine with no GPU sample (a CPU engine, a host without
# NVML, samples not attributed to it) would vanish: its steps are added with empty GPU columns.
def _steps_without_gpu(database: str) -> str:
    db = f"`{database}`." if database else ""
    return f"""
SELECT s.ts AS ts, s.host AS host, s.engine AS engine, s.engine_index AS engine_index, s.step AS step,
       s.elapsed_ms AS elapsed_ms, s.num_ctx_tokens AS prefill_tokens, s.num_generation_requests AS decoding,
       s.running AS running, s.waiting AS waiting, s.kv_cache_usage AS kv_cache_usage,
       CAST(NULL, 'Nullable(UInt8)') AS gpu_index, NULL AS gpu_ts, NULL AS sm_clock_mhz, NULL AS power_w,
       NULL AS dram_bw_util_pct, NULL AS tensor_active_pct, NULL AS util_gpu_pct, NULL AS nvlink_bytes_per_s,
       CAST([], 'Array(LowCardinality(String))') AS clock_event_flags
FROM {db}steps AS s
WHERE (s.host, s.engine) GLOBAL NOT IN (SELECT DISTINCT host, engine FROM {db}gpu_samples WHERE engine != ''
                                        {_BOUNDS_GPU})
{_BOUNDS_STEPS}"""


def parse_moment(text: str, now: datetime | None = None) -> datetime:
    """ISO 8601 (UTC unless it says otherwise), epoch seconds, or HH:MM[:SS] today (UTC)."""
    text = text.strip()
    try:
        return datetime.fromtimestamp(float(text), UTC)
    except (ValueError, OverflowError, OSError):  # not a number, or one no date has (nan, inf, 1e20)
        pass
    for layout in ("%H:%M:%S", "%H:%M"):
        try:
            clock = datetime.strptime(text, layout).time()
        except ValueError:
            continue
        return datetime.combine((now or datetime.now(UTC)).date(), clock, UTC)
    try:
        moment = datetime.fromisoformat(text)
    except ValueError:
        raise UsageError(f"time {text!r} is not ISO 8601, epoch seconds or HH:MM:SS") from None
    return moment if moment.tzinfo else moment.replace(tzinfo=UTC)


def around(reader: Reads, database: str, moment: datetime, *, window_s: float = 30.0, engine: str = "",
           bucket_s: float = 1.0) -> str:
    """The timeline from window_s before to window_s after `moment`, per bucket_s (0: every step)."""
    if not 0 < window_s <= MAX_WINDOW_S:
        raise UsageError(f"window {window_s} s must be more than 0 and at most {MAX_WINDOW_S:.0f} s")
    if not 0 <= bucket_s <= 2 * window_s:
        raise UsageError(f"bucket {bucket_s} s must be 0 (every step) or at most twice the window")
    try:
        lo, hi = moment - timedelta(seconds=window_s), moment + timedelta(seconds=window_s)
    except OverflowError:
        raise UsageError(f"{window_s} s around {moment:%Y-%m-%d %H:%M:%S} leaves the calendar") from None
    inner = timeline_sql(database, _BOUNDS_STEPS, _BOUNDS_GPU) + "\nUNION ALL" + _steps_without_gpu(database)
    if bucket_s > 0:
        sql = ("SELECT toStartOfInterval(ts, toIntervalMillisecond({bucket_ms:UInt64})) AS t, engine, gpu_index,"
               " count() AS steps, max(elapsed_ms) AS step_max_ms, sum(prefill_tokens) AS prefill,"
               " round(avg(decoding)) AS decoding, avg(sm_clock_mhz) AS sm_mhz, avg(power_w) AS power,"
               " avg(dram_bw_util_pct) AS dram, avg(tensor_active_pct) AS tensor,"
               " arrayStringConcat(arrayDistinct(arrayFlatten(groupArray(clock_event_flags))), ',') AS flags"
               f" FROM ({inner}) GROUP BY t, engine, gpu_index ORDER BY t, engine, gpu_index")
    else:
        sql = (f"SELECT ts AS t, engine, gpu_index, 1 AS steps, elapsed_ms AS step_max_ms, prefill_tokens AS prefill,"
               " decoding, sm_clock_mhz AS sm_mhz, power_w AS power, dram_bw_util_pct AS dram,"
               " tensor_active_pct AS tensor, arrayStringConcat(clock_event_flags, ',') AS flags"
               f" FROM ({inner}) ORDER BY t, engine, gpu_index")
    parameters = {"from_us": _us(lo), "to_us": _us(hi), "engine": engine, "bucket_ms": max(1, round(bucket_s * 1000))}
    rows = named(reader.query(sql, parameters=parameters))
    if not rows:
        return (f"no engine steps between {lo:%H:%M:%S} and {hi:%H:%M:%S} UTC"
                + (f" for engine {engine}" if engine else "") + " (steps come from the plugin)")
    lines = [f"{'time (UTC)':<12} {'engine':<12} {'gpu':>3} {'steps':>5} {'step max':>9} {'prefill':>8} "
             f"{'decoding':>8} {'SM MHz':>7} {'power W':>7} {'DRAM %':>6} {'tensor %':>8}  clock events"]
    for r in rows:
        t, eng, gpu, steps, step_max, prefill, decoding, sm, power, dram, tensor, flags = (
            r.t, r.engine, r.gpu_index, r.steps, r.step_max_ms, r.prefill, r.decoding, r.sm_mhz, r.power, r.dram,
            r.tensor, r.flags)
        lines.append(f"{t:%H:%M:%S.%f}"[:12] + f" {eng[:12]:<12} {_n(gpu):>3} {steps:>5} {step_max:>7.0f}ms"
                     f" {prefill:>8} {decoding:>8.0f} {_n(sm):>7} {_n(power):>7} {_n(dram):>6} {_n(tensor):>8}"
                     f"  {flags or '-'}")
    return "\n".join(lines)


def _us(moment: datetime) -> int:
    return round(moment.timestamp() * 1_000_000)


def _n(value: float | None) -> str:
    return "-" if value is None or math.isnan(value) else f"{value:.0f}"
