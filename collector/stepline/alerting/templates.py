"""Renders the `[placeholder]`s of the alert texts as Prometheus or Grafana annotation templates, and holds the
notification templates every receiver sends (`NOTIFICATION_TITLE`, `NOTIFICATION_TEXT`)."""

from __future__ import annotations

import re

from stepline.alerting.config import AlertConfig

LABELS = ("engine", "gpu", "xid", "reason", "instance", "source", "kind", "gateway", "lane", "objective",
          "long_window")
_TOKEN = re.compile(r"\[(" + "|".join((*LABELS, "value", "value_duration", "value_ratio", "value_rate",
                                       "state", "budget", "age", "waiting", "running", "finding", "gpus",
                                       "scope")) + r")\]")
# An SLO's series keep the one label of its scope (model, lane, engine or tenant), the others summed away: absent
# labels render empty in both backends' `$labels`, so this names whichever it is.
SCOPE = "{{ $labels.model }}{{ $labels.lane }}{{ $labels.engine }}{{ $labels.tenant }}"

# Grafana auxiliary instant queries (refId -> PromQL with `{sel}`); their results are in `$values`.
GRAFANA_AUX = {
    "STATE": "max by (engine, state) (stepline_engine_state{sel} == 1)",
    "BUDGET": "max by (engine) (stepline_engine_progress_budget_seconds{sel})",
    "AGE": "max by (engine) (stepline_engine_progress_age_seconds{sel})",
    "WAITING": "max by (engine) (stepline_engine_waiting_requests{sel})",
    "RUNNING": "max by (engine) (stepline_engine_running_requests{sel})",
    "FINDING": "max by (engine, kind, severity, title) (stepline_engine_top_finding_info{sel})",
    "GPU": "max by (engine) (stepline_engine_gpu_utilization_ratio{sel})",
}
_AUX_OF = {"state": "STATE", "budget": "BUDGET", "age": "AGE", "waiting": "WAITING", "running": "RUNNING",
           "finding": "FINDING", "gpus": "GPU"}
# What a page may say of an engine's GPUs: idle only where it has a reading (the watchdog exports none without one).
GPUS_IDLE, NO_GPU_READINGS = "GPUs idle", "no GPU readings"



def _per_engine(cfg: AlertConfig, metric: str, suffix: str = "") -> str:
    """A Go raw-string PromQL query for this alert's engine (backquotes: the selector has double quotes)."""
    matchers = ", ".join(m for m in (cfg.selector, 'engine="%s"') if m)
    return f"`{metric}{{{matchers}}}{suffix}`"


def prometheus(cfg: AlertConfig, text: str) -> str:
    """Prometheus annotation template: labels, `$value`, and `query` look-ups for the watchdog context."""
    def value_of(metric: str, fmt: str) -> str:
        q = _per_engine(cfg, metric)
        return f"{{{{ with printf {q} $labels.engine | query }}}}{{{{ . | first | value | {fmt} }}}}" \
               "{{ else }}?{{ end }}"

    state_q = _per_engine(cfg, "stepline_engine_state", " == 1")
    finding_q = _per_engine(cfg, "stepline_engine_top_finding_info")
    gpu_q = _per_engine(cfg, "stepline_engine_gpu_utilization_ratio")
    repl: dict[str, str] = {
        "value": "{{ $value | humanize }}",
        "scope": SCOPE,
        "value_duration": "{{ $value | humanizeDuration }}",
        "value_ratio": "{{ $value | humanizePercentage }}",
        "value_rate": "{{ $value | humanize }}",
        "state": f"{{{{ with printf {state_q} $labels.engine | query }}}}{{{{ . | first | label \"state\" }}}}"
                 "{{ else }}unknown{{ end }}",
        "budget": value_of("stepline_engine_progress_budget_seconds", "humanizeDuration"),
        "age": value_of("stepline_engine_progress_age_seconds", "humanizeDuration"),
        "waiting": value_of("stepline_engine_waiting_requests", "humanize"),
        "running": value_of("stepline_engine_running_requests", "humanize"),
        "finding": f"{{{{ with printf {finding_q} $labels.engine | query }}}}{{{{ with . | first }}}}"
                   "{{ .Labels.severity }} {{ .Labels.kind }}: {{ .Labels.title }}{{ end }}"
                   "{{ else }}none yet{{ end }}",
        "gpus": f"{{{{ with printf {gpu_q} $labels.engine | query }}}}{GPUS_IDLE}{{{{ else }}}}{NO_GPU_READINGS}"
                "{{ end }}",
    }
    return _render(text, repl)


def grafana(text: str) -> str:
    """Grafana annotation template: labels and `$values` of the condition and the auxiliary queries."""
    def aux(ref: str, body: str, missing: str = "?") -> str:
        return f"{{{{ with $values.{ref} }}}}{body}{{{{ else }}}}{missing}{{{{ end }}}}"

    repl = {
        "value": aux("A", "{{ humanize .Value }}"),
        "scope": SCOPE,
        "value_duration": aux("A", "{{ humanizeDuration .Value }}"),
        "value_ratio": aux("A", "{{ humanizePercentage .Value }}"),
        "value_rate": aux("A", "{{ humanize .Value }}"),
        "state": aux("STATE", "{{ .Labels.state }}", "unknown"),
        "budget": aux("BUDGET", "{{ humanizeDuration .Value }}"),
        "age": aux("AGE", "{{ humanizeDuration .Value }}"),
        "waiting": aux("WAITING", "{{ humanize .Value }}"),
        "running": aux("RUNNING", "{{ humanize .Value }}"),
        "finding": aux("FINDING", "{{ .Labels.severity }} {{ .Labels.kind }}: {{ .Labels.title }}", "none yet"),
        "gpus": aux("GPU", GPUS_IDLE, NO_GPU_READINGS),
    }
    return _render(text, repl)


def grafana_aux_refs(*texts: str) -> list[str]:
    """The auxiliary refIds the texts need, in a fixed order."""
    used = {m.group(1) for t in texts for m in _TOKEN.finditer(t)}
    return [ref for name, ref in _AUX_OF.items() if name in used]


def _render(text: str, repl: dict[str, str]) -> str:
    def sub(m: re.Match[str]) -> str:
        return repl.get(m.group(1), "{{ $labels." + m.group(1) + " }}")

    return _TOKEN.sub(sub, text)
