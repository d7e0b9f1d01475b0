"""FakePidView: the /proc the GPU source's process attribution sees, answering as ProcPidView does over a real one."""

from __future__ import annotations

import os

from stepline.sources.gpu.owners import PidView, ProcPidView
from stepline.testing.fake_procfs import FakePidView


def test_it_answers_what_it_was_given_and_counts_its_reads() -> None:
    view = FakePidView({100: 7}, local={48100: 100}, environs={100: {"STEPLINE_ENGINE": "vllm-0"}})
    assert (view.start_time(100), view.start_time(101)) == (7, None)
    assert (view.local_pid(48100), view.local_pid(100)) == (100, None)
    assert view.environ(100) == {"STEPLINE_ENGINE": "vllm-0"} and view.environ(101) is None
    assert (view.reads, view.environ_reads) == (2, 2)


def test_its_answers_have_the_real_views_shape() -> None:
    real: PidView = ProcPidView()
    me = os.getpid()
    fake: PidView = FakePidView({me: real.start_time(me) or 0}, environs={me: dict(real.environ(me) or {})})
    assert fake.start_time(me) == real.start_time(me) and isinstance(real.start_time(me), int)
    assert fake.environ(me) == real.environ(me)
    assert real.local_pid(me) is None and fake.local_pid(me) is None  # no host /proc mounted: no mapping


def test_what_it_was_given_is_copied() -> None:
    started = {1: 1}
    view = FakePidView(started)
    started[2] = 2
    assert view.start_time(2) is None
