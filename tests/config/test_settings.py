"""Settings: environment defaults, command-line overrides, and one clear line per bad value."""

from __future__ import annotations

from pathlib import Path

import pytest

from stepline.config.settings import Settings, SettingsError, split_named_url
from stepline.store.url import parse_store_url


def test_environment_then_overrides() -> None:
    env = {"STEPLINE_STORE": "http://ch:8123/tl", "STEPLINE_ENGINES": "http://a:8000, b=http://b:8000",
           "STEPLINE_SCRAPE_INTERVAL": "2.5", "STEPLINE_RETENTION_DAYS": "7"}
    s = Settings.from_env(env, retention_days=14, metrics_port=None)
    assert s.store == "http://ch:8123/tl"
    assert s.engines == ("http://a:8000", "b=http://b:8000")
    assert s.scrape_interval_s == 2.5
    assert s.retention_days == 14  # the command line wins
    assert s.metrics_port == 9465  # None means "not given"


def test_password_from_a_file_is_never_shown(tmp_path: Path) -> None:
    secret = tmp_path / "pw"
    secret.write_text("hunter2\n")
    s = Settings.from_env({"STEPLINE_QUERY_PASSWORD_FILE": str(secret)})
    assert s.query_password == "hunter2"
    assert "hunter2" not in repr(s)


@pytest.mark.parametrize(
    ("env", "overrides", "fragment"),
    [
        ({"STEPLINE_SCRAPE_INTERVAL": "fast"}, {}, "STEPLINE_SCRAPE_INTERVAL='fast'"),
        ({}, {"store": "ftp://x"}, "scheme 'ftp'"),
        ({}, {"retention_days": 0}, "retention must be at least 1 day"),
        ({}, {"metrics_port": 70000}, "metrics-port 70000 is not a TCP port"),
        ({}, {"listen": "somewhere"}, "listen address 'somewhere'"),
        ({}, {"engines": ("localhost:8000",)}, "engine 'localhost:8000' must be http(s)://"),
        ({}, {"scrape_interval_s": 1.0, "scrape_timeout_s": 3.0}, "exceeds the scrape interval"),
        ({"STEPLINE_QUERY_PASSWORD_FILE": "/nonexistent/pw"}, {}, "No such file"),
        ({}, {"engine_processes": ("prod=vllm",)}, "must be NAME=PID or NAME=cmdline:TEXT"),
        ({}, {"listen": "0.0.0.0"}, "--listen 0.0.0.0 would serve the store's SQL with no password: set "
                                    "STEPLINE_QUERY_PASSWORD"),
        ({}, {"listen": "::"}, "STEPLINE_QUERY_OPEN=1"),
        ({}, {"lane_bars": ("heavy=100k",)}, "lane bar 'heavy=100k' must be LANE=TOKENS"),
        ({"STEPLINE_LANE_BARS": "heavy=0"}, {}, "lane bar 'heavy=0' must be LANE=TOKENS"),
        ({}, {"backends": ("vllm-0",)}, "backend 'vllm-0' must be ADDRESS=ENGINE"),
        ({"STEPLINE_BACKENDS": "vllm.svc=vllm-0"}, {}, "backend 'vllm.svc=vllm-0' must be ADDRESS=ENGINE"),
        ({}, {"backends": ("vllm.svc:8000=",)}, "backend 'vllm.svc:8000=' must be ADDRESS=ENGINE"),
    ],
)
def test_bad_values_are_named(env: dict[str, str], overrides: dict[str, object], fragment: str) -> None:
    with pytest.raises(SettingsError) as info:
        Settings.from_env(env, **overrides)
    assert fragment in str(info.value)
    assert "\n" not in str(info.value)


