"""A large result through the collector's query endpoint: rows/s against chDB answering in-process, and the
serving process's memory while it streams.

The endpoint runs in a process of its own, as inside `stepline collect` (an embedded store, the read-only
HTTP endpoint); this process reads each response in 1 MiB pieces and throws them away, while a sampler reads
the endpoint process's RSS every 50 ms. The baseline is chDB in another process streaming the same query
(`send_query`, every block's bytes touched) on a store of its own, measured in the same run.

    python benchmarks/query_stream.py            # ~1 min on 2 cores; --rows N --rounds R --formats Native,TSV
    python benchmarks/query_stream.py --checks   # the read-only checks' cost per dashboard query, against BASE

--checks: what the read-only machinery costs a small query (the engine's profile, the Host check, the watch that
kills an abandoned query, and ClickHouse's parser reading a query's SETTINGS when it has any): two endpoints
serve the same store content side by side, this tree's and the code at --base (the endpoint before the engine
enforced read-only), each in a process of its own; dashboard-sized queries alternate between them on kept-alive
connections, and the p50/p99 of each are compared.
"""

from __future__ import annotations

import argparse
import http.client
import itertools
import multiprocessing
import os
import platform
import resource
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
from collections.abc import Sequence
from multiprocessing.connection import Connection
from typing import Any, cast

import psutil  # type: ignore[import-untyped]

TARGET_RATIO = 0.8


def query_sql(rows: int) -> str:
    return f"SELECT number, toString(number) AS s, number * 0.5 AS x FROM numbers({rows})"


def serve(pipe: Connection) -> None:
    """The endpoint's process: an embedded store and its query endpoint, until told to stop."""
    from stepline.endpoints.query import QueryEndpoint
    from stepline.store.chdb import open_client

    path = tempfile.mkdtemp(prefix="stepline-bench-")
    client = open_client(path)
    client.command("CREATE DATABASE IF NOT EXISTS stepline")
    endpoint = QueryEndpoint(client, port=0, max_execution_time_s=600, max_result_bytes=8 << 30)
    endpoint.start()
    pipe.send(endpoint.port)
    pipe.recv()
    endpoint.stop()


def in_process(pipe: Connection, sql: str, fmt: str) -> None:
    """The baseline: chDB streaming the query in-process; (seconds, bytes)."""
    import chdb

    conn: Any = cast(Any, chdb).connect(tempfile.mkdtemp(prefix="stepline-bench-base-"))
    started, cpu = time.perf_counter(), time.process_time()
    size = 0
    for block in conn.send_query(sql, fmt):
        size += len(block.bytes())
    pipe.send((time.perf_counter() - started, size, time.process_time() - cpu))
    conn.close()


def baseline(sql: str, fmt: str) -> tuple[float, int, float]:
    """(seconds, bytes, CPU seconds) of chDB streaming the query in a process of its own."""
    ours, theirs = multiprocessing.Pipe()
    child = multiprocessing.Process(target=in_process, args=(theirs, sql, fmt))
    child.start()
    result: tuple[float, int, float] = ours.recv()
    child.join()
    return result


class Peak:
    """The highest RSS of a process, sampled every 50 ms while running."""

    def __init__(self, pid: int) -> None:
        self._process = psutil.Process(pid)
        self.mib = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def __enter__(self) -> Peak:
        self._cpu = sum(self._process.cpu_times()[:2])
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join()
        self.cpu_s = sum(self._process.cpu_times()[:2]) - self._cpu

    def _sample(self) -> None:
        while not self._stop.is_set():
            self.mib = max(self.mib, self._process.memory_info().rss / 2**20)
            self._stop.wait(0.05)


def through_curl(port: int, sql: str, fmt: str) -> tuple[float, int, float]:
    """(seconds to the last byte, body bytes, seconds to the first byte), read by curl into /dev/null: a client
    that costs next to nothing, so the endpoint's own cost is what is measured."""
    url = f"http://127.0.0.1:{port}/?" + urllib.parse.urlencode({"default_format": fmt})
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    out = subprocess.run(["curl", "-sS", "--fail-with-body", "-o", "/dev/null", "--data-binary", sql, "-w",
                          "%{time_total} %{size_download} %{time_starttransfer}", url],
                         capture_output=True, text=True, check=True).stdout.split()
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    client_cpu[0] = (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)
    return float(out[0]), int(out[1]), float(out[2])


client_cpu = [0.0]  # CPU seconds the last curl run took (its reads off the socket count against the cores too)


def through_endpoint(port: int, sql: str, fmt: str) -> tuple[float, int, float]:
    """(seconds to the last byte, body bytes, seconds to the first byte) for one query over HTTP."""
    if shutil.which("curl"):
        return through_curl(port, sql, fmt)
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    started = time.perf_counter()
    conn.request("POST", "/?" + urllib.parse.urlencode({"default_format": fmt}), body=sql.encode())
    response = conn.getresponse()
    if response.status != 200:
        raise SystemExit(f"query endpoint answered {response.status}: {response.read()[:300]!r}")
    first = 0.0
    size = 0
    while piece := response.read(1 << 20):
        if not size:
            first = time.perf_counter() - started
        size += len(piece)
    elapsed = time.perf_counter() - started
    conn.close()
    return elapsed, size, first


