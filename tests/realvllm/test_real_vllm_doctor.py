"""`stepline doctor` against the real vLLM engine (its CPU build) and `stepline collect`: every check holds when all
is wired, and with one piece removed, that one line fails and the others hold.

The wired runs are the shared engine's (harness.doctor_runs, inside tests/realvllm/conftest.py's life): all wired,
then the doctor pointed at a port where no engine listens. Two pieces need engines of their own, started here one
after the other once the shared one has stopped: one without --otlp-traces-endpoint (then its collector is stopped
while it serves), one without --enable-logging-iteration-details. The other removals (names, tokens, GPUs, the
store, Prometheus) are the unit tests' (tests/app/test_doctor.py).
"""

from __future__ import annotations

import re
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from stepline.app.doctor import CHECKS
from tests.realvllm import harness

ALL_OK = {name: "OK" for name in CHECKS} | {"prometheus": "SKIP", "alertmanager": "SKIP"}
REMOVED_WAIT_S = 12


def lines(run: subprocess.CompletedProcess[str]) -> dict[str, tuple[str, str]]:
    """The doctor's lines by check: (status, message), in CHECKS order (asserted)."""
    found: dict[str, tuple[str, str]] = {}
    for line in run.stdout.splitlines():
        name, _, message = line[5:].partition(": ")
        found[name] = (line[:4].strip(), message)
    assert list(found) == list(CHECKS), run.stdout + run.stderr
    return found


def statuses(run: subprocess.CompletedProcess[str]) -> dict[str, str]:
    return {name: status for name, (status, _) in lines(run).items()}


@pytest.fixture(scope="module")
def removed(life: harness.Life, tmp_path_factory: pytest.TempPathFactory) -> Iterator[
        dict[str, subprocess.CompletedProcess[str]]]:
    """The doctor beside an engine without OTLP (`no_otlp`), the same after its collector stopped
    (`collector_stopped`), and beside an engine without iteration details (`no_details`)."""
    runs: dict[str, subprocess.CompletedProcess[str]] = {}

    def setup(name: str) -> harness.Setup:
        return harness.Setup(Path(tmp_path_factory.mktemp(name)), life.setup.venv, life.setup.model)

    # What is removed never arrives, so each of these waits its whole --wait: 12 s, where the wired run (which
    # returns as soon as the steps and a span are in) waits up to 30 s. The plugin's steps and the probe's span
    # arrive within about 6 s of the probe on this machine under the suite's load (the wired run's clock line).
    no_otlp = setup("no-otlp")
    with harness.collector(no_otlp) as collector, harness.engine(
            no_otlp, ["--enable-logging-iteration-details"], collected=False):
        runs["no_otlp"] = harness.doctor(no_otlp, "--wait", str(REMOVED_WAIT_S))
        harness.stop(collector)
        runs["collector_stopped"] = harness.doctor(no_otlp, "--wait", str(REMOVED_WAIT_S))
    no_details = setup("no-details")
    with harness.collector(no_details), harness.engine(
            no_details, ["--otlp-traces-endpoint", no_details.otlp_url], collected=False):
        runs["no_details"] = harness.doctor(no_details, "--wait", str(REMOVED_WAIT_S))
    for name, run in {**life.doctor, **runs}.items():  # beside the run's logs, for whoever reads them
        (life.setup.work / f"doctor-{name}.txt").write_text(run.stdout + run.stderr)
    yield runs


def test_a_wired_real_engine_passes_every_check(life: harness.Life) -> None:
    run = life.doctor["wired"]
    assert statuses(run) == ALL_OK, run.stdout
    assert run.returncode == 0
    found = lines(run)
    assert found["engine"][1].endswith(f"vllm: families, model {harness.SERVED_NAME}; probe sent")
    assert found["collector"][1].endswith(f"scrapes {harness.SERVED_NAME}; SQL at "
                                          f"http://127.0.0.1:{life.setup.query_port}")
    # The CPU engine steps synchronously (vLLM schedules asynchronously by default on GPUs only).
    assert f"from {harness.SERVED_NAME}, iteration details on; its core steps synchronously" in found["plugin"][1]
    assert found["model"][1] == f"{harness.SERVED_NAME} (/metrics, /v1/models, the plugin agree)"
    assert found["store"][1].startswith(f"{life.setup.store} writable (")


def test_a_wrong_engine_url_fails_the_engine_line_and_the_others_hold(life: harness.Life) -> None:
    run = life.doctor["wrong_url"]
    assert statuses(run) == ALL_OK | {"engine": "FAIL"}, run.stdout
    assert run.returncode == 1
    engine = lines(run)["engine"][1]
    assert " unreachable: " in engine and engine.endswith(
        f"(the collector scrapes {harness.SERVED_NAME} at {life.setup.engine_url}/metrics)")


def test_without_the_otlp_endpoint_the_otlp_line_fails_and_the_others_hold(
        removed: dict[str, subprocess.CompletedProcess[str]]) -> None:
    run = removed["no_otlp"]
    assert statuses(run) == ALL_OK | {"otlp": "FAIL"}, run.stdout
    assert run.returncode == 1
    # The seconds it waited: its --wait, or a little more on a busy machine (13 s has been seen for 12).
    waited = re.match(r"no spans in (\d+) s — start vLLM with --otlp-traces-endpoint ", lines(run)["otlp"][1])
    assert waited is not None and REMOVED_WAIT_S <= int(waited.group(1)) <= REMOVED_WAIT_S + 10, lines(run)["otlp"]


def test_with_the_collector_stopped_its_line_fails_and_what_needs_it_is_skipped(
        removed: dict[str, subprocess.CompletedProcess[str]]) -> None:
    run = removed["collector_stopped"]
    assert statuses(run) == {"engine": "OK", "collector": "FAIL", "plugin": "SKIP", "otlp": "SKIP", "model": "OK",
                             "gpu": "SKIP", "store": "SKIP", "clock": "OK", "prometheus": "SKIP",
                             "alertmanager": "SKIP"}, run.stdout
    assert run.returncode == 1
    assert lines(run)["collector"][1].startswith("none running for ")


def test_without_iteration_details_the_plugin_line_fails_and_the_others_hold(
        removed: dict[str, subprocess.CompletedProcess[str]]) -> None:
    run = removed["no_details"]
    assert statuses(run) == ALL_OK | {"plugin": "FAIL"}, run.stdout
    assert run.returncode == 1
    assert lines(run)["plugin"][1].endswith(f"from {harness.SERVED_NAME}, none with iteration details — start vLLM "
                                            "with --enable-logging-iteration-details")
