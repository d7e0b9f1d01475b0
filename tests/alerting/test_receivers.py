"""Receivers: the `--receiver` spec and its one-line refusals, the default, and each kind written for Alertmanager
(checked by `amtool check-config` and `amtool config routes test`) and for Grafana (read as Grafana's provisioning
reads it: `$__file{}` expanded, nothing else)."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from stepline.alerting import yamlout
from stepline.alerting.build import render
from stepline.alerting.config import AlertConfig
from stepline.alerting.grafana import CONTACT_POINT, contact_points_file, policies_file
from stepline.alerting.notifications import NOTIFICATION_TEXT, NOTIFICATION_TITLE
from stepline.alerting.prometheus import alertmanager
from stepline.alerting.receivers import Receiver, alertmanager_config, grafana_settings, parse, routed
from stepline.cli.main import main
from stepline.core.usageerror import UsageError
from tests.alerting.test_grafana import interpolate

ROOT = Path(__file__).resolve().parents[2]
AMTOOL = shutil.which("amtool")
needs_amtool = pytest.mark.skipif(
    AMTOOL is None, reason="amtool not installed (apt-get install prometheus-alertmanager)")

SECRETS = "/etc/alertmanager/secrets"
EVERY_KIND = (
    f"critical=pagerduty:routing_key_file={SECRETS}/pagerduty_routing_key",
    f"critical=slack:api_url_file={SECRETS}/slack_api_url,channel=#vllm-oncall",
    "warning=email:to=oncall@example.com;vllm@example.com,from=alertmanager@example.com,"
    f"smarthost=smtp.example.com:587,auth_username=alertmanager,auth_password_file={SECRETS}/smtp_password",
    f"warning=webhook:url=https://tickets.example.com/hooks/alertmanager,bearer_token_file={SECRETS}/tickets_token",
    "heartbeat=webhook:url=https://deadman.example.com/ping",
)


def every_kind() -> AlertConfig:
    return AlertConfig(receivers=tuple(parse(text) for text in EVERY_KIND))


def _amtool(*args: str) -> str:
    proc = subprocess.run([str(AMTOOL), *args], capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0, f"amtool {' '.join(args)}:\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout


# --- the spec ------------------------------------------------------------------------------------------------

def test_a_spec_parses_into_its_route_kind_and_options_and_prints_back() -> None:
    r = parse("critical=slack:channel=#vllm,api_url_file=/run/secrets/slack")
    assert (r.route, r.kind) == ("critical", "slack")
    assert r.get("api_url_file") == "/run/secrets/slack" and r.get("channel") == "#vllm"
    assert str(r) == "critical=slack:api_url_file=/run/secrets/slack,channel=#vllm"
    assert parse(str(r)) == r == Receiver.of("critical", "slack", api_url_file="/run/secrets/slack", channel="#vllm")
    email = parse("warning=email:to=a@example.com;b@example.com,from=am@example.com,smarthost=smtp:25")
    assert email.addresses == ["a@example.com", "b@example.com"]


@pytest.mark.parametrize(("spec", "problem"), [
    ("critical", "expected ROUTE=KIND:KEY=VALUE"),
    ("critical=slack", "slack needs api_url_file="),
    ("pager=slack:api_url_file=/s", "route 'pager' is none of critical, warning, heartbeat"),
    ("critical=sms:to=123", "kind 'sms' is none of slack, pagerduty, email, webhook"),
    ("critical=slack:api_url=https://hooks.slack.com/services/T/B/X", "put it in a file and give api_url_file="),
    ("critical=pagerduty:routing_key=abc", "give routing_key_file="),
    ("warning=email:to=a@b.c,from=a@b.c,smarthost=h:25,auth_username=u,auth_password=pw", "auth_password_file="),
    ("critical=slack:api_url_file=secrets/slack", "api_url_file must be an absolute path"),
    ("critical=slack:api_url_file=/s,token=xoxb", "slack takes api_url_file, channel, username, not 'token'"),
    ("critical=pagerduty:url=https://events.eu.pagerduty.com/v2/enqueue", "exactly one of routing_key_file="),
    ("critical=pagerduty:routing_key_file=/a,service_key_file=/b", "exactly one of routing_key_file="),
    ("warning=webhook:url_file=/u", "url_file needs Alertmanager 0.26"),
    ("warning=webhook:url=ftp://tickets", "is not an http:// or https:// URL"),
    ("warning=webhook:url=https://tickets/$TOKEN", "holds a `$`"),
    ("warning=webhook:url=https://t,max_alerts=many", "max_alerts 'many' is not a whole number"),
    ("warning=email:to=oncall,from=a@b.c,smarthost=h:25", "'oncall' is not an e-mail address"),
    ("warning=email:to=a@b.c,from=a@b.c,smarthost=smtp.example.com", "is not HOST:PORT"),
    ("warning=email:to=a@b.c,from=a@b.c,smarthost=h:25,auth_username=u", "go together"),
    ("warning=email:to=a@b.c,from=a@b.c,smarthost=h:25,require_tls=yes", "neither true nor false"),
    ("critical=slack:api_url_file=/a,api_url_file=/b", "api_url_file is given twice"),
    ("critical=slack:api_url_file", "'api_url_file' is not KEY=VALUE"),
    ("critical=slack:api_url_file=", "api_url_file is empty"),
])
def test_a_bad_spec_is_refused_in_one_line_naming_the_problem(spec: str, problem: str) -> None:
    with pytest.raises(UsageError) as err:
        parse(spec)
    message = str(err.value)
    assert "\n" not in message
    assert message.startswith("--receiver "), message
    assert problem in message, message


def test_the_command_line_refuses_a_bad_receiver_before_writing_anything(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "alerts"
    assert main(["alerts", "build", "--out", str(out), "--kustomization", "",
                 "--receiver", "critical=slack:api_url=https://hooks.slack.com/x"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("stepline: --receiver critical=slack:api_url="), err
    assert not out.exists()
    twice = f"critical=slack:api_url_file={SECRETS}/slack"
    assert main(["alerts", "build", "--out", str(out), "--kustomization", "", "--receiver", twice,
                 "--receiver", twice]) == 2
    assert "named twice" in capsys.readouterr().err
    assert not out.exists()


def test_the_command_line_writes_the_receivers_it_is_given(tmp_path: Path) -> None:
    out = tmp_path / "alerts"
    args = [a for spec in EVERY_KIND for a in ("--receiver", spec)]
    assert main(["alerts", "build", "--out", str(out), "--kustomization", "", *args]) == 0
    assert (out / "alertmanager.example.yaml").read_text() == render(every_kind())["alertmanager.example.yaml"]
    assert (out / "grafana/contact-points.yaml").read_text() == render(every_kind())["grafana/contact-points.yaml"]


# --- Alertmanager ----------------------------------------------------------------------------------------------

def _receivers(cfg: AlertConfig) -> dict[str, dict[str, Any]]:
    am: Any = alertmanager(cfg)
    return {r["name"]: r for r in am["receivers"]}


def test_the_default_reaches_slack_through_a_secret_file_and_says_so() -> None:
    cfg = AlertConfig()
    receivers = _receivers(cfg)
    assert set(receivers) == {"stepline-page", "stepline-ticket", "heartbeat"}
    for name in ("stepline-page", "stepline-ticket"):
        [slack] = receivers[name]["slack_configs"]
        assert slack["api_url_file"] == cfg.slack_api_url_file and "api_url" not in slack
        assert slack["title"] == NOTIFICATION_TITLE and slack["text"] == NOTIFICATION_TEXT
        assert slack["send_resolved"] is True
    assert receivers["heartbeat"] == {"name": "heartbeat"}
    header = render(cfg)["alertmanager.example.yaml"].split("\nglobal:")[0]
    assert cfg.slack_api_url_file in header and "nobody" in header and "--receiver" in header
    committed = (ROOT / "alerts/alertmanager.example.yaml").read_text(encoding="utf-8")
    assert not re.search(r"//(127\.0\.0\.1|localhost)[:/]", committed), "nothing listens there"
    assert f"api_url_file: {cfg.slack_api_url_file}" in committed


def test_a_route_named_replaces_its_default_and_the_others_keep_theirs() -> None:
    cfg = AlertConfig(receivers=(parse(f"critical=pagerduty:routing_key_file={SECRETS}/pd"),))
    by_route = routed(cfg)
    assert [r.kind for r in by_route["critical"]] == ["pagerduty"]
    assert [(r.kind, r.get("api_url_file")) for r in by_route["warning"]] == [("slack", cfg.slack_api_url_file)]
    assert by_route["heartbeat"] == ()
    header = render(cfg)["alertmanager.example.yaml"].split("\nglobal:")[0]
    assert f"pagerduty, routing key from {SECRETS}/pd" in header
    assert "warning -> receiver stepline-ticket (and whatever no route matches) (default)" in header


def test_each_kind_is_written_with_its_secret_file_and_the_shared_texts() -> None:
    receivers = _receivers(every_kind())
    [pagerduty] = receivers["stepline-page"]["pagerduty_configs"]
    assert pagerduty == {"routing_key_file": f"{SECRETS}/pagerduty_routing_key", "send_resolved": True,
                         "description": NOTIFICATION_TITLE, "severity": pagerduty["severity"]}
    assert "critical" in pagerduty["severity"] and "$" not in pagerduty["severity"]
    [slack] = receivers["stepline-page"]["slack_configs"]
    assert slack["channel"] == "#vllm-oncall" and slack["api_url_file"] == f"{SECRETS}/slack_api_url"
    [email] = receivers["stepline-ticket"]["email_configs"]
    assert email["to"] == "oncall@example.com, vllm@example.com"
    assert email["auth_password_file"] == f"{SECRETS}/smtp_password" and "auth_password" not in email
    assert email["headers"] == {"Subject": NOTIFICATION_TITLE} and email["text"] == NOTIFICATION_TEXT
    [ticket] = receivers["stepline-ticket"]["webhook_configs"]
    assert ticket["url"] == "https://tickets.example.com/hooks/alertmanager"
    assert ticket["http_config"] == {"authorization": {"type": "Bearer",
                                                       "credentials_file": f"{SECRETS}/tickets_token"}}
    [heartbeat] = receivers["heartbeat"]["webhook_configs"]
    assert heartbeat == {"url": "https://deadman.example.com/ping", "send_resolved": False}
    assert alertmanager_config(parse("critical=pagerduty:service_key_file=/s,url=https://pd.example/v2"))[1][
        "service_key_file"] == "/s"


def test_the_loopback_webhook_of_the_test_stacks_still_replaces_the_defaults() -> None:
    cfg = AlertConfig(webhook_url="http://127.0.0.1:1/stepline", heartbeat_url="http://127.0.0.1:1/heartbeat")
    receivers = _receivers(cfg)
    assert receivers["stepline-page"]["webhook_configs"] == [{"url": "http://127.0.0.1:1/stepline",
                                                              "send_resolved": True}]
    assert receivers["heartbeat"]["webhook_configs"] == [{"url": "http://127.0.0.1:1/heartbeat",
                                                          "send_resolved": False}]


@needs_amtool
@pytest.mark.parametrize("which", ["default", "every kind"])
def test_amtool_accepts_the_config_and_routes_by_severity(which: str, tmp_path: Path) -> None:
    cfg = AlertConfig() if which == "default" else every_kind()
    config = tmp_path / "alertmanager.yaml"
    config.write_text(render(cfg)["alertmanager.example.yaml"])
    out = _amtool("check-config", str(config))
    assert "SUCCESS" in out and " - 3 receivers" in out, out

    def route(*labels: str) -> str:
        return _amtool("config", "routes", "test", f"--config.file={config}", *labels).strip()

    assert route("alertname=EngineStalled", "severity=critical", "engine=e1") == "stepline-page"
    assert route("alertname=DecodeStarvation", "severity=warning", "engine=e1") == "stepline-ticket"
    assert route("alertname=Watchdog", "severity=none") == "heartbeat"


@needs_amtool
def test_amtool_refuses_a_webhook_url_file_which_is_why_the_spec_does(tmp_path: Path) -> None:
    """Alertmanager 0.25 has no webhook `url_file` (0.26 added it): were it written, the config would not load."""
    am: Any = alertmanager(AlertConfig(webhook_url="https://tickets.example.com/hook"))
    am["receivers"][0]["webhook_configs"][0]["url_file"] = f"{SECRETS}/url"
    config = tmp_path / "alertmanager.yaml"
    config.write_text(yamlout.dump(am))
    proc = subprocess.run([str(AMTOOL), "check-config", str(config)], capture_output=True, text=True, timeout=30)
    assert proc.returncode != 0 and "url_file" in proc.stdout + proc.stderr


# --- Grafana ---------------------------------------------------------------------------------------------------

def _provisioned(doc: dict[str, Any], files: dict[str, str]) -> dict[str, list[dict[str, Any]]]:
    """Contact point name -> its integrations as Grafana stores them: every settings string interpolated."""
    def settle(v: object) -> object:
        return interpolate(v, files=files) if isinstance(v, str) else v

    return {cp["name"]: [{**r, "settings": {k: settle(v) for k, v in r["settings"].items()}}
                         for r in cp["receivers"]] for cp in doc["contactPoints"]}


def test_grafana_gets_a_contact_point_per_named_route_with_its_secrets_read_from_files() -> None:
    cfg = every_kind()
    files = {f"{SECRETS}/pagerduty_routing_key": "pd-key\n", f"{SECRETS}/slack_api_url": "https://hooks.slack/x\n",
             f"{SECRETS}/tickets_token": "tok\n"}
    doc: Any = yaml.safe_load(render(cfg)["grafana/contact-points.yaml"])
    points = _provisioned(doc, files)
    assert set(points) == {"stepline-page", "stepline-ticket", "stepline-heartbeat"}, "every route is named"
    page = {r["type"]: r for r in points["stepline-page"]}
    assert page["pagerduty"]["settings"]["integrationKey"] == "pd-key"
    assert page["slack"]["settings"]["url"] == "https://hooks.slack/x"
    assert page["slack"]["settings"]["recipient"] == "#vllm-oncall"
    ticket = {r["type"]: r for r in points["stepline-ticket"]}
    assert ticket["email"]["settings"]["addresses"] == "oncall@example.com;vllm@example.com"
    assert ticket["webhook"]["settings"]["authorization_credentials"] == "tok"
    assert ticket["webhook"]["settings"]["authorization_scheme"] == "Bearer"
    [heartbeat] = points["stepline-heartbeat"]
    assert heartbeat["disableResolveMessage"] is True
    # The texts survive Grafana's interpolation unchanged: the notification says what the alert's annotations say.
    for integrations in points.values():
        for r in integrations:
            for key in ("title", "text", "message", "subject", "summary"):
                if key in r["settings"]:
                    assert r["settings"][key] in (NOTIFICATION_TITLE, NOTIFICATION_TEXT), (r["uid"], key)
    uids = [r["uid"] for cp in doc["contactPoints"] for r in cp["receivers"]]
    assert len(uids) == len(set(uids)) and all(len(u) <= 40 and re.fullmatch(r"[a-z0-9-]+", u) for u in uids)
    with pytest.raises(FileNotFoundError):  # a secret Grafana cannot read fails its provisioning, loudly
        _provisioned(doc, {})


def test_grafana_routes_named_routes_itself_and_forwards_the_rest_to_alertmanager() -> None:
    cfg = AlertConfig(receivers=(parse(f"critical=pagerduty:routing_key_file={SECRETS}/pd"),))
    points: Any = contact_points_file(cfg)
    assert [cp["name"] for cp in points["contactPoints"]] == [CONTACT_POINT, "stepline-page"]
    policy: Any = policies_file(cfg)
    [tree] = policy["policies"]
    assert tree["receiver"] == CONTACT_POINT
    to = {route["object_matchers"][0][2]: route["receiver"] for route in tree["routes"]}
    assert to == {"Watchdog": CONTACT_POINT, "critical": "stepline-page", "warning": CONTACT_POINT}
    named = {cp["name"] for cp in points["contactPoints"]}
    assert {tree["receiver"], *to.values()} <= named, "a policy names a contact point the file does not define"


def test_grafana_can_forward_everything_to_alertmanager_instead() -> None:
    cfg = AlertConfig(receivers=every_kind().receivers, grafana_via_alertmanager=True)
    points: Any = contact_points_file(cfg)
    assert [cp["name"] for cp in points["contactPoints"]] == [CONTACT_POINT]
    policy: Any = policies_file(cfg)
    [tree] = policy["policies"]
    assert {tree["receiver"], *(r["receiver"] for r in tree["routes"])} == {CONTACT_POINT}


def test_the_default_grafana_files_forward_to_alertmanager_unchanged() -> None:
    rendered = render(AlertConfig())
    for rel in ("grafana/contact-points.yaml", "grafana/notification-policies.yaml"):
        assert (ROOT / "alerts" / rel).read_text(encoding="utf-8") == rendered[rel]
    doc: Any = yaml.safe_load(rendered["grafana/contact-points.yaml"])
    assert [cp["name"] for cp in doc["contactPoints"]] == [CONTACT_POINT], "no secret file Grafana must mount"


def test_grafana_settings_of_each_kind() -> None:
    assert grafana_settings(parse("critical=pagerduty:service_key_file=/s,url=https://pd.example/v2"))[
        "integrationKey"] == "$__file{/s}"
    webhook = grafana_settings(parse("warning=webhook:url=https://t.example/h,max_alerts=5"))
    assert webhook["maxAlerts"] == 5 and "authorization_credentials" not in webhook
    email = grafana_settings(parse("warning=email:to=a@b.c,from=d@e.f,smarthost=smtp:25"))
    assert "smarthost" not in email and email["singleEmail"] is True, "Grafana mails through its own [smtp]"
