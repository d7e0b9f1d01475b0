"""Store URLs: chdb:// and http(s)://, their database and cluster, one clear line for a bad one (never with its
password), the password given apart, and the default store."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from stepline.store.url import DEFAULT_DATABASE, StoreUrlError, default_store_url, parse_store_url, with_password


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ("mysql://host/db", "scheme 'mysql'"),
        ("/var/lib/stepline", "has no scheme"),
        ("chdb://", "names no directory"),
        ("http://:8123/db", "names no host"),
        ("http://host:99999/db", "bad port"),
        ("http://host:8123/bad-name", "letters, digits or _"),
    ],
)
def test_bad_store_urls_get_one_clear_line(text: str, fragment: str) -> None:
    with pytest.raises(StoreUrlError) as info:
        parse_store_url(text)
    assert fragment in str(info.value)
    assert "\n" not in str(info.value)


def test_store_urls_parse() -> None:
    embedded = parse_store_url("chdb:///var/lib/stepline?database=prod")
    assert (embedded.scheme, embedded.path, embedded.database) == ("chdb", "/var/lib/stepline", "prod")
    server = parse_store_url("https://reader:s%40cret@ch.internal:8443/timeline")
    assert (server.host, server.port, server.username, server.password, server.database) == (
        "ch.internal", 8443, "reader", "s@cret", "timeline")
    assert "s@cret" not in server.redacted()
    assert parse_store_url("http://ch").port == 8123
    assert parse_store_url("chdb://relative/dir").path == os.path.abspath("relative/dir")


def test_a_bad_url_is_named_without_its_password() -> None:
    with pytest.raises(StoreUrlError) as info:
        parse_store_url("http://reader:hunter2@ch:8123/bad-name")
    assert "hunter2" not in str(info.value) and "reader:***@ch" in str(info.value)


def test_a_cluster_is_named_and_kept_in_the_printed_url() -> None:
    url = parse_store_url("http://writer:pw@[::1]:8123/timeline?cluster=stepline_1")
    assert (url.cluster, url.host, url.remote, url.embedded) == ("stepline_1", "::1", True, False)
    assert url.redacted() == "http://writer@[::1]:8123/timeline?cluster=stepline_1"
    assert parse_store_url("chdb:///d").redacted() == "chdb:///d" and parse_store_url("chdb:///d").database == (
        DEFAULT_DATABASE)
    for bad, fragment in (("http://ch/db?cluster=a%20b", "cluster name 'a b'"),
                          ("chdb:///d?user=x", "has the parameter 'user': it knows database, cluster"),
                          ("chdb:///d?database=a&database=b", "gives 'database' 2 times")):
        with pytest.raises(StoreUrlError, match=fragment):
            parse_store_url(bad)


def test_a_password_from_a_file_joins_a_server_url_once() -> None:
    joined = with_password("http://writer@ch:8123/stepline", "p@ss:word")
    assert joined == "http://writer:p%40ss%3Aword@ch:8123/stepline"
    assert parse_store_url(joined).password == "p@ss:word"
    with pytest.raises(StoreUrlError, match="give it once"):
        with_password("http://writer:pw@ch:8123/stepline", "other")
    with pytest.raises(StoreUrlError, match="not chdb://"):
        with_password("chdb:///d", "pw")


def test_the_default_store_is_the_environments_else_stepline_data_here(monkeypatch: pytest.MonkeyPatch) -> None:
    assert default_store_url() == f"chdb://{Path.cwd() / 'stepline-data'}"
    monkeypatch.setenv("STEPLINE_STORE", "http://ch:8123/stepline")
    assert default_store_url() == "http://ch:8123/stepline"
    assert os.environ["STEPLINE_STORE"] == default_store_url()
