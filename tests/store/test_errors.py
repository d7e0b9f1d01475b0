"""The store's errors: one family, each one line."""

from __future__ import annotations

from stepline.store.discovery import RunningCollector
from stepline.store.errors import StoreError, StoreLocked, StoreUnreachable, error_line


def test_a_transport_error_reads_as_its_errno_text() -> None:
    nested = OSError("HTTPConnectionPool(host='ch', port=8123): Max retries exceeded with url: /? (Caused by "
                     "NewConnectionError('<urllib3.connection.HTTPConnection object at 0x7f>: Failed to establish "
                     "a new connection: [Errno 111] Connection refused'))")
    assert error_line(nested) == "Connection refused"
    assert error_line(OSError("(Caused by NameResolutionError([Errno -2] Name or service not known))")) == \
        "Name or service not known"


def test_any_other_error_is_one_line_of_at_most_300_characters() -> None:
    assert error_line(ValueError("Code: 60.\n  DB::Exception: Unknown table\n")) == \
        "Code: 60. DB::Exception: Unknown table"
    assert error_line(ValueError("word " * 100)) == ("word " * 60)[:300]


def test_store_errors_are_one_family_and_a_locked_store_names_its_holder() -> None:
    holder = RunningCollector(42, query_url="http://127.0.0.1:8124")
    locked = StoreLocked("held", holder)
    assert isinstance(locked, StoreError) and locked.holder == holder and str(locked) == "held"
    assert issubclass(StoreUnreachable, StoreError)
