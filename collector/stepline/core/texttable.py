"""Rows as an aligned plain-text table, for terminals: `stepline query`, `status` and `whatif`."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def render_table(columns: Sequence[str], rows: Sequence[Sequence[Any]], max_width: int = 60,
                 cut_note: str = "") -> str:
    """Rows as an aligned text table, each value on one line and at most `max_width` characters; when a value had
    to be cut, `cut_note` (if any) follows the table, once."""
    texts = [[_text(v) for v in row] for row in rows]
    cut = any(len(t) > max_width for row in texts for t in row)
    cells = [[t if len(t) <= max_width else t[: max_width - 1] + "…" for t in row] for row in texts]
    widths = [max([len(c)] + [len(r[i]) for r in cells]) for i, c in enumerate(columns)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(columns, widths, strict=True)).rstrip()]
    lines.append("  ".join("-" * w for w in widths))
    lines.extend("  ".join(v.ljust(w) for v, w in zip(r, widths, strict=True)).rstrip() for r in cells)
    if cut and cut_note:
        lines.append(cut_note)
    return "\n".join(lines)


def _text(value: Any) -> str:
    text = f"{value:.6g}" if isinstance(value, float) else str(value)
    return " ".join(text.split())
