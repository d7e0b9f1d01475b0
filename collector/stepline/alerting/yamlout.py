"""A small deterministic YAML emitter (sorted keys, block style) for the generated files; no PyYAML needed."""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence

_PLAIN = re.compile(r"[A-Za-z_/][A-Za-z0-9_./-]*")  # fullmatch: `$` would pass a final newline
_RESERVED = {"true", "false", "yes", "no", "on", "off", "null", "y", "n", "~"}


def dump(data: object, header: str = "") -> str:
    """`data` (dicts, lists, str, int, float, bool, None) as YAML; `header` becomes leading comment lines."""
    lines = [f"# {h}".rstrip() for h in header.splitlines()]
    lines.extend(_node(data, 0))
    return "\n".join(lines) + "\n"


def _scalar(v: object) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int | float):
        return json.dumps(v)
    if isinstance(v, str):
        if _PLAIN.fullmatch(v) and v.lower() not in _RESERVED:
            return v
        return json.dumps(v, ensure_ascii=False)
    raise TypeError(f"cannot write {type(v).__name__} as YAML")


def _is_block(v: object) -> bool:
    return isinstance(v, str) and "\n" in v and not v.endswith("\n") and all(
        line == line.rstrip() and "\t" not in line for line in v.splitlines()) and not v.startswith(" ")


def _node(v: object, indent: int) -> list[str]:
    pad = " " * indent
    if isinstance(v, Mapping):
        if not v:
            return [pad + "{}"]
        out: list[str] = []
        for key in sorted(v):
            out.extend(_entry(pad + _scalar(str(key)) + ":", v[key], indent))
        return out
    if isinstance(v, Sequence) and not isinstance(v, str):
        if not v:
            return [pad + "[]"]
        out = []
        for item in v:
            sub = _node(item, indent + 2)
            if isinstance(item, Mapping | list) and item:
                out.append(pad + "- " + sub[0][indent + 2:])
                out.extend(sub[1:])
            else:
                out.extend(_entry(pad + "-", item, indent))
        return out
    return [pad + _scalar(v)]


def _entry(prefix: str, v: object, indent: int) -> list[str]:
    if _is_block(v):
        assert isinstance(v, str)
        return [prefix + " |-", *(" " * (indent + 2) + line if line else "" for line in v.split("\n"))]
    if isinstance(v, Mapping | list):
        return [prefix, *_node(v, indent + 2)] if v else [prefix + (" {}" if isinstance(v, Mapping) else " []")]
    return [prefix + " " + _scalar(v)]
