"""core.oneline: any text as one line, cut at a length."""

from __future__ import annotations

from stepline.core.oneline import one_line


def test_every_run_of_whitespace_becomes_one_space() -> None:
    assert one_line("Code: 60.\n  DB::Exception:\tTable  x\r\ndoes not exist ") == \
        "Code: 60. DB::Exception: Table x does not exist"


def test_cut_at_the_limit_after_joining() -> None:
    text = "a\n\n\nb " * 100
    assert one_line(text, 7) == "a b a b"
    assert len(one_line(text, 160)) == 160


def test_an_exception_reads_as_its_message() -> None:
    assert one_line(ValueError("bad\nvalue"), 200) == "bad value"
    assert one_line(ValueError()) == ""
