"""`stepline whatif`: goodput's objectives default to the alert configuration's SLO, and must be positive."""

from __future__ import annotations

import argparse

import pytest

from stepline.cli import whatif
from stepline.cli.main import main
from stepline.config.slo import Slo
from stepline.store.store import Store


def test_the_objectives_default_to_the_slo() -> None:
    parser = argparse.ArgumentParser()
    whatif.add_arguments(parser)
    args = parser.parse_args([])
    assert (args.ttft, args.tpot, args.since) == (Slo().ttft_p99_seconds, Slo().tpot_seconds, "30m")


def test_an_objective_that_is_not_positive_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["whatif", "--ttft", "0"]) == 2
    assert capsys.readouterr().err == (f"stepline: --ttft and --tpot must be positive, got 0.0 and "
                                       f"{Slo().tpot_seconds}\n")


def test_a_window_without_requests_cannot_be_replayed(store: Store, store_url: str,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["whatif", "--since", "5m", "--store", store_url]) == 2
    err = capsys.readouterr().err
    assert err.startswith("stepline whatif: ") and err.count("\n") == 1