# One endpoint, from whichever tree PYTHONPATH puts first, on a store of its own with a small steps-like table.
_CHECKS_SERVER = """
import sys, tempfile
from stepline.endpoints.query import QueryEndpoint
from stepline.store.chdb import open_client
path = tempfile.mkdtemp(prefix="stepline-bench-checks-")
client = open_client(path)
client.command("CREATE DATABASE IF NOT EXISTS stepline")
client.command("CREATE TABLE stepline.steps ENGINE = MergeTree ORDER BY ts AS SELECT toDateTime64('2026-01-01', 6) "
               "+ number / 100 AS ts, 'vllm-0' AS engine, rand() % 1000 / 1000 AS step_s FROM numbers(20000)")
endpoint = QueryEndpoint(client, port=0)
endpoint.start()
print(endpoint.port, flush=True)
sys.stdin.read()
endpoint.stop()
"""
CHECKS_TARGET_MS = 1.0  # p99 added per dashboard query
# A time-series panel's shape, without and with a SETTINGS clause (ClickHouse's parser reads it). Its time bound
# moves each time ({n}), as Grafana's macros move with the clock: no text is seen twice.
DASHBOARD_SQL = {
    "panel": "SELECT toStartOfInterval(ts, INTERVAL 10 second) AS t, quantile(0.99)(step_s) FROM steps "
             "WHERE engine = 'vllm-0' AND ts >= toDateTime64('2026-01-01 00:05:00', 6) + {n} / 1000 "
             "GROUP BY t ORDER BY t",
    "panel+SETTINGS": "SELECT toStartOfInterval(ts, INTERVAL 10 second) AS t, quantile(0.99)(step_s) FROM steps "
                      "WHERE engine = 'vllm-0' AND ts >= toDateTime64('2026-01-01 00:05:00', 6) + {n} / 1000 "
                      "GROUP BY t ORDER BY t SETTINGS max_threads = 2",
}


