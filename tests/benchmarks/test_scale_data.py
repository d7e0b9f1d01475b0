"""The scale stores' synthesis (benchmarks/scale_data.py) on a small shape: today's columns, a gateway decision for
every request that joins it by id, and steps only over the hours asked."""

from __future__ import annotations

import time
from types import ModuleType

import pytest

from stepline.store.store import Store
from tests.benchmarks.script import load


@pytest.fixture(scope="module")
def sd() -> ModuleType:
    return load("scale_data")


def test_a_small_fill_has_a_decision_for_every_request_and_steps_only_over_the_last_hours(
        sd: ModuleType, store: Store) -> None:
    shape = sd.Shape(end_s=int(time.time()) - 60, hours=0.1, engines=2, hosts=2, steps_hours=0.02)
    sd.synthesise(lambda _label, sql: store.client.command(sql), shape)

    first_step, = store.query("SELECT toUnixTimestamp64Micro(min(ts)) FROM steps").result_rows[0]
    assert first_step >= (shape.end_s - 0.02 * 3600) * 1e6
    first_request, = store.query("SELECT toUnixTimestamp64Micro(min(ts)) FROM requests").result_rows[0]
    assert first_request < (shape.start_s + 60) * 1e6  # every other table spans the whole shape
    requests, decided, heavy_right, teams_right = store.query(f"""
        SELECT count(), countIf(d.request_id != ''),
               countIf((d.lane = 'heavy') = (r.prompt_tokens > {sd.HEAVY_PROMPT})),
               countIf(toUInt32(substring(d.team, 6)) = toUInt32(substring(d.`key`, 5)) % {sd.TEAMS})
        FROM requests AS r LEFT JOIN gateway_decisions AS d USING (host, engine, request_id)""").result_rows[0]
    assert requests == decided == heavy_right == teams_right > 0
    keys, = store.query("SELECT uniqExact(`key`) FROM gateway_decisions").result_rows[0]
    assert 1 < keys <= sd.KEYS


def test_steps_hours_cut_the_days_to_the_spans_last_hours(sd: ModuleType) -> None:
    week = sd.Shape(end_s=1_000_000, hours=168)
    assert week.step_days == week.days and len(week.days) == 7
    assert sd.Shape(end_s=1_000_000, hours=168, steps_hours=30).step_days == [(496_800, 21_600), (518_400, 86_400)]
    assert sd.Shape(end_s=1_000_000, hours=24, steps_hours=2).step_days == [(79_200, 7_200)]
