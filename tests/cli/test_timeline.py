"""`stepline timeline` in this process: steps around a moment, and a moment it cannot read."""

from __future__ import annotations

import argparse
import time

import pytest

from stepline.cli import timeline
from stepline.cli.main import main
from stepline.model.rows import Step, micros
from stepline.store.store import Store


def test_every_step_around_the_moment(store: Store, store_url: str, capsys: pytest.CaptureFixture[str]) -> None:
    t0 = float(int(time.time()) - 60)
    store.insert("steps", [Step(micros(t0 + i), "h", "e", 0, "m", i, 20.0, 0, 0, 8, 8, 8, 0, 0, 0.4, 0, 0, 0, 0, 0,
                                0, [], [], False) for i in range(5)], Step._fields)
    assert main(["timeline", "--around", str(t0 + 2), "--window", "10", "--bucket", "0", "--store", store_url]) == 0
    out = capsys.readouterr().out
    assert out.startswith("time (UTC)")
    assert len([line for line in out.splitlines() if " e " in f" {line} "]) == 5


def test_the_options() -> None:
    parser = argparse.ArgumentParser()
    timeline.add_arguments(parser)
    args = parser.parse_args(["--around", "12:00:00"])
    assert (args.around, args.window, args.bucket, args.engine, args.store) == ("12:00:00", 30.0, 1.0, "", None)
