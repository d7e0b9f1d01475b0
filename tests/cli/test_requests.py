"""`stepline requests`: its options, and the slowest requests of a store (or none)."""

from __future__ import annotations

import argparse

import pytest

from stepline.cli import requests
from stepline.cli.main import build_parser, main
from stepline.store.store import Store


def test_requests_leaves_the_long_chunk_to_the_engines_own_budget() -> None:
    # A fixed default (2,048) read 0 tok·pf on an engine whose whole budget is 1,024 tokens.
    assert build_parser("requests").parse_args(["requests", "--slowest", "3"]).long_prefill is None
    assert build_parser("requests").parse_args(["requests", "--long-prefill", "512"]).long_prefill == 512


@pytest.mark.parametrize(("text", "message"), [("ten", "'ten' is not a whole number"),
                                               ("0", "0 is not between 1 and 4294967295"),
                                               (str(1 << 32), "4294967296 is not between 1 and 4294967295")])
def test_a_count_fits_a_uint32_parameter(text: str, message: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError, match=message):
        requests.count(text)
    assert requests.count("4294967295") == (1 << 32) - 1


def test_a_store_without_requests_says_who_fills_them(store: Store, store_url: str,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["requests", "--store", store_url, "--since", "2h", "--engine", "e0"]) == 0
    assert capsys.readouterr().out == ("no finished requests in the last 2h on engine e0 (the plugin or OTLP fills "
                                       "`requests`)\n")
