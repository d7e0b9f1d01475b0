"""Store URLs: `chdb:///path` (embedded ClickHouse) or `http(s)://user:pass@host:port/db` (a server).

`?cluster=NAME` says the store is a ClickHouse cluster whose tables `stepline schema --cluster NAME --apply` made:
collectors then write through its Distributed tables and never create or change a table.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from urllib.parse import parse_qs, quote, unquote, urlsplit

DEFAULT_DATABASE = "stepline"
DEFAULT_STORE_DIR = "stepline-data"


class StoreUrlError(ValueError):
    """A store URL that stepline cannot use."""


@dataclass(frozen=True)
class StoreUrl:
    """A parsed store URL; `path` is set for chdb, host/port for http(s)."""

    scheme: str
    database: str
    path: str = ""
    host: str = ""
    port: int = 0
    username: str = "default"
    password: str = field(default="", repr=False)
    cluster: str = ""

    @property
    def embedded(self) -> bool:
        return self.scheme == "chdb"

    @property
    def remote(self) -> bool:
        """A ClickHouse server (or a cluster's), reached over HTTP: its writes are batched by the server."""
        return not self.embedded

    def redacted(self) -> str:
        """The URL as it may be printed: never with its password."""
        cluster = f"?cluster={self.cluster}" if self.cluster else ""
        if self.embedded:  # a cluster over an embedded store is the test suite's (tests/store/cluster_run.py)
            return f"chdb://{self.path}" + (f"?database={self.database}&cluster={self.cluster}" if cluster else "")
        user = f"{self.username}@" if self.username != "default" else ""
        host = f"[{self.host}]" if ":" in self.host else self.host  # urlsplit's hostname drops an IPv6 host's brackets
        return f"{self.scheme}://{user}{host}:{self.port}/{self.database}{cluster}"


def default_store_url() -> str:
    """`$STEPLINE_STORE`, else an embedded store in ./stepline-data."""
    return os.environ.get("STEPLINE_STORE") or f"chdb://{os.path.abspath(DEFAULT_STORE_DIR)}"


# user:password@ at the start of a URL's authority; error messages show the URL without the password.
_USERINFO = re.compile(r"^((?:[A-Za-z][A-Za-z0-9+.-]*://)?[^/@:]*):[^/]*@")


def parse_store_url(text: str) -> StoreUrl:
    """Parse a store URL, or raise StoreUrlError naming what is wrong with it (never with its password)."""
    try:
        return _parse(text.strip())
    except StoreUrlError as exc:
        raise StoreUrlError(str(exc).replace(text.strip(), _USERINFO.sub(r"\1:***@", text.strip()))) from None


def _parse(text: str) -> StoreUrl:
    scheme, sep, rest = text.partition("://")
    if not sep:
        raise StoreUrlError(
            f"store URL {text!r} has no scheme: use chdb:///path/to/dir or http(s)://host:8123/database"
        )
    scheme = scheme.lower()
    if scheme == "chdb":
        path_part, _, query = rest.partition("?")
        if not path_part:
            raise StoreUrlError(f"store URL {text!r} names no directory: use chdb:///path/to/dir")
        options = _options(query, text, ("database", "cluster"))
        return StoreUrl("chdb", _identifier(options.get("database", DEFAULT_DATABASE), text),
                        path=os.path.abspath(unquote(path_part)), cluster=_cluster(options, text))
    if scheme in ("http", "https"):
        parts = urlsplit(text)
        if not parts.hostname:
            raise StoreUrlError(f"store URL {text!r} names no host")
        try:
            port = parts.port or (8443 if scheme == "https" else 8123)
        except ValueError as exc:
            raise StoreUrlError(f"store URL {text!r} has a bad port: {exc}") from None
        database = unquote(parts.path.strip("/")) or DEFAULT_DATABASE
        options = _options(parts.query, text, ("cluster",))
        return StoreUrl(
            scheme,
            _identifier(database, text),
            host=parts.hostname,
            port=port,
            username=unquote(parts.username or "default"),
            password=unquote(parts.password or ""),
            cluster=_cluster(options, text),
        )
    raise StoreUrlError(
        f"store URL {text!r} has scheme {scheme!r}: stepline knows chdb:// (embedded) and http(s):// (server)"
    )


def with_password(text: str, password: str) -> str:
    """A server store URL given its password from elsewhere (a mounted secret file); StoreUrlError when the URL is
    not a server's or already carries one (two sources of one secret would drift apart)."""
    url = parse_store_url(text)
    if url.embedded:
        raise StoreUrlError("a store password is for a ClickHouse server (http:// or https://), not chdb://")
    if url.password:
        raise StoreUrlError("the store URL carries a password and a store password is set too: give it once")
    parts = urlsplit(text.strip())
    userinfo = f"{quote(url.username, safe='')}:{quote(password, safe='')}@"
    host = parts.netloc.rpartition("@")[2]
    return parts._replace(netloc=userinfo + host).geturl()


# The ClickHouse password apart from the store URL, merged into a server URL: from VAR or the file VAR_FILE names
# (a mounted Kubernetes or compose secret), read by the collector and by every command that reads the store.
STORE_PASSWORD_VARS = ("STEPLINE_STORE_PASSWORD", "STEPLINE_STORE_PASSWORD_FILE")


def store_password(env: Mapping[str, str]) -> str | None:
    """The store password `env` gives (STEPLINE_STORE_PASSWORD, else the file STEPLINE_STORE_PASSWORD_FILE names,
    without its trailing newline), None when neither is set; StoreUrlError naming the file when it cannot be read."""
    var, var_file = STORE_PASSWORD_VARS
    if env.get(var):
        return env[var]
    path = env.get(var_file)
    if not path:
        return None
    try:
        with open(path, encoding="utf-8") as fh:
            return fh.read().strip()
    except OSError as exc:
        raise StoreUrlError(f"{var_file}={path!r}: {exc.strerror}") from None


def with_store_password(text: str, env: Mapping[str, str] | None = None) -> str:
    """`text` given the store password of `env` (store_password), as the collector takes it: `text` as it is when
    none is set; StoreUrlError when the URL is not a server's or carries a password of its own."""
    password = store_password(os.environ if env is None else env)
    if password is None:
        return text
    try:
        return with_password(text, password)
    except StoreUrlError as exc:
        raise StoreUrlError(f"{STORE_PASSWORD_VARS[0]}: {exc}") from None


def reading_store_url(text: str, env: Mapping[str, str] | None = None) -> str:
    """The URL a command that reads the store connects with: a server URL that carries no password gets the store
    password of `env`, as `stepline collect` does (`docker compose exec stepline stepline doctor` reads the secret
    file the collector beside it reads); an embedded store, or a URL given with its password, as it is."""
    url = parse_store_url(text)
    if url.embedded or url.password:
        return text
    return with_store_password(text, env)


def _options(query: str, text: str, known: tuple[str, ...]) -> dict[str, str]:
    """The URL's query parameters, each given once and each one stepline knows."""
    options: dict[str, str] = {}
    for name, values in parse_qs(query, keep_blank_values=True).items():
        if name not in known:
            raise StoreUrlError(f"store URL {text!r} has the parameter {name!r}: it knows {', '.join(known)}")
        if len(values) > 1:
            raise StoreUrlError(f"store URL {text!r} gives {name!r} {len(values)} times")
        options[name] = values[0]
    return options


def _cluster(options: dict[str, str], text: str) -> str:
    if "cluster" not in options:
        return ""
    name = options["cluster"]
    if not name or not all(ch.isalnum() or ch in "_-" for ch in name):
        raise StoreUrlError(f"store URL {text!r}: cluster name {name!r} must be letters, digits, _ or -")
    return name


def _identifier(database: str, text: str) -> str:
    if not database or not all(ch.isalnum() or ch == "_" for ch in database):
        raise StoreUrlError(f"store URL {text!r}: database name {database!r} must be letters, digits or _")
    return database
