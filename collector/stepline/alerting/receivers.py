"""Who an alert reaches: a `Receiver` names a route (critical pages, warning tickets, the Watchdog heartbeat) and one
integration (Slack, PagerDuty, e-mail, webhook) whose secret Alertmanager and Grafana read from a file.

Public: `Receiver`, `parse` (the command line's `ROUTE=KIND:KEY=VALUE,...`), `routed` (each route's receivers, the
defaults filled in), `alertmanager_config` and `grafana_settings` (one integration, written for each), `ROUTES`,
`KINDS`, `RECEIVER_NAMES`.

Which secret fields exist is Alertmanager 0.25's (the one `amtool check-config` runs in the tests), from
prometheus/alertmanager `config/notifiers.go` and `docs/configuration.md` at v0.25.0: slack `api_url_file` (since 0.22),
pagerduty `routing_key_file`/`service_key_file` and email `auth_password_file` (both since 0.25). A webhook's `url_file`
came only in 0.26 (prometheus/alertmanager#3223), so a webhook's URL is written as it is and its secret, if any, is a
bearer token read through `http_config.authorization.credentials_file` (prometheus/common's HTTP client config).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol

from stepline.alerting import notifications
from stepline.core.usageerror import UsageError


class Routing(Protocol):
    """What the routes read of the alert config (stepline.alerting.config.AlertConfig, which holds the receivers:
    named here rather than imported, as the config imports this module's Receiver)."""

    @property
    def receivers(self) -> tuple[Receiver, ...]: ...
    @property
    def webhook_url(self) -> str: ...
    @property
    def heartbeat_url(self) -> str: ...
    @property
    def slack_api_url_file(self) -> str: ...

ROUTES = ("critical", "warning", "heartbeat")
RECEIVER_NAMES = {"critical": "stepline-page", "warning": "stepline-ticket", "heartbeat": "heartbeat"}
"""The Alertmanager receiver (and Grafana contact point, `stepline-` prefixed) each route delivers to."""


@dataclass(frozen=True)
class _Kind:
    required: tuple[str, ...] = ()
    optional: tuple[str, ...] = ()
    one_of: tuple[str, ...] = ()
    """Exactly one of these."""
    files: tuple[str, ...] = ()
    """The options that name a secret file."""

    @property
    def options(self) -> tuple[str, ...]:
        return (*self.required, *self.one_of, *self.optional)


KINDS = {
    "slack": _Kind(required=("api_url_file",), optional=("channel", "username"), files=("api_url_file",)),
    "pagerduty": _Kind(one_of=("routing_key_file", "service_key_file"), optional=("url",),
                       files=("routing_key_file", "service_key_file")),
    "email": _Kind(required=("to", "from", "smarthost"),
                   optional=("auth_username", "auth_password_file", "require_tls"), files=("auth_password_file",)),
    "webhook": _Kind(required=("url",), optional=("bearer_token_file", "max_alerts"), files=("bearer_token_file",)),
}
# A secret written into the config is refused: the message names the file option to use instead.
_INLINE_SECRETS = {"api_url": "api_url_file", "routing_key": "routing_key_file", "service_key": "service_key_file",
                   "auth_password": "auth_password_file", "bearer_token": "bearer_token_file"}
_HOST_PORT = re.compile(r"[A-Za-z0-9.-]+:\d{1,5}")
_ADDRESS = re.compile(r"[^@\s;]+@[^@\s;]+")


@dataclass(frozen=True)
class Receiver:
    """One integration on one route; options are the kind's `KEY=VALUE`s (`KINDS`), validated on construction."""

    route: str
    kind: str
    options: tuple[tuple[str, str], ...] = ()

    @classmethod
    def of(cls, route: str, kind: str, options: Mapping[str, str] | None = None, **more: str) -> Receiver:
        """`Receiver.of("critical", "slack", api_url_file="/run/secrets/slack")` (`options` for `from`)."""
        return cls(route, kind, tuple(sorted({**(options or {}), **more}.items())))

    def __post_init__(self) -> None:
        problem = _problem(self)
        if problem:
            raise UsageError(f"--receiver {self}: {problem}")

    def __str__(self) -> str:
        options = ",".join(f"{k}={v}" for k, v in self.options)
        return f"{self.route}={self.kind}" + (f":{options}" if options else "")

    def get(self, key: str, default: str = "") -> str:
        return dict(self.options).get(key, default)

    @property
    def addresses(self) -> list[str]:
        """An e-mail receiver's recipients (`to=a@example.com;b@example.com`)."""
        return [a.strip() for a in self.get("to").split(";") if a.strip()]

    def describe(self) -> str:
        """A few words for the generated file's header: where it delivers, where its secret is read from."""
        if self.kind == "slack":
            channel = f" {self.get('channel')}" if self.get("channel") else ""
            return f"slack{channel}, URL from {self.get('api_url_file')}"
        if self.kind == "pagerduty":
            key = "routing_key_file" if self.get("routing_key_file") else "service_key_file"
            return f"pagerduty, {key.removesuffix('_file').replace('_', ' ')} from {self.get(key)}"
        if self.kind == "email":
            auth = f", password from {self.get('auth_password_file')}" if self.get("auth_password_file") else ""
            return f"email to {', '.join(self.addresses)} via {self.get('smarthost')}{auth}"
        token = f", bearer token from {self.get('bearer_token_file')}" if self.get("bearer_token_file") else ""
        return f"webhook {self.get('url')}{token}"


def _problem(r: Receiver) -> str:
    """What is wrong with `r`, in a few words; "" when nothing is."""
    if r.route not in ROUTES:
        return f"route {r.route!r} is none of {', '.join(ROUTES)}"
    kind = KINDS.get(r.kind)
    if kind is None:
        return f"kind {r.kind!r} is none of {', '.join(KINDS)}"
    keys = [k for k, _ in r.options]
    if len(keys) != len(set(keys)):
        return "an option is given twice"
    for key, value in r.options:
        if key == "url_file" and r.kind == "webhook":
            return ("url_file needs Alertmanager 0.26 or later and these configs stay loadable by 0.25: give url= "
                    "and keep the secret in bearer_token_file=")
        if key in _INLINE_SECRETS and key not in kind.options:
            return f"{key} would write the secret into the config: put it in a file and give {_INLINE_SECRETS[key]}="
        if key not in kind.options:
            return f"{r.kind} takes {', '.join(kind.options)}, not {key!r}"
        if not value:
            return f"{key} is empty"
        if "$" in value:
            return f"{key} holds a `$`, which Grafana's provisioning would expand from its environment"
        if "," in value or any(ord(c) < 32 for c in value):
            return f"{key} holds a comma or a control character"
        if key in kind.files and (not value.startswith("/") or "}" in value):
            return f"{key} must be an absolute path without `}}` (Grafana reads it as $__file{{{value}}})"
    missing = [k for k in kind.required if not r.get(k)]
    if missing:
        return f"{r.kind} needs {', '.join(k + '=' for k in missing)}"
    if kind.one_of and sum(bool(r.get(k)) for k in kind.one_of) != 1:
        return f"{r.kind} needs exactly one of {', '.join(k + '=' for k in kind.one_of)}"
    return _kind_problem(r)


def _kind_problem(r: Receiver) -> str:
    if r.get("url") and not re.match(r"https?://[^/\s]+", r.get("url")):
        return f"url {r.get('url')!r} is not an http:// or https:// URL"
    if r.kind == "email":
        bad = [a for a in (*r.addresses, r.get("from")) if not _ADDRESS.fullmatch(a)]
        if bad or not r.addresses:
            return f"{bad[0] if bad else 'to'!r} is not an e-mail address (several: to=a@example.com;b@example.com)"
        if not _HOST_PORT.fullmatch(r.get("smarthost")):
            return f"smarthost {r.get('smarthost')!r} is not HOST:PORT"
        if bool(r.get("auth_username")) != bool(r.get("auth_password_file")):
            return "auth_username= and auth_password_file= go together"
        if r.get("require_tls") not in ("", "true", "false"):
            return f"require_tls {r.get('require_tls')!r} is neither true nor false"
    if r.kind == "webhook" and r.get("max_alerts") and not r.get("max_alerts").isdigit():
        return f"max_alerts {r.get('max_alerts')!r} is not a whole number"
    return ""


def parse(text: str) -> Receiver:
    """`ROUTE=KIND:KEY=VALUE,KEY=VALUE...` (the `--receiver` argument); UsageError naming what is wrong."""
    route, sep, rest = text.partition("=")
    kind, _, opts = rest.partition(":")
    if not sep or not kind:
        raise UsageError(f"--receiver {text}: expected ROUTE=KIND:KEY=VALUE,... "
                         "(e.g. critical=pagerduty:routing_key_file=/etc/alertmanager/secrets/pagerduty_routing_key)")
    options: list[tuple[str, str]] = []
    for item in opts.split(",") if opts else []:
        key, eq, value = item.partition("=")
        if not eq or not key:
            raise UsageError(f"--receiver {text}: {item!r} is not KEY=VALUE")
        if key in dict(options):
            raise UsageError(f"--receiver {text}: {key} is given twice")
        options.append((key.strip(), value.strip()))
    return Receiver(route.strip(), kind.strip(), tuple(sorted(options)))


def routed(cfg: Routing) -> dict[str, tuple[Receiver, ...]]:
    """Each route's receivers: those `cfg.receivers` names for it, else its default (`AlertConfig.receivers`)."""
    out: dict[str, tuple[Receiver, ...]] = {}
    for route in ROUTES:
        named = tuple(r for r in cfg.receivers if r.route == route)
        if len(set(named)) != len(named):
            raise UsageError(f"--receiver {next(r for r in named if named.count(r) > 1)}: named twice")
        out[route] = named or _default(cfg, route)
    return out


def named_routes(cfg: Routing) -> set[str]:
    """The routes `cfg.receivers` names a receiver for (Grafana delivers those itself)."""
    return {r.route for r in cfg.receivers}


def _default(cfg: Routing, route: str) -> tuple[Receiver, ...]:
    if route == "heartbeat":
        return (Receiver.of(route, "webhook", url=cfg.heartbeat_url),) if cfg.heartbeat_url else ()
    if cfg.webhook_url:
        return (Receiver.of(route, "webhook", url=cfg.webhook_url),)
    return (Receiver.of(route, "slack", api_url_file=cfg.slack_api_url_file),)


def alertmanager_config(r: Receiver) -> tuple[str, dict[str, object]]:
    """(`<kind>_configs`, one entry of it) for Alertmanager's `receivers:`; resolutions are sent except the
    heartbeat's (the Watchdog never resolves)."""
    resolved = r.route != "heartbeat"
    out: dict[str, object] = {"send_resolved": resolved}
    if r.kind == "slack":
        # slack_config `api_url_file`: read on every notification, trimmed (notify/slack/slack.go at v0.25.0).
        out.update(api_url_file=r.get("api_url_file"), title=notifications.NOTIFICATION_TITLE,
                   text=notifications.NOTIFICATION_TEXT)
        out.update({k: r.get(k) for k in ("channel", "username") if r.get(k)})
    elif r.kind == "pagerduty":
        # pagerduty_config `routing_key_file` / `service_key_file` (v0.25.0 docs/configuration.md,
        # `<pagerduty_config>`), read on every notification and trimmed (notify/pagerduty/pagerduty.go).
        key = "routing_key_file" if r.get("routing_key_file") else "service_key_file"
        out.update({key: r.get(key), "description": notifications.NOTIFICATION_TITLE,
                    "severity": notifications.PAGERDUTY_SEVERITY})
        out.update({"url": r.get("url")} if r.get("url") else {})
    elif r.kind == "email":
        # email_config `auth_password_file` (v0.25.0 docs/configuration.md, `<email_config>`): 0.25 and 0.26 send the
        # file's bytes as they are, a final newline included (trimmed from 0.27, prometheus/alertmanager 4271a77).
        out.update({"to": ", ".join(r.addresses), "from": r.get("from"), "smarthost": r.get("smarthost"),
                    "headers": {"Subject": notifications.NOTIFICATION_TITLE}, "text": notifications.NOTIFICATION_TEXT})
        if r.get("auth_password_file"):
            out.update(auth_username=r.get("auth_username"), auth_password_file=r.get("auth_password_file"))
        if r.get("require_tls"):
            out["require_tls"] = r.get("require_tls") == "true"
    else:
        out["url"] = r.get("url")
        if r.get("max_alerts"):
            out["max_alerts"] = int(r.get("max_alerts"))
        if r.get("bearer_token_file"):
            # webhook_config has no url_file before 0.26; its http_config's authorization reads a credentials_file.
            out["http_config"] = {"authorization": {"type": "Bearer", "credentials_file": r.get("bearer_token_file")}}
    return f"{r.kind}_configs", out


def grafana_settings(r: Receiver) -> dict[str, object]:
    """The `settings` of a Grafana contact point integration of type `r.kind` (grafana/alerting
    `receivers/<kind>/v1/config.go`). Secrets are `$__file{path}`: Grafana's provisioning expands it when it reads the
    file, trimmed, and refuses the file when the path is missing (grafana/grafana
    `pkg/services/provisioning/values/values.go` `interpolateValue` -> `pkg/setting/expanders.go` `fileExpander`;
    contact point settings are interpolated since grafana/grafana#55666; https://grafana.com/docs/grafana/latest/
    alerting/set-up/provision-alerting-resources/file-provisioning/#template-variable-interpolation)."""
    def secret(key: str) -> str:
        return "$__file{" + r.get(key) + "}"

    if r.kind == "slack":
        out: dict[str, object] = {"url": secret("api_url_file"), "title": notifications.NOTIFICATION_TITLE,
                                  "text": notifications.NOTIFICATION_TEXT}
        out.update({k: r.get(v) for k, v in (("recipient", "channel"), ("username", "username")) if r.get(v)})
        return out
    if r.kind == "pagerduty":
        # Grafana speaks Events API v2 only: a service key (v1, "Prometheus" integration type) may be refused there.
        key = "routing_key_file" if r.get("routing_key_file") else "service_key_file"
        out = {"integrationKey": secret(key), "severity": notifications.PAGERDUTY_SEVERITY,
               "summary": notifications.NOTIFICATION_TITLE}
        out.update({"url": r.get("url")} if r.get("url") else {})
        return out
    if r.kind == "email":
        # Grafana sends through its own [smtp] settings (grafana.ini / GF_SMTP_*): smarthost, from and auth are
        # Alertmanager's only.
        return {"addresses": ";".join(r.addresses), "singleEmail": True, "subject": notifications.NOTIFICATION_TITLE,
                "message": notifications.NOTIFICATION_TEXT}
    out = {"url": r.get("url"), "httpMethod": "POST", "title": notifications.NOTIFICATION_TITLE,
           "message": notifications.NOTIFICATION_TEXT}
    if r.get("max_alerts"):
        out["maxAlerts"] = int(r.get("max_alerts"))
    if r.get("bearer_token_file"):
        out.update(authorization_scheme="Bearer", authorization_credentials=secret("bearer_token_file"))
    return out
