"""`stepline status` in this process against an embedded store, and how it says an age."""

from __future__ import annotations

import pytest

from stepline.cli import status
from stepline.cli.main import main
from stepline.store.store import Store


def test_a_store_without_a_collector(store: Store, store_url: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["status", "--store", store_url]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("timeline: embedded store") and lines[1] == "collector: not running"
    assert lines[2].split() == ["table", "rows", "newest", "row"]
    steps = next(line for line in lines if line.startswith("steps "))
    assert steps.split() == ["steps", "0", "-"]


@pytest.mark.parametrize(("seconds", "said"), [(None, "-"), (0.25, "0.2s ago"), (59.9, "59.9s ago"),
                                               (90, "1.5m ago"), (7200, "2.0h ago"), (86400 * 3, "3.0d ago")])
def test_an_age_in_its_largest_unit(seconds: float | None, said: str) -> None:
    assert status.age(seconds) == said