def test_the_store_password_alone_from_a_mounted_secret(tmp_path: Path) -> None:
    # The Secret's one key, mounted as a file: the URL names no password, the collector's environment holds none.
    secret = tmp_path / "password"
    secret.write_text("p@ss:w/rd\n")
    s = Settings.from_env({"STEPLINE_STORE": "http://default@clickhouse:8123/stepline",
                           "STEPLINE_STORE_PASSWORD_FILE": str(secret)})
    url = parse_store_url(s.store)
    assert (url.username, url.password, url.host, url.port, url.database) == (
        "default", "p@ss:w/rd", "clickhouse", 8123, "stepline")
    assert "p@ss" not in repr(s)
    with pytest.raises(SettingsError, match="carries a password and a store password is set too"):
        Settings.from_env({"STEPLINE_STORE": "http://u:x@h:8123/db", "STEPLINE_STORE_PASSWORD": "y"})
    with pytest.raises(SettingsError, match="not chdb://"):
        Settings.from_env({"STEPLINE_STORE": "chdb:///tmp/x", "STEPLINE_STORE_PASSWORD": "y"})


def test_store_url_from_a_file_is_never_shown(tmp_path: Path) -> None:
    # One Kubernetes Secret key mounted as a file: the password is in no container's environment.
    url = tmp_path / "store-url"
    url.write_text("http://default:hunter2@clickhouse:8123/stepline\n")
    s = Settings.from_env({"STEPLINE_STORE_FILE": str(url)})
    assert s.store == "http://default:hunter2@clickhouse:8123/stepline"
    assert "hunter2" not in repr(s)
    assert Settings.from_env({"STEPLINE_STORE": "chdb:///x", "STEPLINE_STORE_FILE": str(url)}).store == "chdb:///x"
    assert Settings.from_env({"STEPLINE_STORE_FILE": str(url)}, store="chdb:///y").store == "chdb:///y"
    with pytest.raises(SettingsError, match="STEPLINE_STORE_FILE='/nonexistent/url'"):
        Settings.from_env({"STEPLINE_STORE_FILE": "/nonexistent/url"})


def test_engine_and_gateway_names_are_split_from_their_url() -> None:
    assert split_named_url("sim=http://127.0.0.1:8000") == ("sim", "http://127.0.0.1:8000")
    assert split_named_url("http://127.0.0.1:8000/?a=b") == ("", "http://127.0.0.1:8000/?a=b")
    assert split_named_url("localhost:8000") == ("", "localhost:8000")


def test_off_loopback_the_query_endpoint_needs_a_password_or_an_explicit_open() -> None:
    assert Settings.from_env({"STEPLINE_QUERY_PASSWORD": "pw"}, listen="0.0.0.0").listen == "0.0.0.0"
    assert Settings.from_env({"STEPLINE_QUERY_OPEN": "1"}, listen="10.0.0.5").query_open
    assert Settings.from_env({}, listen="127.0.0.2").query_password is None  # loopback: as before
    # A ClickHouse server store has no query endpoint to guard.
    assert Settings.from_env({"STEPLINE_STORE": "http://ch:8123/tl"}, listen="0.0.0.0").listen == "0.0.0.0"


def test_lane_bars_are_tokens_per_lane() -> None:
    settings = Settings.from_env({"STEPLINE_LANE_BARS": "heavy=100000tokens, xl = 400000"})
    assert settings.lane_bar_map() == {"heavy": 100_000, "xl": 400_000}


def test_backends_name_the_engines_behind_an_address() -> None:
    settings = Settings.from_env({"STEPLINE_BACKENDS": "vllm.svc:8000=vllm-0,http://vllm.svc:8000/v1=vllm-1"},
                                 backends=None)
    assert settings.backend_map() == {("vllm.svc", 8000): ("vllm-0", "vllm-1")}


def test_the_collector_counts_the_objectives_of_its_file_and_refuses_a_bad_one(tmp_path: Path) -> None:
    path = tmp_path / "objectives.toml"
    path.write_text('[[objective]]\nname = "team_up"\nsli = "gateway_availability"\nscope = "tenant"\n')
    slo = Settings.from_env({"STEPLINE_OBJECTIVES_FILE": str(path)}).validated().slo()
    assert [(o.name, o.scope) for o in slo.objectives] == [("team_up", "tenant")]
    assert Settings.from_env({}).slo().objectives[0].name == "ttft"  # none given: the built-in ones
    with pytest.raises(SettingsError, match=f"objectives file {tmp_path / 'absent.toml'}: No such file"):
        Settings.from_env({"STEPLINE_OBJECTIVES_FILE": str(tmp_path / "absent.toml")}).validated()