def _tree(ref: str) -> str:
    """The collector package at git `ref`, extracted into a temporary folder (its path for PYTHONPATH)."""
    root = subprocess.run(["git", "rev-parse", "--show-toplevel"], capture_output=True, text=True,
                          check=True).stdout.strip()
    out = tempfile.mkdtemp(prefix="stepline-bench-base-")
    archive = subprocess.run(["git", "-C", root, "archive", ref, "collector"], capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", out], input=archive, check=True)
    return os.path.join(out, "collector")


def _endpoint(code: str) -> tuple[subprocess.Popen[str], int]:
    env = {**os.environ, "PYTHONPATH": code}
    child = subprocess.Popen([sys.executable, "-c", _CHECKS_SERVER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             text=True, env=env)
    assert child.stdout is not None
    return child, int(child.stdout.readline())


def _timed(conn: http.client.HTTPConnection, sql: str) -> float:
    started = time.perf_counter()
    conn.request("POST", "/?database=stepline", body=sql.encode(), headers={"Host": "localhost"})
    response = conn.getresponse()
    body = response.read()
    if response.status != 200:
        raise SystemExit(f"query endpoint answered {response.status}: {body[:300]!r}")
    return (time.perf_counter() - started) * 1e3


def checks(base: str, queries: int) -> int:
    """p50/p99 ms of dashboard queries through this tree's endpoint and through `base`'s, interleaved."""
    here = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "collector")
    servers = {"now": _endpoint(here), f"base {base}": _endpoint(_tree(base))}
    missed = []
    try:
        conns = {name: http.client.HTTPConnection("127.0.0.1", port, timeout=60) for name, (_, port) in servers.items()}
        print(f"{'query':<16} {'endpoint':<14} {'p50 ms':>8} {'p99 ms':>8} {'mean ms':>8}")
        for label, sql in DASHBOARD_SQL.items():
            times: dict[str, list[float]] = {name: [] for name in conns}
            for conn in conns.values():  # warm: sessions opened
                for n in range(20):
                    _timed(conn, sql.format(n=-1 - n))
            for n in range(queries):
                for name, conn in conns.items():
                    times[name].append(_timed(conn, sql.format(n=n)))
            figures = {}
            for name, got in times.items():
                got.sort()
                figures[name] = (got[len(got) // 2], got[int(len(got) * 0.99)], sum(got) / len(got))
                p50, p99, mean = figures[name]
                print(f"{label:<16} {name:<14} {p50:>8.2f} {p99:>8.2f} {mean:>8.2f}")
            (now50, now99, _), (base50, base99, _) = figures.values()
            print(f"{label:<16} {'added':<14} {now50 - base50:>+8.2f} {now99 - base99:>+8.2f}")
            if now99 - base99 > CHECKS_TARGET_MS:
                missed.append(f"{label}: {now99 - base99:+.2f} ms at p99 (target <= {CHECKS_TARGET_MS} ms)")
    finally:
        for child, _ in servers.values():
            assert child.stdin is not None
            child.stdin.close()
            child.wait(timeout=60)
    print()
    parts()
    for line in missed:
        print(f"TARGET MISSED: {line}")
    return 0


def parts(rounds: int = 2000) -> None:
    """Each check alone, in this process: the Host check, the watch's thread, ClickHouse's parser on a clause."""
    import socket
    from email.message import Message

    from stepline.endpoints.query import QueryEndpoint
    from stepline.endpoints.watch import Watch, Watchers
    from stepline.store.chdb import open_client

    endpoint = QueryEndpoint(open_client(tempfile.mkdtemp(prefix="stepline-bench-parts-")), port=0)
    headers = Message()
    headers["Host"] = "localhost:8124"
    left, right = socket.socketpair()
    watchers = Watchers()
    watchers.start()
    counter = itertools.count()
    steps: dict[str, Any] = {
        "Host/Origin check": lambda: endpoint._foreign(headers),
        "watch start+stop": lambda: _watched(Watch(watchers, left)),
        "SETTINGS, a new text": lambda: endpoint._sessions.canonical(DASHBOARD_SQL["panel+SETTINGS"].format(
            n=next(counter))),
        "SETTINGS, a text seen": lambda: endpoint._sessions.canonical(DASHBOARD_SQL["panel+SETTINGS"].format(n=0)),
    }
    print(f"{'check (in-process)':<26} {'p50 us':>8} {'p99 us':>8}")
    for label, step in steps.items():
        got = []
        for _ in range(rounds):
            started = time.perf_counter()
            step()
            got.append((time.perf_counter() - started) * 1e6)
        got.sort()
        print(f"{label:<26} {got[len(got) // 2]:>8.1f} {got[int(len(got) * 0.99)]:>8.1f}")
    watchers.stop()
    left.close()
    right.close()
    endpoint.stop()


def _watched(watch: Any) -> None:
    watch.on_gone(lambda: None)
    watch.stop()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=10_000_000)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--formats", default="Native,TabSeparated,JSONEachRow")
    parser.add_argument("--checks", action="store_true", help="the read-only checks' cost per dashboard query")
    parser.add_argument("--base", default="ed74ab4", help="--checks: the git ref to compare with (the endpoint "
                        "before the engine enforced read-only)")
    parser.add_argument("--queries", type=int, default=400, help="--checks: queries of each kind per endpoint")
    args = parser.parse_args(argv)
    if args.checks:
        print(f"machine: {platform.platform()}; python {platform.python_version()}; cpu_count={os.cpu_count()}")
        return checks(args.base, args.queries)
    sql = query_sql(args.rows)
    print(f"machine: {platform.platform()}; python {platform.python_version()}; cpu_count={os.cpu_count()}")
    print(f"query: {sql}; {args.rounds} round(s) per format; the best round of each side is compared")

    ours, theirs = multiprocessing.Pipe()
    server = multiprocessing.Process(target=serve, args=(theirs,))
    server.start()
    port = ours.recv()
    assert server.pid is not None
    idle = psutil.Process(server.pid).memory_info().rss / 2**20
    print(f"endpoint process idle RSS: {idle:,.0f} MiB\n")
    print(f"{'format':<14} {'result MiB':>10} {'in-process rows/s':>18} {'endpoint rows/s':>16} {'ratio':>6} "
          f"{'first byte s':>12} {'peak RSS MiB':>12} {'over idle':>9} {'CPU-s in-proc':>13} "
          f"{'CPU-s endpoint+client':>21}")
    missed = []
    try:
        for fmt in args.formats.split(","):
            base_s, base_bytes, base_cpu = min(baseline(sql, fmt) for _ in range(args.rounds))
            runs = []
            for _ in range(args.rounds):
                with Peak(server.pid) as peak:
                    elapsed, size, first = through_endpoint(port, sql, fmt)
                runs.append((elapsed, size, first, peak.mib, peak.cpu_s, client_cpu[0]))
            elapsed, size, first, _, server_cpu, curl_cpu = min(runs)
            peak_mib = max(run[3] for run in runs)
            if size != base_bytes:
                missed.append(f"{fmt}: the endpoint sent {size:,} bytes, chDB in-process made {base_bytes:,}")
            ratio = (args.rows / elapsed) / (args.rows / base_s)
            if ratio < TARGET_RATIO:
                missed.append(f"{fmt}: endpoint at {ratio:.2f}x of in-process (target >= {TARGET_RATIO}x)")
            print(f"{fmt:<14} {size / 2**20:>10,.0f} {args.rows / base_s:>18,.0f} {args.rows / elapsed:>16,.0f} "
                  f"{ratio:>5.2f}x {first:>12.3f} {peak_mib:>12,.0f} {peak_mib - idle:>9,.0f} {base_cpu:>13.2f} "
                  f"{server_cpu:>10.2f} + {curl_cpu:.2f}")
    finally:
        ours.send("stop")
        server.join()
    print(f"\nOn {os.cpu_count()} cores shared by the engine, the endpoint and the client, a query cannot finish "
          "before (endpoint CPU-s + client CPU-s) / cores; the in-process run pays no socket copies and no client.")
    for line in missed:
        print(f"TARGET MISSED: {line}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
