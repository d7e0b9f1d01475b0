"""The Grafana alerting files as Grafana reads them, and the versions the deploy files pin for Grafana.

How Grafana reads `alerts/grafana/alert-rules.yaml` (grafana/grafana
`pkg/services/provisioning/alerting/rules_types.go`, `pkg/services/provisioning/values/values.go`):
- `QueryV1.mapToModel` marshals `Model.Raw`: a query's `model` is taken as written, never interpolated.
- the group's name/folder/interval/orgId, each rule's uid, title, condition, for, keepFiringFor, noDataState,
  execErrState, dashboardUid, panelId and labels, each query's refId, queryType and datasourceUid are read with
  `.Value()`: `interpolateValue` splits on `$$` (a literal `$`), expands each part with Go's `os.ExpandEnv`
  (`$VAR`, `${VAR}`, and `$1`, `$*`...: special one-character names) and joins with `$`.
- annotations: at most `${VAR}` is expanded (`ValueWithBracedVars`; released Grafana takes them raw).
A math expression's variables are lexed as grafana/grafana `pkg/expressions/mathexp/parse/lex.go` does
(its `lex_test.go`: `$A`, `${My Var}`; a lone `$` is "incomplete variable").
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
import yaml

from stepline.alerting.config import AlertConfig
from stepline.alerting.grafana import contact_points_file, rules_file

ROOT = Path(__file__).resolve().parents[2]
RULES = ROOT / "alerts/grafana/alert-rules.yaml"
ENV = {"STEPLINE_PROMETHEUS_UID": "stepline-prometheus"}

_SPECIAL = set("*#$@!?-0123456789")


def _name(s: str) -> tuple[str, int]:
    """Go's `os.getShellName`: (name, width) after a `$`."""
    if s[0] == "{":
        if len(s) > 2 and s[1] in _SPECIAL and s[2] == "}":
            return s[1], 3
        end = s.find("}")
        if end == 1:
            return "", 2
        return ("", 1) if end < 0 else (s[1:end], end + 1)
    if s[0] in _SPECIAL:
        return s[0], 1
    n = len(s) - len(s.lstrip("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_"))
    return s[:n], n


def go_expand_env(s: str, env: Mapping[str, str]) -> str:
    """Go's `os.ExpandEnv`."""
    out, i, j = [], 0, 0
    while j < len(s):
        if s[j] == "$" and j + 1 < len(s):
            out.append(s[i:j])
            name, w = _name(s[j + 1:])
            if name:
                out.append(env.get(name, ""))
            elif w == 0:
                out.append("$")
            j += w
            i = j + 1
        j += 1
    return "".join(out) + s[i:]


_EXPANDER = re.compile(r"\$(|__\w+)\{([^}]+)\}")


def expand_var(s: str, env: Mapping[str, str], files: Mapping[str, str]) -> str:
    """grafana/grafana `pkg/setting/expanders.go` `ExpandVar`: `${VAR}`/`$__env{VAR}` from the environment, then
    `$__file{PATH}` to the file's contents with surrounding space trimmed (a missing file is an error)."""
    def env_expander(m: re.Match[str]) -> str:
        return env.get(m.group(2), "") if m.group(1) in ("", "__env") else m.group(0)

    def file_expander(m: re.Match[str]) -> str:
        if m.group(1) != "__file":
            return m.group(0)
        if m.group(2) not in files:
            raise FileNotFoundError(m.group(2))
        return files[m.group(2)].strip()
    return _EXPANDER.sub(file_expander, _EXPANDER.sub(env_expander, s))


def interpolate(value: str, env: Mapping[str, str] = ENV, files: Mapping[str, str] | None = None) -> str:
    """values.go `interpolateValue`: split on `$$`, each part through `ExpandVar` and then `os.ExpandEnv`."""
    return "$".join(go_expand_env(expand_var(part, env, files or {}), env) for part in value.split("$$"))


def braced(value: str, env: Mapping[str, str] = ENV) -> str:
    """`ValueWithBracedVars`: only `${VAR}`."""
    return re.sub(r"\$\{(\w+)\}", lambda m: env.get(m.group(1), ""), value)


