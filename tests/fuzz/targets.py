"""Coverage-guided fuzzing with atheris (optional): one target per input stepline takes from outside.

    pip install atheris
    python -m tests.fuzz.targets TARGET [libFuzzer options, e.g. -max_total_time=600 corpus/]

TARGET is one of: metrics, datagram, otlp, inflate, sql. A target returns quietly on input it refuses with its
own clean error; anything else it raises is a finding (libFuzzer writes the input to crash-*). The hypothesis
properties in tests/test_fuzz*.py are the CI gate; this is for longer hunts. tests/fuzz/test_atheris.py runs
each target for a few seconds when atheris is installed.
"""

from __future__ import annotations

import contextlib
import importlib
import sys
from collections.abc import Callable
from typing import Any

atheris: Any = importlib.import_module("atheris")  # optional: imported only when a hunt runs

with atheris.instrument_imports(include=["stepline"]):  # stepline only: instrumenting protobuf takes seconds
    from stepline.clickhouse_http.body import form_fields
    from stepline.clickhouse_http.compression import decode_content
    from stepline.clickhouse_http.errors import SqlRefused
    from stepline.clickhouse_http.guard import read_only_statement, settings_named
    from stepline.clickhouse_http.settings import query_settings
    from stepline.model.rows import micros
    from stepline.plugin import wire
    from stepline.sources.otlp_decode import JSON, PROTOBUF, BodyTooLarge, OtlpDecodeError, decode, inflate
    from stepline.sources.vllm_metrics import ExpositionError, parse_exposition

INT64 = 1 << 63


def metrics(data: bytes) -> None:
    """The /metrics exposition parser."""
    try:
        samples, _ = parse_exposition(data.decode("utf-8", errors="replace"))
    except ExpositionError as exc:
        assert "\n" not in str(exc)
        return
    assert all(s.metric.startswith("vllm:") for s in samples)


def datagram(data: bytes) -> None:
    """A plugin datagram, down to the microseconds the store takes."""
    try:
        decoded = wire.decode(data)
    except wire.WireError:
        return
    for record in decoded.records:
        if isinstance(record, wire.StepRecord | wire.RequestRecord):
            assert -INT64 <= micros(record.ts) < INT64


def otlp(data: bytes) -> None:
    """An OTLP/HTTP trace export body, protobuf or JSON (the first byte chooses)."""
    if not data:
        return
    try:
        decoded = decode(data[1:], JSON if data[0] & 1 else PROTOBUF, "fuzz")
    except OtlpDecodeError:
        return
    for row in decoded.rows:
        assert 0 < row.arrival_ts <= row.ts < INT64


def inflate_body(data: bytes) -> None:
    """Content-Encoding undone under a limit (the first byte chooses the encoding)."""
    if not data:
        return
    encoding = ("gzip", "deflate", "identity", "x-gzip")[data[0] % 4]
    try:
        assert len(inflate(data[1:], encoding, 1 << 16)) <= 1 << 16
    except (BodyTooLarge, OtlpDecodeError):
        return


def sql(data: bytes) -> None:
    """The query endpoint's read-only guard, settings policy, form and body decoding."""
    provider = atheris.FuzzedDataProvider(data)
    text = provider.ConsumeUnicodeNoSurrogates(provider.ConsumeIntInRange(0, 512))
    with contextlib.suppress(SqlRefused):
        assert read_only_statement(text).sql.strip()
    with contextlib.suppress(SqlRefused):  # any text, not only the engine's canonical form: nothing else raised
        settings_named(text)
    params = {provider.ConsumeUnicodeNoSurrogates(12): provider.ConsumeUnicodeNoSurrogates(12) for _ in range(3)}
    with contextlib.suppress(SqlRefused):
        query_settings(params)
    body = provider.ConsumeBytes(provider.ConsumeIntInRange(0, 512))
    with contextlib.suppress(SqlRefused):
        form_fields("multipart/form-data; boundary=B", body)
    with contextlib.suppress(SqlRefused):
        decode_content(provider.PickValueInList(["gzip", "deflate", "zstd", "lz4", "br", ""]), body, 1 << 16)


TARGETS: dict[str, Callable[[bytes], None]] = {
    "metrics": metrics, "datagram": datagram, "otlp": otlp, "inflate": inflate_body, "sql": sql,
}


def main(argv: list[str]) -> None:
    if len(argv) < 2 or argv[1] not in TARGETS:
        sys.exit(f"usage: python -m tests.fuzz.targets {{{','.join(TARGETS)}}} [libFuzzer options]")
    atheris.Setup([argv[0], *argv[2:]], TARGETS[argv[1]])
    atheris.Fuzz()


if __name__ == "__main__":
    main(sys.argv)
