"""Reading the timeline from the CLI: through a running collector's endpoint, or the store itself."""

from __future__ import annotations

import os
import time
import urllib.request
from dataclasses import dataclass
from datetime import UTC
from urllib.parse import urlsplit

import clickhouse_connect
from clickhouse_connect.driver.client import Client
from prometheus_client.parser import text_string_to_metric_families

from stepline.model import schema
from stepline.store.discovery import LocatedStore, RunningCollector, locate_store, read_beside_store
from stepline.store.errors import StoreError, StoreLocked
from stepline.store.locking import embedded_store_locked
from stepline.store.reads import scalar
from stepline.store.store import Store
from stepline.store.url import StoreUrl, StoreUrlError, parse_store_url, reading_store_url


@dataclass
class TimelineReader:
    """A read client and where it goes: `via` says whether a collector's endpoint answers."""

    client: Client
    via: str
    collector: RunningCollector | None
    store: Store | None = None
    database: str = "stepline"

    def close(self) -> None:
        if self.store is not None:
            self.store.close()
        else:
            self.client.close()


def open_reader(store_url: str) -> TimelineReader:
    """Connect for reading; raises StoreError with one clear line. A server URL without a password takes the store
    password the environment gives, as the collector does (url.reading_store_url)."""
    url = parse_store_url(store_url)
    try:
        url = parse_store_url(reading_store_url(store_url))
    except StoreUrlError as exc:  # the URL parsed: what failed is the password the environment gives
        raise StoreError(f"cannot read the store password: {exc}") from None
    if not url.embedded:
        store = Store.open(url)
        return TimelineReader(store.client, f"ClickHouse at {url.redacted()}", None, store, url.database)
    if not os.path.isdir(url.path):
        raise StoreError(f"no store at {url.path}: run `stepline collect` or `stepline demo` first")
    if embedded_store_locked(url.path):
        holder = read_beside_store(url.path)
        if holder is None:
            raise StoreLocked(
                f"the embedded store {url.path} is in use by a process that announced no query endpoint", None
            )
        return TimelineReader(_endpoint_client(holder, url), f"collector pid {holder.pid} at {holder.query_url}",
                              holder, None, url.database)
    store = Store.open(url)
    if not _has_timeline(store):
        store.close()
        raise StoreError(f"{url.path} holds no stepline timeline: run `stepline collect` or `stepline demo` first")
    return TimelineReader(store.client, f"embedded store {url.path}", None, store, url.database)



def open_located(store: str | None) -> tuple[TimelineReader, LocatedStore]:
    """A reader of the store `store` names, else the one the environment, the current directory or the running
    collector's runtime file does (discovery.locate_store); a StoreError says where it looked."""
    located = locate_store(store)
    try:
        return open_reader(located.url), located
    except StoreLocked:
        raise
    except StoreError as exc:
        if located.searched is None:
            raise
        raise StoreError(f"{exc} (and no running collector announced itself in {located.searched})") from None

def _has_timeline(store: Store) -> bool:
    return bool(scalar(store.query("SELECT count() FROM system.tables WHERE database = {db:String} AND "
                                   "name = 'events'", parameters={"db": store.database})))


def _endpoint_client(holder: RunningCollector, url: StoreUrl) -> Client:
    parts = urlsplit(holder.query_url)
    password = os.environ.get("STEPLINE_QUERY_PASSWORD", "")
    if holder.password_required and not password:
        raise StoreError(f"the collector at {holder.query_url} requires a password: set STEPLINE_QUERY_PASSWORD")
    try:
        return clickhouse_connect.get_client(
            host=parts.hostname or "127.0.0.1", port=parts.port or 8124, database=url.database,
            password=password, connect_timeout=5, autogenerate_session_id=False,
        )
    except Exception as exc:  # the endpoint's failure modes are the transport's: all one message
        raise StoreError(f"the collector (pid {holder.pid}) holds the store but its endpoint "
                         f"{holder.query_url} does not answer: {' '.join(str(exc).split())[:200]}") from None


@dataclass(frozen=True)
class TableStatus:
    """Rows in one table and how old its newest row is."""

    table: str
    rows: int
    newest_age_s: float | None


def table_status(client: Client) -> list[TableStatus]:
    """Row counts and newest-row ages of every timeline table."""
    parts = [f"SELECT '{t.name}', count(), max(ts) FROM `{t.name}`" for t in schema.TABLES]
    rows = client.query(" UNION ALL ".join(parts)).result_rows
    now = time.time()
    by_name = {name: (int(count), newest) for name, count, newest in rows}
    result = []
    for table in schema.TABLES:
        count, newest = by_name[table.name]
        age = None
        if count and newest is not None:
            # chDB may hand back DateTime64('UTC') without its zone: the store only holds UTC.
            stamp = (newest if newest.tzinfo else newest.replace(tzinfo=UTC)).timestamp()
            age = max(0.0, now - stamp)
        result.append(TableStatus(table.name, count, age))
    return result


@dataclass(frozen=True)
class SourceHealth:
    """One source of a running collector: whether its last poll succeeded, and if not, why."""

    up: bool
    error: str


def source_health(metrics_url: str, timeout_s: float = 2.0) -> dict[str, SourceHealth]:
    """stepline_source_up per source, with stepline_source_last_error_info's reason, from a collector's /metrics."""
    with urllib.request.urlopen(metrics_url, timeout=timeout_s) as response:
        text = response.read().decode("utf-8")
    up: dict[str, float] = {}
    errors: dict[str, str] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if family.name == "stepline_source_up":
                up[sample.labels["source"]] = sample.value
            elif family.name == "stepline_source_last_error_info" and sample.value:
                errors[sample.labels["source"]] = sample.labels.get("error", "")
    return {name: SourceHealth(bool(value), "" if value else errors.get(name, "")) for name, value in up.items()}