def provisioned(doc: dict[str, Any]) -> list[dict[str, Any]]:
    """The rules as Grafana stores them after reading the provisioning document."""
    out = []
    for group in doc["groups"]:
        for key in ("name", "folder", "interval"):
            assert interpolate(group[key]) == group[key], f"group {key} changes when Grafana reads it"
        for r in group["rules"]:
            out.append({
                **{k: interpolate(r[k]) for k in ("uid", "title", "condition", "for", "noDataState", "execErrState")},
                "labels": {k: interpolate(v) for k, v in r.get("labels", {}).items()},
                "annotations": {k: braced(v) for k, v in r.get("annotations", {}).items()},
                "raw_annotations": r.get("annotations", {}),
                "data": [{"refId": interpolate(q["refId"]), "datasourceUid": interpolate(q["datasourceUid"]),
                          "model": q["model"]} for q in r["data"]],
            })
    return out


def math_variables(expression: str) -> list[str]:
    """The variables of a math expression as Grafana's lexer reads them; ValueError where it errs."""
    found, i = [], 0
    while (i := expression.find("$", i)) >= 0:
        rest = expression[i + 1:]
        if rest.startswith("{"):
            end = rest.find("}")
            if end < 0:
                raise ValueError("unterminated variable missing closing }")
            name = rest[1:end]
            if not name.strip() or not re.fullmatch(r"[\w ]+", name):
                raise ValueError(f"bad variable in {expression!r}")
            found.append(name.strip())
            i += end + 2
            continue
        m = re.match(r"\w+", rest)
        if not m:
            raise ValueError(f"incomplete variable in {expression!r}")
        found.append(m.group(0))
        i += 1 + m.end()
    return found


def check(doc: dict[str, Any]) -> list[str]:
    """Everything that goes wrong when Grafana reads `doc`; empty when nothing does."""
    problems = []
    for r in provisioned(doc):
        title = r["title"]
        refs = {q["refId"] for q in r["data"]}
        if r["condition"] not in refs:
            problems.append(f"{title}: condition {r['condition']!r} names no query")
        for q in r["data"]:
            if q["datasourceUid"] == "":
                problems.append(f"{title}/{q['refId']}: datasourceUid expands to nothing")
            if q["model"].get("type") == "math":
                try:
                    names = math_variables(q["model"]["expression"])
                except ValueError as e:
                    problems.append(f"{title}/{q['refId']}: {e}")
                    continue
                problems += [f"{title}/{q['refId']}: ${n} is no refId" for n in names if n not in refs]
            if "$$" in q["model"].get("expr", ""):
                problems.append(f"{title}/{q['refId']}: PromQL holds `$$` (the model is raw)")
        if r["annotations"] != r["raw_annotations"]:
            problems.append(f"{title}: an annotation changes when Grafana reads it")
    return problems


def test_a_broken_file_is_caught() -> None:
    doc = yaml.safe_load(RULES.read_text(encoding="utf-8"))
    rule = doc["groups"][0]["rules"][0]
    rule["data"][-1]["model"]["expression"] = "is_number($$A)"
    rule["title"] = "Cost $5"
    assert any("incomplete variable" in p for p in check(doc))
    assert provisioned(doc)[0]["title"] == "Cost "


def test_go_expansion_matches_values_go() -> None:
    assert interpolate("${STEPLINE_PROMETHEUS_UID}") == "stepline-prometheus"
    assert interpolate("$1 and $A") == " and "
    assert interpolate("$$1 costs $$5") == "$1 costs $5"
    assert interpolate("a $ b") == "a $ b"
    # expanders.go: $__file{} is the file's trimmed contents; `$$` keeps it literal; a missing file is an error.
    assert interpolate("$__file{/run/secrets/pw}", {}, {"/run/secrets/pw": " s3cret\n"}) == "s3cret"
    assert interpolate("$$__file{/run/secrets/pw}", {}, {}) == "$__file{/run/secrets/pw}"
    with pytest.raises(FileNotFoundError):
        interpolate("$__file{/nowhere}", {}, {})
    assert math_variables("is_number($A) && ${B x} > 1") == ["A", "B x"]
    with pytest.raises(ValueError):
        math_variables("is_number($$A)")


def test_committed_rules_evaluate_as_grafana_reads_them() -> None:
    doc = yaml.safe_load(RULES.read_text(encoding="utf-8"))
    assert check(doc) == []
    rules = provisioned(doc)
    assert len(rules) == sum(len(g["rules"]) for g in doc["groups"]) > 0
    for r in rules:
        cond = next(q for q in r["data"] if q["refId"] == r["condition"])
        assert cond["model"]["type"] == "math"
        assert math_variables(cond["model"]["expression"]) == ["A"]
        assert all(q["datasourceUid"] in ("stepline-prometheus", "__expr__") for q in r["data"])
    engine_down = next(r for r in rules if r["title"] == "EngineDown")
    expr = engine_down["data"][0]["model"]["expr"]
    assert re.search(r'label_replace\(.*, "engine", "\$1", "source", "vllm_metrics:\(\.\*\)"\)', expr), expr


