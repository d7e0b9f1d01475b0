"""The GPU device check: what the NVML calls of the GPU source cost and answer on a real GPU, in one run of a few
minutes (under 8). Run it where a GPU is lent: `python3 benchmarks/device_check.py`. It installs nothing; torch, when
importable, drives the load.

It prints, per section:
1. the latency of every NVML call the GPU source makes (stepline's `Nvml` over pynvml), pooled over the GPUs, and
   what each answered;
2. which GPM metrics each GPU returns (asked together and each alone), and what NVML answers when one GPM sample is
   passed as both ends of the interval;
3. the field values the source reads in one nvmlDeviceGetFieldValues call: return code, value, counter width (from
   the value type), the driver's timestamps and how they move between reads;
4. the real `GpuSource` at 10 Hz into an embedded store for `--seconds` (60) while a matmul load (with host-to-device
   copies, so PCIe moves) runs in the middle half: the poll's wall time, and per second and GPU the SM clock, power
   (1 s average and instant), DRAM bandwidth, tensor and SM activity, NVLink and PCIe rates, the clock-event flags;
   every reading reported unsupported; then the PCIe byte counters' change over the run against the bytes the load
   copied (does a PCIe byte counter wrap at 32 bits?).
Without NVML (no library, no driver) it prints one line and exits 0.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Protocol

from prometheus_client import CollectorRegistry

from stepline.core.clock import SystemClock
from stepline.core.texttable import render_table
from stepline.ingest.metrics import IngestMetrics
from stepline.ingest.runner import Runner, Scheduled
from stepline.ingest.writer import Writers
from stepline.sources.base import Emit, SourceContext
from stepline.sources.gpu.nvml import (
    GPM_METRIC_NAMES,
    GPM_METRICS,
    GPM_PCIE_METRICS,
    FieldReading,
    Handle,
    Nvml,
    NvmlError,
    NvmlMissing,
    NvmlUnsupported,
    RealNvml,
)
from stepline.sources.gpu.readings import FIELDS
from stepline.sources.gpu.source import GpuSource
from stepline.store.store import Store

# nvmlReturn_t (nvml.h): the names the answers are printed with.
RETURN_NAMES = {0: "SUCCESS", 1: "UNINITIALIZED", 2: "INVALID_ARGUMENT", 3: "NOT_SUPPORTED", 4: "NO_PERMISSION",
                5: "ALREADY_INITIALIZED", 6: "NOT_FOUND", 7: "INSUFFICIENT_SIZE", 8: "INSUFFICIENT_POWER",
                9: "DRIVER_NOT_LOADED", 10: "TIMEOUT", 11: "IRQ_ISSUE", 12: "LIBRARY_NOT_FOUND",
                13: "FUNCTION_NOT_FOUND", 14: "CORRUPTED_INFOROM", 15: "GPU_IS_LOST", 16: "RESET_REQUIRED",
                17: "OPERATING_SYSTEM", 18: "LIB_RM_VERSION_MISMATCH", 19: "IN_USE", 20: "MEMORY", 21: "NO_DATA",
                22: "VGPU_ECC_NOT_SUPPORTED", 23: "INSUFFICIENT_RESOURCES", 24: "FREQ_NOT_SUPPORTED",
                25: "ARGUMENT_VERSION_MISMATCH", 26: "DEPRECATED", 27: "NOT_READY", 28: "GPU_NOT_FOUND",
                29: "INVALID_STATE", 999: "UNKNOWN"}
CALL_BUDGET_S = 0.5  # the most one call is timed for on one GPU: keeps section 1 under a minute on 8 GPUs
CALL_REPEATS = 200
POLL_HZ = 10.0
GPM_WINDOW_S = 1.0


class Load(Protocol):
    """What runs on the GPUs in the middle half of section 4."""

    def describe(self) -> str: ...
    def start(self) -> None: ...
    def stop(self) -> None: ...
    def copied_bytes(self) -> int:
        """Bytes copied host to device so far (the PCIe counters' receive side should move by at least this)."""


def answer(exc: NvmlError) -> str:
    """An NVML failure as nvml.h names its return code."""
    code = -1 if exc.code is None else exc.code
    return f"{RETURN_NAMES.get(code, 'code')} ({code})"


def width(reading: FieldReading) -> str:
    """The counter width NVML's value type implies: the modulus the value wraps at."""
    return {0: "signed/float", 1 << 16: "16-bit", 1 << 32: "32-bit", 1 << 64: "64-bit"}.get(reading.wrap,
                                                                                          str(reading.wrap))


def micros(seconds: Sequence[float]) -> tuple[str, str, str]:
    """Median, p99 and max of call times, in microseconds."""
    us = sorted(s * 1e6 for s in seconds)
    p99 = us[min(len(us) - 1, round(0.99 * (len(us) - 1)))]
    return f"{statistics.median(us):.1f}", f"{p99:.1f}", f"{us[-1]:.1f}"


@dataclass
class Timing:
    """One call's times pooled over GPUs, and what it answered on each."""

    seconds: list[float] = field(default_factory=list)
    answers: dict[str, list[int]] = field(default_factory=dict)  # answer -> GPU indexes (-1: no device's)

    def time(self, index: int, call: Callable[[], object], repeats: int = CALL_REPEATS,
             budget_s: float = CALL_BUDGET_S) -> None:
        """Call `repeats` times (at most `budget_s`); an unsupported call is asked once, as the source does."""
        deadline = time.perf_counter() + budget_s
        errors: dict[str, int] = {}
        ok = 0
        for _ in range(repeats):
            start = time.perf_counter()
            try:
                call()
            except NvmlUnsupported as exc:
                self.seconds.append(time.perf_counter() - start)
                errors[answer(exc)] = errors.get(answer(exc), 0) + 1
                break
            except NvmlError as exc:
                errors[answer(exc)] = errors.get(answer(exc), 0) + 1
            else:
                ok += 1
            self.seconds.append(time.perf_counter() - start)
            if time.perf_counter() > deadline:
                break
        said = [f"{name} x{n}" for name, n in errors.items()] + (["ok"] if ok else [])
        self.answers.setdefault(", ".join(said), []).append(index)


def _answered(answers: Mapping[str, list[int]]) -> str:
    if len(answers) == 1:
        return next(iter(answers))
    return "; ".join(f"GPU {','.join(map(str, sorted(gpus)))}: {said}" for said, gpus in answers.items())


def device_calls(nvml: Nvml) -> list[tuple[str, Callable[[Handle], object]]]:
    """Every per-device call the source makes (sources/gpu/readings.py, health.py), as it makes them."""
    fields = [(fid, scope) for _, fid, scope in FIELDS]
    return [
        ("uuid", nvml.uuid), ("name", nvml.name),
        ("clock_mhz sm", lambda h: nvml.clock_mhz(h, "sm")), ("clock_mhz mem", lambda h: nvml.clock_mhz(h, "mem")),
        ("power_mw", nvml.power_mw), ("energy_mj", nvml.energy_mj),
        ("temperature_c gpu", lambda h: nvml.temperature_c(h, "gpu")),
        ("temperature_c memory", lambda h: nvml.temperature_c(h, "memory")),
        ("utilization", nvml.utilization), ("memory", nvml.memory), ("pcie_replay_counter", nvml.pcie_replay_counter),
        (f"field_values ({len(fields)} fields)", lambda h: nvml.field_values(h, fields)),
        ("remapped_rows", nvml.remapped_rows), ("clock_event_reasons", nvml.clock_event_reasons),
        ("processes", nvml.processes), ("gpm_supported", nvml.gpm_supported), ("gpm_sample", nvml.gpm_sample),
    ]


def section_latency(nvml: Nvml, handles: Sequence[Handle], gpm: Sequence[bool], out: Callable[[str], None],
                    init_s: float) -> None:
    """1. Per-call latency of every NVML call the source makes."""
    calls: dict[str, Timing] = {}

    def timing(name: str) -> Timing:
        return calls.setdefault(name, Timing())

    timing("init").seconds.append(init_s)
    timing("init").answers["ok"] = [-1]
    timing("device_count").time(-1, nvml.device_count)
    timing("driver_version").time(-1, nvml.driver_version)
    for index, h in enumerate(handles):
        timing("handle").time(index, partial(nvml.handle, index))
        for name, call in device_calls(nvml):
            if name == "gpm_sample" and not gpm[index]:
                continue
            timing(name).time(index, partial(call, h))
        if gpm[index]:
            a, b = nvml.gpm_sample(h), nvml.gpm_sample(h)
            timing(f"gpm_metrics ({len(GPM_METRICS)} metrics)").time(index, partial(nvml.gpm_metrics, a, b,
                                                                                     GPM_METRICS))
        timing("register_xid_events").time(index, partial(nvml.register_xid_events, h), repeats=1)
    timing("wait_xid(0)").time(-1, partial(nvml.wait_xid, 0))
    timing("clear_xid_events").time(-1, nvml.clear_xid_events, repeats=1)
    rows = [(name, sum(len(g) for g in t.answers.values()), len(t.seconds), *micros(t.seconds), _answered(t.answers))
            for name, t in calls.items() if t.seconds]
    out("== 1. NVML call latency (pooled over GPUs; -1 = no device's call) ==")
    out(render_table(("call", "gpus", "n", "median us", "p99 us", "max us", "answered"), rows, max_width=90))


def section_gpm(nvml: Nvml, handles: Sequence[Handle], gpm: Sequence[bool], out: Callable[[str], None]) -> None:
    """2. The GPM metrics each GPU returns, and one sample passed twice."""
    out(f"\n== 2. GPM metrics over {GPM_WINDOW_S:g} s (asked together, then each alone) ==")
    firsts = {i: nvml.gpm_sample(h) for i, h in enumerate(handles) if gpm[i]}
    for i in range(len(handles)):
        if not gpm[i]:
            out(f"GPU {i}: gpm_supported is false: no GPM")
    if not firsts:
        return
    time.sleep(GPM_WINDOW_S)
    wanted = GPM_METRICS + GPM_PCIE_METRICS
    rows: list[tuple[object, ...]] = []
    for i, first in firsts.items():
        second = nvml.gpm_sample(handles[i])
        try:
            together = ", ".join(f"{v.value:.2f}" if v.code == 0 else RETURN_NAMES.get(v.code, str(v.code))
                                 for v in nvml.gpm_metrics(first, second, wanted))
        except NvmlError as exc:
            together = f"the whole call failed: {answer(exc)}"
        out(f"GPU {i} together: {together}")
        for metric in wanted:
            try:
                got = nvml.gpm_metrics(first, second, (metric,))[0]
                said = f"{got.value:.2f}" if got.code == 0 else f"{RETURN_NAMES.get(got.code, got.code)} ({got.code})"
            except NvmlError as exc:
                said = f"call failed: {answer(exc)}"
            rows.append((i, metric, GPM_METRIC_NAMES[metric], said))
        try:
            twice = nvml.gpm_metrics(second, second, GPM_METRICS)
            said = ", ".join(f"{GPM_METRIC_NAMES[m]}={v.value:.2f}" if v.code == 0
                             else f"{GPM_METRIC_NAMES[m]}={RETURN_NAMES.get(v.code, v.code)}"
                             for m, v in zip(GPM_METRICS, twice, strict=True))
        except NvmlError as exc:
            said = f"raises {answer(exc)}"
        out(f"GPU {i}: one GPM sample passed twice: {said}")
    out(render_table(("gpu", "metric", "name", "value (%, MiB/s) or answer"), rows))


def section_fields(nvml: Nvml, handles: Sequence[Handle], out: Callable[[str], None]) -> dict[int, dict[str, float]]:
    """3. The source's field values: codes, widths, timestamps. Returns each GPU's counter values by reading."""
    out("\n== 3. Field values (one nvmlDeviceGetFieldValues call, as the source makes it) ==")
    fields = [(fid, scope) for _, fid, scope in FIELDS]
    values: dict[int, dict[str, float]] = {}
    rows: list[tuple[object, ...]] = []
    for i, h in enumerate(handles):
        try:
            first = nvml.field_values(h, fields)
            time.sleep(0.1)
            second = nvml.field_values(h, fields)
            time.sleep(1.0)
            third = nvml.field_values(h, fields)
        except NvmlError as exc:
            out(f"GPU {i}: field_values failed: {answer(exc)}")
            continue
        values[i] = {}
        for (reading, fid, scope), a, b, c in zip(FIELDS, first, second, third, strict=True):
            if c.code:
                rows.append((i, reading, fid, scope, RETURN_NAMES.get(c.code, c.code), "", "", "", "", ""))
                continue
            values[i][reading] = c.value
            rows.append((i, reading, fid, scope, "ok", f"{c.value:.0f}", width(c), c.timestamp_us,
                         f"{(b.timestamp_us - a.timestamp_us) / 1000:.1f}",
                         f"{(c.timestamp_us - b.timestamp_us) / 1000:.1f} ({c.value - b.value:+.0f})"))
        stamps = {r.timestamp_us for r in third if r.code == 0}
        out(f"GPU {i}: {len(stamps)} distinct timestamps among the fields of one call")
        for reading in ("pcie_tx", "pcie_rx"):
            got = dict(zip((f[0] for f in FIELDS), third, strict=True))[reading]
            if got.code == 0:
                past = "above 2**32 now: the counter is wider than 32 bits" if got.value >= 1 << 32 else \
                    "below 2**32 now: section 4 tells whether it wraps there"
                out(f"GPU {i}: {reading} is a {width(got)} value type; {past}")
    out(render_table(("gpu", "reading", "field", "scope", "code", "value", "width", "timestamp us",
                      "ts +100ms read, ms", "ts +1s read, ms (value change)"), rows))
    return values


@dataclass
class TimedSource:
    """The GPU source with every poll's wall time kept."""

    source: GpuSource
    seconds: list[float] = field(default_factory=list)

    @property
    def name(self) -> str:
        return self.source.name

    def poll(self, emit: Emit) -> None:
        start = time.perf_counter()
        try:
            self.source.poll(emit)
        finally:
            self.seconds.append(time.perf_counter() - start)

    def retry_in_s(self) -> float:
        return self.source.retry_in_s()

    def stats(self) -> Mapping[str, int]:
        return self.source.stats()


PER_SECOND = """
SELECT toUnixTimestamp(toStartOfSecond(ts)) - {t0:Int64} AS s, gpu_index,
       if(s + 1 > {load_from:Float64} AND s < {load_to:Float64}, 'on', '') AS load, count() AS n,
       round(avg(sm_clock_mhz)) AS sm_mhz, round(avg(power_w), 1) AS power_avg_w,
       round(avg(power_instant_w), 1) AS power_instant_w, round(avg(dram_bw_util_pct), 1) AS dram_bw_pct,
       round(avg(tensor_active_pct), 1) AS tensor_pct, round(avg(sm_active_pct), 1) AS sm_active_pct,
       round(avg(nvlink_tx_bytes_per_s + nvlink_rx_bytes_per_s) / 1e9, 3) AS nvlink_gb_s,
       round(avg(pcie_rx_bytes_per_s) / 1e9, 3) AS pcie_rx_gb_s,
       round(avg(pcie_tx_bytes_per_s) / 1e9, 3) AS pcie_tx_gb_s,
       arrayStringConcat(arraySort(groupUniqArrayArray(clock_event_flags)), ',') AS flags
FROM gpu_samples WHERE host = {host:String} GROUP BY s, gpu_index ORDER BY s, gpu_index"""


def section_run(nvml: Nvml, load: Load | None, seconds: float, store_url: str, out: Callable[[str], None]) -> None:
    """4. The real GPU source at 10 Hz into an embedded store, with the load in the middle half."""
    out(f"\n== 4. GpuSource at {POLL_HZ:g} Hz for {seconds:g} s into {store_url.split('?')[0]}; load: "
        f"{load.describe() if load else 'none (no torch with CUDA here)'} from {seconds / 4:g} s to "
        f"{seconds * 3 / 4:g} s ==")
    store = Store.open(store_url)
    store.ensure_schema(30)
    host = platform.node()
    metrics = IngestMetrics(CollectorRegistry())
    writers = Writers(store, metrics, flush_interval_s=0.5)
    source = TimedSource(GpuSource(SourceContext(host, SystemClock()), nvml))
    runner = Runner([Scheduled(source, 1 / POLL_HZ)], writers, metrics, host)
    t0 = int(time.time())
    begun = time.monotonic()
    load_from = time.time() - t0 + seconds / 4  # wall seconds after t0, for the table's load column
    writers.start()
    runner.start()
    try:
        time.sleep(seconds / 4)
        if load is not None:
            load.start()
        time.sleep(max(0.0, begun + seconds * 3 / 4 - time.monotonic()))
        if load is not None:
            load.stop()
        time.sleep(max(0.0, begun + seconds - time.monotonic()))
    finally:
        runner.stop()
        source.source.close()
        writers.stop()
    polls = source.seconds
    if polls:
        median, p99, worst = micros(polls)
        out(f"{len(polls)} polls: wall time median {median} us, p99 {p99} us, max {worst} us; stats "
            f"{dict(source.stats())}")
    window = {"load_from": load_from, "load_to": load_from + seconds / 2} if load else {"load_from": 0, "load_to": 0}
    rows = store.query(PER_SECOND, {"t0": t0, "host": host, **window})
    out(render_table(rows.column_names, [list(r) for r in rows.result_rows], max_width=80))
    unsupported = store.query("SELECT message FROM events WHERE host = {host:String} AND kind = "
                              "'gpu_reading_unsupported' ORDER BY ts", {"host": host}).result_rows
    out(f"readings reported unsupported: {len(unsupported)}")
    for (message,) in unsupported:
        out(f"  {message}")
    store.close()


def section_wrap(before: Mapping[int, Mapping[str, float]], after: Mapping[int, Mapping[str, float]],
                 load: Load | None, out: Callable[[str], None]) -> None:
    """The PCIe byte counters' change over section 4 against what the load copied host to device."""
    # The load runs the same rounds on every GPU, so each received about its share (CUDA's device order need not be
    # NVML's, so the share is all that can be compared).
    copied = (load.copied_bytes() if load is not None else 0) / max(1, len(after))
    out(f"\n== PCIe byte counters over section 4 (the load copied about {copied / 2**30:.2f} GiB host to device "
        "per GPU) ==")
    for i, now in after.items():
        for reading in ("pcie_tx", "pcie_rx"):
            if reading in now and reading in before.get(i, {}):
                moved = now[reading] - before[i][reading]
                verdict = ("went back: it wrapped" if moved < 0 else
                           "moved less than 4 GiB although more was copied: suspect a 32-bit wrap"
                           if reading == "pcie_rx" and copied > 1 << 32 and moved < 1 << 32 else "no wrap seen")
                out(f"GPU {i} {reading}: {moved / 2**30:+.2f} GiB ({before[i][reading]:.0f} -> {now[reading]:.0f}): "
                    f"{verdict}")


class TorchLoad:
    """bf16 matmuls on every visible CUDA device, each round with a host-to-device copy from pinned memory."""

    def __init__(self, torch: Any, size: int = 8192, copy_mib: int = 256) -> None:
        self._torch = torch
        self._devices = [torch.device("cuda", i) for i in range(torch.cuda.device_count())]
        self._mats = [torch.randn(size, size, device=d, dtype=torch.bfloat16) for d in self._devices]
        self._host = torch.empty(copy_mib << 20, dtype=torch.uint8).pin_memory()
        self._copy_bytes = copy_mib << 20
        self._size = size
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._copied = [0] * len(self._devices)

    def describe(self) -> str:
        return (f"torch {self._torch.__version__}: {self._size}x{self._size} bf16 matmuls and a "
                f"{self._copy_bytes >> 20} MiB host-to-device copy per round on {len(self._devices)} CUDA device(s)")

    def start(self) -> None:
        self._stop.clear()
        self._threads = [threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(len(self._devices))]
        for thread in self._threads:
            thread.start()

    def stop(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join()

    def copied_bytes(self) -> int:
        return sum(self._copied)

    def _run(self, i: int) -> None:
        torch, device, mat = self._torch, self._devices[i], self._mats[i]
        with torch.cuda.device(device):
            while not self._stop.is_set():
                for _ in range(10):
                    mat @ mat
                self._host.to(device, non_blocking=True)
                torch.cuda.synchronize(device)
                self._copied[i] += self._copy_bytes


def torch_load() -> Load | None:
    """The matmul load, or None where torch (or CUDA) is not there."""
    try:
        import torch
    except ImportError:
        return None
    if not torch.cuda.is_available():
        return None
    return TorchLoad(torch)


def run(nvml: Nvml, *, seconds: float, store_url: str, load: Callable[[], Load | None],
        out: Callable[[str], None] = print) -> int:
    """Every section against `nvml`; one line and 0 where there is no NVML or no GPU."""
    start = time.perf_counter()
    try:
        nvml.init()
    except (NvmlMissing, ImportError) as exc:
        out(f"device check: no NVML here ({exc}): nothing to check without an NVIDIA driver")
        return 0
    init_s = time.perf_counter() - start
    count = nvml.device_count()
    if not count:
        nvml.shutdown()
        out("device check: NVML answers but shows no GPU: nothing to check")
        return 0
    handles = [nvml.handle(i) for i in range(count)]
    names = [nvml.name(h) for h in handles]
    out(f"device check on {platform.node()}: {count} GPU(s) {', '.join(names)}; driver {nvml.driver_version()}; "
        f"python {sys.version.split()[0]}")
    gpm = []
    for h in handles:
        try:
            gpm.append(nvml.gpm_supported(h))
        except NvmlError:
            gpm.append(False)
    section_latency(nvml, handles, gpm, out, init_s)
    section_gpm(nvml, handles, gpm, out)
    before = section_fields(nvml, handles, out)
    nvml.shutdown()
    the_load = load()
    section_run(nvml, the_load, seconds, store_url, out)
    nvml.init()
    after = {i: {reading: r.value for (reading, _, _), r in zip(FIELDS, nvml.field_values(
        nvml.handle(i), [(fid, scope) for _, fid, scope in FIELDS]), strict=True) if r.code == 0}
        for i in range(count)}
    nvml.shutdown()
    section_wrap(before, after, the_load, out)
    out(f"\ndevice check done in {time.perf_counter() - start:.0f} s")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=60.0, help="length of section 4 (default 60)")
    parser.add_argument("--store", help="store URL for section 4 (default: an embedded store in a temporary folder)")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="stepline-device-check-") as folder:
        return run(RealNvml(), seconds=args.seconds, store_url=args.store or f"chdb://{folder}", load=torch_load)


if __name__ == "__main__":
    sys.exit(main())
