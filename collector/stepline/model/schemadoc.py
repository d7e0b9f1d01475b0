"""The column reference (docs/reference/schema.md, `stepline schema --markdown`), generated from the column comments
the store carries (one source of truth)."""

from __future__ import annotations

from stepline.model import schema


def markdown() -> str:
    """Every table stepline creates: its comment, then each column's name, type (codec aside) and comment."""
    parts = []
    for table in schema.STORE_TABLES:
        rows = [f"| `{c.name}` | `{c.type.split(' CODEC(')[0]}` | {_cell(c.comment)} |" for c in table.definition]
        parts.append("\n".join([f"#### `{table.name}`", "", table.comment, "", "| column | type | what it holds |",
                                "|---|---|---|", *rows]))
    return "\n\n".join(parts) + "\n"


def _cell(text: str) -> str:
    return text.replace("|", "\\|")
