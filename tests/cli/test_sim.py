"""`stepline sim`: its defaults are the simulator's, and a port it cannot bind is one line, exit 1."""

from __future__ import annotations

import argparse
import socket

import pytest

from stepline.cli import sim
from stepline.sim.config import EngineConfig


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    sim.add_arguments(parser)
    return parser.parse_args(list(argv))


def test_the_defaults_are_the_engines() -> None:
    args, config = parse(), EngineConfig()
    assert (args.max_num_batched_tokens, args.max_num_seqs, args.num_gpu_blocks) == (
        config.max_num_batched_tokens, config.max_num_seqs, config.num_gpu_blocks)
    assert (args.workload, args.port, args.once) == ("steady", 8000, False)


def test_a_port_in_use_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert sim.run(parse("--workload", "idle", "--port", str(port))) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"stepline sim: cannot listen on 127.0.0.1:{port}: ") and err.count("\n") == 1
