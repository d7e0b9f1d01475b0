"""No reader indexes a query's row or a wire record by number (STYLE rule 19): rows are read by column name
(`stepline.queries.rows.Row`), wire records by field name (`stepline.plugin.wire.StepFields`, `RequestFields`), so that
a column added to a SELECT or a field to the wire shifts no one's values.

The check reads the package's syntax, not its text (SQL's own `arr[1]` inside strings is no Python index): an
integer index is positional where it is taken of something named like a row (`r`, `row`, `first_row`, `f`,
`fields`, `record`), of a query's result (`.result_rows[0]`, `.first_row[0]`, `.rows(...)[0]`, `.query(...)[0]`),
or twice of a list of rows (`rows[-1][8]`). A list of rows may be indexed once (`rows[0].ts`: its first row, read
by name)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "collector" / "stepline"

_ROW = re.compile(r"(r|row|\w+_row|f|fields|record)")
_ROWS = re.compile(r"(rows|\w+_rows)")
_RESULTS = {"result_rows", "first_row"}
_QUERIES = {"rows", "query"}

# (module, indexing) -> why it is not a row's field by position. Keep it short: a new entry needs a reason that is a
# format someone else fixed by position, never a SELECT of ours.
ALLOWED = {
    # /proc/PID/stat is positional by the kernel's own format (proc(5): state is field 3, ppid 4, pgrp 5, starttime
    # 22; counted here after the command name, which may hold spaces).
    ("loadgen/sweep.py", "fields[0]"): "/proc/PID/stat: state",
    ("loadgen/sweep.py", "fields[2]"): "/proc/PID/stat: pgrp",
    ("sources/gpu/owners.py", "fields[19]"): "/proc/PID/stat: starttime",
    ("store/discovery.py", "fields[19]"): "/proc/PID/stat: starttime",
}


def _integer(node: ast.expr) -> bool:
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        node = node.operand
    return isinstance(node, ast.Constant) and type(node.value) is int


def _name(node: ast.expr) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    return ""


def _positional(node: ast.Subscript) -> bool:
    """Whether `node` takes a row's or a record's field by its number."""
    if not _integer(node.slice):
        return False
    of = node.value
    if _ROW.fullmatch(_name(of)) or _name(of) in _RESULTS:
        return True
    if isinstance(of, ast.Subscript) and _integer(of.slice) and _ROWS.fullmatch(_name(of.value)):
        return True
    return isinstance(of, ast.Call) and _name(of.func) in _QUERIES


def positional_indexing(source: str) -> list[tuple[int, str]]:
    """(line, text) of every positional read of a row or record in `source`."""
    return sorted((node.lineno, ast.get_source_segment(source, node) or "") for node in ast.walk(ast.parse(source))
                  if isinstance(node, ast.Subscript) and _positional(node))


def test_the_check_finds_what_it_is_for() -> None:
    source = '''
r[9]
rows[-1][8]
f[18]
client.query(sql).result_rows[0][0]
result.first_row[2]
Query(sql).rows(reader)[0]
store.query(sql)[1]
first_row[0]
record[3]
sys.argv[1]
line.split()[0]
rows[0].ts
shape[2]
row.itl
"SELECT quantiles(0.5)(x)[1]"
'''
    assert [text for _, text in positional_indexing(source)] == [
        "r[9]", "rows[-1][8]", "f[18]", "client.query(sql).result_rows[0]", "client.query(sql).result_rows[0][0]",
        "result.first_row[2]", "Query(sql).rows(reader)[0]", "store.query(sql)[1]", "first_row[0]", "record[3]"]


def test_no_reader_indexes_a_row_or_a_wire_record_by_number() -> None:
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        module = path.relative_to(PACKAGE).as_posix()
        found += [f"{module}:{line}: {text}" for line, text in positional_indexing(path.read_text())
                  if (module, text) not in ALLOWED]
    assert not found, ("read these by name (a column alias in the SELECT and `row.name`, see stepline.store.reads; "
                       "a wire field by its name in stepline.plugin.wire):\n" + "\n".join(found))


def test_every_allowed_index_is_still_there() -> None:
    """An entry whose code went away is removed, so that the list stays the short list of real exceptions."""
    present = {(path.relative_to(PACKAGE).as_posix(), text) for path in PACKAGE.rglob("*.py")
               for _, text in positional_indexing(path.read_text())}
    assert set(ALLOWED) <= present, sorted(set(ALLOWED) - present)
