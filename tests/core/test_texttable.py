"""Plain-text tables: one value per line, cut values marked, the cut said once."""

from stepline.core.texttable import render_table


def test_a_table_says_once_below_it_that_values_were_cut() -> None:
    note = "(cut: --format tsv shows them whole)"
    cut = render_table(("a", "b"), [("x" * 70, "y" * 61), ("short", 1)], 60, note)
    lines = cut.splitlines()
    assert lines[2] == "x" * 59 + "…" + "  " + "y" * 59 + "…"
    assert lines[-1] == note and cut.count(note) == 1 and len(lines) == 5
    whole = render_table(("a",), [("x" * 60,), ("two\nlines",)], 60, note)
    assert note not in whole and "two lines" in whole


def test_floats_print_six_significant_digits_and_columns_align() -> None:
    table = render_table(("name", "value"), [("pi", 3.14159265), ("a-longer-name", 2)])
    header, rule, first, second = table.splitlines()
    assert first == "pi             3.14159"
    assert rule == "-" * len("a-longer-name") + "  " + "-" * len("3.14159")
    assert header.startswith("name") and second.startswith("a-longer-name  2")
