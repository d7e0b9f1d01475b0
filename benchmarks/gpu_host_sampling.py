"""What sampling costs: 8 GPUs at 10 Hz through the real GPU source (over a fake NVML that answers at once)
plus the host at 1 Hz through the real host source and real psutil, as CPU seconds per wall second.

Target: under 3% of one core. The fake NVML isolates stepline's own cost; a real driver adds its call latency.
"""

from __future__ import annotations

import argparse
import os
import platform
import resource
import sys
import time
from collections.abc import Iterable

from stepline.core.clock import SystemClock
from stepline.model.rows import Row
from stepline.sources.base import SourceContext
from stepline.sources.gpu.source import GpuSource
from stepline.sources.host import EngineTarget, HostSource
from stepline.testing.fake_nvml import FakeGpuState, FakeNvml


def _cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--gpus", type=int, default=8)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--gpu-hz", type=float, default=10.0)
    parser.add_argument("--host-hz", type=float, default=1.0)
    args = parser.parse_args()

    ctx = SourceContext(platform.node(), SystemClock())
    ctx.engine_processes.found("bench", os.getpid())
    fake = FakeNvml([FakeGpuState(name="NVIDIA H200", processes={os.getpid(): 100 << 30}) for _ in range(args.gpus)])
    gpu = GpuSource(ctx, fake)
    host = HostSource(ctx, engines=[EngineTarget("bench", pid=os.getpid())])
    rows = 0

    def emit(batch: Iterable[Row]) -> None:
        nonlocal rows
        rows += sum(1 for _ in batch)

    gpu.poll(emit)
    host.poll(emit)  # first polls prime handles and CPU counters
    rows = 0
    gpu_every, host_every = 1 / args.gpu_hz, 1 / args.host_hz
    start_wall, start_cpu = time.monotonic(), _cpu_s()
    next_gpu = next_host = start_wall
    gpu_polls = host_polls = 0
    while (now := time.monotonic()) - start_wall < args.seconds:
        if now >= next_gpu:
            for state in fake.devices:
                state.advance(gpu_every)
                state.nvlink_tx_kib += 1 << 20
            gpu.poll(emit)
            gpu_polls += 1
            next_gpu += gpu_every
        if now >= next_host:
            host.poll(emit)
            host_polls += 1
            next_host += host_every
        time.sleep(max(0.0, min(next_gpu, next_host) - time.monotonic()))
    wall, cpu = time.monotonic() - start_wall, _cpu_s() - start_cpu
    share = cpu / wall
    print(f"machine: {platform.platform()}; python {sys.version.split()[0]}; cpu_count={os.cpu_count()}")
    print(f"{args.gpus} GPUs at {args.gpu_hz:g} Hz ({gpu_polls} passes) + host at {args.host_hz:g} Hz "
          f"({host_polls} passes) for {wall:.1f} s")
    print(f"rows/s: {rows / wall:.0f}   CPU: {cpu:.3f} s over {wall:.1f} s = {share:.2%} of one core "
          f"(includes the sleeping loop)")
    print(("ok             " if share < 0.03 else "TARGET MISSED  ") + f"sampling costs {share:.2%} of one core "
          "(target < 3%)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