def test_the_generator_refuses_a_dollar_grafana_would_expand() -> None:
    with pytest.raises(ValueError, match="expand"):
        rules_file(AlertConfig(group_name="team-$TEAM"))


def test_the_contact_point_forwards_to_the_configured_alertmanager() -> None:
    doc: Any = contact_points_file(AlertConfig(grafana_alertmanager_url="http://am.example:9093"))
    [point] = doc["contactPoints"]
    [receiver] = point["receivers"]
    assert receiver["type"] == "prometheus-alertmanager"
    assert receiver["settings"] == {"url": "http://am.example:9093"}
    committed = yaml.safe_load((ROOT / "alerts/grafana/contact-points.yaml").read_text(encoding="utf-8"))
    url = committed["contactPoints"][0]["receivers"][0]["settings"]["url"]
    assert not re.search(r"//(127\.0\.0\.1|localhost)[:/]", url), "inside Grafana's container that is Grafana"
    compose = yaml.safe_load((ROOT / "deploy/docker-compose.yml").read_text(encoding="utf-8"))
    host, port = re.match(r"http://([^:/]+):(\d+)", url).groups()  # type: ignore[union-attr]
    assert host in compose["services"]
    assert any(p.split(":")[-1] == port for p in compose["services"][host].get("ports", []))


# --- versions ---------------------------------------------------------------------------------------------

# The dashboard schema version each Grafana release first understands (Grafana's dashboard migrations: v42
# arrived in 12.2; an older Grafana's dashboard API refuses a version above its own).
MIN_GRAFANA_FOR_SCHEMA = {42: (12, 2)}
CLICKHOUSE_PLUGIN = "grafana-clickhouse-datasource"
PLUGIN_MIN = (4, 0, 3)  # earlier 4.x releases expand the time macros differently


def _version(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split("."))


def _grafana_images() -> list[str]:
    files = [ROOT / "deploy/docker-compose.yml", *sorted((ROOT / "deploy/kubernetes").glob("*.yaml"))]
    image = re.compile(r"image:\s*[\"']?(?:docker\.io/)?grafana/grafana(?:-oss)?:([^\s\"'#]+)")
    return [m.group(1) for f in files for m in image.finditer(f.read_text(encoding="utf-8"))]


def test_grafana_pin_matches_the_dashboards_schema_version() -> None:
    versions = {json.loads(p.read_text())["schemaVersion"] for p in (ROOT / "dashboards").glob("*.json")}
    assert versions and versions <= set(MIN_GRAFANA_FOR_SCHEMA), f"no known minimum Grafana for {versions}"
    minimum = max(MIN_GRAFANA_FOR_SCHEMA[v] for v in versions)
    images = _grafana_images()
    assert images, "no pinned Grafana image in deploy/"
    for tag in images:
        assert re.fullmatch(r"\d+\.\d+\.\d+", tag), f"grafana/grafana:{tag} is not a pinned release"
        assert _version(tag)[:2] == minimum, f"grafana/grafana:{tag}: the dashboards need {minimum}.x"
    wanted = f"Grafana {minimum[0]}.{minimum[1]}"
    for doc in ("README.md", "deploy/README.md"):
        assert wanted in (ROOT / doc).read_text(encoding="utf-8"), f"{doc} does not name {wanted} as the minimum"


def test_clickhouse_plugin_is_pinned_where_grafana_runs() -> None:
    compose = yaml.safe_load((ROOT / "deploy/docker-compose.yml").read_text(encoding="utf-8"))
    env = compose["services"]["grafana"]["environment"]
    assert "GF_INSTALL_PLUGINS" not in env, "deprecated: use GF_PLUGINS_PREINSTALL_SYNC"
    name, _, version = env["GF_PLUGINS_PREINSTALL_SYNC"].partition("@")
    assert name == CLICKHOUSE_PLUGIN and _version(version) >= PLUGIN_MIN
    assert f"{CLICKHOUSE_PLUGIN}@{version}" in (ROOT / "deploy/README.md").read_text(encoding="utf-8")
    for f in (ROOT / "deploy/kubernetes").glob("*.yaml"):
        text = f.read_text(encoding="utf-8")
        assert "GF_INSTALL_PLUGINS" not in text, f.name
        for m in re.finditer(CLICKHOUSE_PLUGIN + r"@([\d.]+)", text):
            assert m.group(1) == version, f"{f.name} pins {m.group(1)}, compose {version}"
