"""What one poll of the GPU source costs: CPU per poll of N GPUs over a fake NVML that answers at once, and the
NVML calls per GPU per poll, by call. The source runs at 10 Hz on a manual clock, so the once-a-second readings
(processes, memory, memory clock, row remapping) and GPM come at their real share of polls.

Target: one poll of 8 GPUs under 1 ms of CPU. A real driver adds its own call latency to the wall time (the device
check measures it); stepline's own cost is what this prints.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time
from collections import Counter

from stepline.core.clock import ManualClock
from stepline.model.rows import Row
from stepline.sources.base import SourceContext
from stepline.sources.gpu.source import GpuSource
from stepline.testing.fake_nvml import FakeGpuState, FakeNvml


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--gpus", type=int, default=8)
    parser.add_argument("--polls", type=int, default=5000)
    parser.add_argument("--hz", type=float, default=10.0)
    args = parser.parse_args()

    clock = ManualClock()
    ctx = SourceContext(platform.node(), clock)
    ctx.engine_processes.found("bench", 4242)
    fake = FakeNvml([FakeGpuState(name="NVIDIA H200", processes={4242: 100 << 30}, pcie_tx_kbs=1 << 20)
                     for _ in range(args.gpus)])
    source = GpuSource(ctx, fake)
    rows: list[Row] = []
    source.poll(rows.extend)  # discovery and the first readings are not a steady poll
    every = 1 / args.hz
    fake.calls.clear()
    cpu_ns: list[int] = []
    for _ in range(args.polls):
        clock.advance(every)
        for state in fake.devices:
            state.advance(every)
            state.nvlink_tx_kib += 1 << 20
        rows.clear()
        start = time.process_time_ns()
        source.poll(rows.extend)
        cpu_ns.append(time.process_time_ns() - start)
    per_gpu: Counter[str] = Counter()
    for (call, index), n in fake.calls.items():
        if index >= 0:
            per_gpu[call] += n / (args.polls * args.gpus)
    global_calls = {call: n / args.polls for (call, index), n in fake.calls.items() if index < 0}
    mean_us, p99_us = statistics.fmean(cpu_ns) / 1000, statistics.quantiles(cpu_ns, n=100)[98] / 1000
    print(f"machine: {platform.platform()}; python {sys.version.split()[0]}")
    print(f"{args.gpus} GPUs, {args.polls} polls at {args.hz:g} Hz (manual clock): CPU per poll mean {mean_us:.0f} us, "
          f"p99 {p99_us:.0f} us; per GPU {mean_us / args.gpus:.0f} us")
    print(f"NVML calls per GPU per poll: {sum(per_gpu.values()):.2f}")
    for call, n in per_gpu.most_common():
        print(f"  {call:24s} {n:.2f}")
    for call, n in sorted(global_calls.items()):
        print(f"  {call:24s} {n:.2f} per poll (not per GPU)")
    print(("ok             " if mean_us < 1000 else "TARGET MISSED  ") + f"one poll of {args.gpus} GPUs costs "
          f"{mean_us:.0f} us of CPU (target < 1000 us)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
