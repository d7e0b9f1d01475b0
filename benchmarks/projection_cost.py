"""What each projection costs at insert time.

The same synthetic rows (scale_data's SQL: `--hours` of an 8-GPU node's NVML at 10 Hz, of one engine's /metrics
every 5 s and steps, and of eight engines' finished requests), made once into a table of their own, are copied by
INSERT ... SELECT into copies of each table with no projection, with each projection alone, and with all of them,
in one embedded store: the insert itself, what a collector's batches pay on the server. Each insert runs `--rounds`
times into a fresh table and the best is kept. Printed: seconds per insert and the ratio against the table with no
projection, in the same run.

    python projection_cost.py [--hours 4] [--rounds 3] [--tables steps,requests]
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time
from collections.abc import Sequence
from dataclasses import replace

from scale_data import Shape, engine_samples_sql, gpu_samples_sql, requests_sql, steps_sql

from stepline.model import schema
from stepline.store.store import Store


def _variants(table: schema.Table) -> list[tuple[str, schema.Table]]:
    none = replace(table, projections=())
    alone = [(p.name, replace(table, projections=(p,))) for p in table.projections]
    return [("no projection", none), *alone, ("all of them", table)]


def _insert_s(store: Store, table: schema.Table, fill: str, rounds: int) -> float:
    best = float("inf")
    for _ in range(rounds):
        store.client.command(f"DROP TABLE IF EXISTS `{store.database}`.`{table.name}`")
        store.client.command(schema.create_table_sql(store.database, table, 30))
        started = time.perf_counter()
        store.client.command(fill)
        best = min(best, time.perf_counter() - started)
    return best


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hours", type=float, default=4.0)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tables", default="gpu_samples,engine_samples,steps,requests",
                        help="comma-separated tables to time (default: every table with projections)")
    args = parser.parse_args(argv)
    shape = Shape(end_s=int(time.time()) // 60 * 60, hours=args.hours)
    every: dict[str, list[str]] = {"gpu_samples": [gpu_samples_sql(shape)],
                                   "engine_samples": [engine_samples_sql(shape, 0)], "steps": [steps_sql(shape, 0)],
                                   "requests": [requests_sql(shape, e) for e in range(shape.engines)]}
    fills = {name: every[name] for name in args.tables.split(",")}
    tmp = tempfile.mkdtemp(prefix="stepline-projections-")
    store = Store.open(f"chdb://{tmp}/store")
    try:
        print(f"{'table':<15} {'projections':<28} {'rows':>9} {'insert s':>9} {'ratio':>6}")
        for name, made in fills.items():
            bare = replace(schema.TABLE_BY_NAME[name], projections=())
            store.client.command(schema.create_table_sql(store.database, bare, 30, name=f"made_{name}"))
            for sql in made:
                store.client.command(sql.replace(f"INSERT INTO {name} ", f"INSERT INTO made_{name} ", 1))
            fill = f"INSERT INTO `{store.database}`.`{name}` SELECT * FROM `{store.database}`.`made_{name}`"
            baseline = 0.0
            for label, table in _variants(schema.TABLE_BY_NAME[name]):
                seconds = _insert_s(store, table, fill, args.rounds)
                rows = store.query(f"SELECT count() FROM `{name}`").result_rows[0][0]
                baseline = baseline or seconds
                print(f"{name:<15} {label:<28} {rows:>9,} {seconds:>9.3f} {seconds / baseline:>5.2f}x")
    finally:
        store.close()
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
