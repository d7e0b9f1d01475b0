"""deploy/ parses, refers only to files that exist, and agrees with itself and with the collector's settings."""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import yaml

from stepline.cli import alerts as alerts_cli
from stepline.config.settings import _ENV, _SECRETS, STORE_PASSWORD_VARS, Settings
from stepline.dashboards import provisioning
from tests.alerting.test_grafana import interpolate

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
K8S = DEPLOY / "kubernetes"
PLUGIN_ENV = {"STEPLINE_ENGINE", "STEPLINE_PLUGIN_SOCKET"}
COLLECTOR_ENV = {var for _, var, _ in _ENV} | {f"{var}_FILE" for _, var in _SECRETS} | set(STORE_PASSWORD_VARS)
SOCKET = "/run/stepline/plugin.sock"


def load_yaml(path: Path) -> Any:
    return yaml.safe_load(path.read_text(encoding="utf-8"))


def compose() -> dict[str, Any]:
    data: dict[str, Any] = load_yaml(DEPLOY / "docker-compose.yml")
    return data


def service(name: str) -> dict[str, Any]:
    svc: dict[str, Any] = compose()["services"][name]
    return svc


def mounts(svc: dict[str, Any]) -> dict[str, str]:
    """Container path -> source (named volume or host path) of a compose service."""
    out = {}
    for spec in svc.get("volumes", []):
        source, target = interpolated(spec).split(":")[:2]
        out[target] = source
    return out


def k8s_objects() -> list[dict[str, Any]]:
    objects: list[dict[str, Any]] = []
    for path in sorted(K8S.glob("*.yaml")):
        if path.name == "kustomization.yaml":
            continue
        objects.extend(doc for doc in yaml.safe_load_all(path.read_text(encoding="utf-8")) if doc)
    return objects


def k8s(kind: str, name: str) -> dict[str, Any]:
    for obj in k8s_objects():
        if obj["kind"] == kind and obj["metadata"]["name"] == name:
            return obj
    raise AssertionError(f"no {kind} {name} in deploy/kubernetes")


def pod_containers(obj: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {c["name"]: c for c in obj["spec"]["template"]["spec"]["containers"]}


def k8s_env(container: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container.get("env", [])}


def interpolated(value: str) -> str:
    """A compose value with ${VAR:-default} replaced by its default, and a required ${VAR:?message} by `set`."""
    return re.sub(r"\$\{(\w+)(?:(:-|:\?)([^}]*))?\}",
                  lambda m: m.group(3) or "" if m.group(2) == ":-" else "set", value)


def walk_strings(node: object) -> Iterator[str]:
    if isinstance(node, dict):
        for v in node.values():
            yield from walk_strings(v)
    elif isinstance(node, list):
        for v in node:
            yield from walk_strings(v)
    elif isinstance(node, str):
        yield node


# --- everything parses -----------------------------------------------------------------------------------


def test_every_yaml_and_json_file_parses() -> None:
    files = [p for p in DEPLOY.rglob("*") if p.suffix in (".yaml", ".yml", ".json")]
    assert len(files) >= 8
    for path in files:
        if path.suffix == ".json":
            json.loads(path.read_text(encoding="utf-8"))
        else:
            docs = list(yaml.safe_load_all(path.read_text(encoding="utf-8")))
            assert docs and all(isinstance(d, dict) for d in docs if d is not None), path


# --- compose ---------------------------------------------------------------------------------------------


def test_compose_host_paths_and_build_contexts_exist() -> None:
    for name, svc in compose()["services"].items():
        for target, source in mounts(svc).items():
            if source.startswith("."):
                assert (DEPLOY / source).exists(), f"{name}: {source} (mounted at {target}) does not exist"
        if "build" in svc:
            dockerfile = DEPLOY / svc["build"]["context"] / svc["build"]["dockerfile"]
            assert dockerfile.is_file(), f"{name}: no {dockerfile}"


def test_compose_named_volumes_are_declared() -> None:
    declared = set(compose()["volumes"])
    used = {source for svc in compose()["services"].values() for source in mounts(svc).values()
            if not source.startswith((".", "/"))}  # a host path is no volume
    assert used <= declared, used - declared


def test_dockerfiles_install_stepline_on_the_pinned_vllm() -> None:
    vllm = (DEPLOY / "vllm" / "Dockerfile").read_text(encoding="utf-8")
    assert "FROM vllm/vllm-openai:v0.33.0" in vllm and "pip install" in vllm and "stepline" in vllm
    assert "stepline" in (DEPLOY / "collector" / "Dockerfile").read_text(encoding="utf-8")


def test_compose_required_variables_are_in_env_example() -> None:
    example = {line.split("=", 1)[0] for line in (DEPLOY / ".env.example").read_text(encoding="utf-8").splitlines()
               if "=" in line and not line.startswith("#")}
    text = (DEPLOY / "docker-compose.yml").read_text(encoding="utf-8")
    referenced = set(re.findall(r"\$\{(\w+)", text))
    assert referenced <= example, referenced - example
    for value in (line.split("=", 1)[1] for line in (DEPLOY / ".env.example").read_text(encoding="utf-8").splitlines()
                  if "PASSWORD=" in line):
        assert value == "CHANGE-ME", "only placeholders in the example"


def test_compose_sidecar_shares_vllm_network_socket_and_otlp_port() -> None:
    vllm, sidecar = service("vllm"), service("stepline")
    assert sidecar["network_mode"] == vllm["network_mode"] == "service:pod"
    assert vllm["environment"]["STEPLINE_PLUGIN_SOCKET"] == sidecar["environment"]["STEPLINE_PLUGIN_SOCKET"] == SOCKET
    socket_dir = str(Path(SOCKET).parent)
    assert mounts(vllm)[socket_dir] == mounts(sidecar)[socket_dir]
    endpoint = urlsplit(vllm["command"][vllm["command"].index("--otlp-traces-endpoint") + 1])
    assert (endpoint.hostname, endpoint.port, endpoint.path) == ("127.0.0.1", 4318, "/v1/traces")
    assert int(sidecar["environment"]["STEPLINE_OTLP_PORT"]) == endpoint.port == Settings.otlp_port
    assert vllm["environment"]["OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"] == "http/protobuf"
    assert "--enable-logging-iteration-details" in vllm["command"]
    published = {int(p.split(":")[-1]) for p in service("pod")["ports"]}
    assert {8000, int(sidecar["environment"]["STEPLINE_METRICS_PORT"])} <= published
    for svc in (vllm, sidecar):
        devices = svc["deploy"]["resources"]["reservations"]["devices"]
        assert devices[0]["driver"] == "nvidia"


def test_compose_engine_name_is_the_same_for_plugin_spans_and_sidecar() -> None:
    vllm, sidecar = service("vllm"), service("stepline")
    engine = interpolated(sidecar["command"][sidecar["command"].index("--engine") + 1])
    name, _, url = engine.partition("=")
    assert url == "http://127.0.0.1:8000"
    assert interpolated(vllm["environment"]["STEPLINE_ENGINE"]) == name
    assert interpolated(vllm["environment"]["OTEL_SERVICE_NAME"]) == name


def test_compose_env_names_are_known_to_stepline() -> None:
    for name in ("vllm", "stepline"):
        unknown = {k for k in service(name)["environment"] if k.startswith("STEPLINE_")} - COLLECTOR_ENV - PLUGIN_ENV
        assert not unknown, f"{name}: {unknown}"


def test_compose_store_url_points_at_the_clickhouse_service() -> None:
    store = urlsplit(interpolated(service("stepline")["environment"]["STEPLINE_STORE"]))
    assert (store.scheme, store.hostname, store.port, store.path) == ("http", "clickhouse", 8123, "/stepline")
    assert "clickhouse" in compose()["services"]
    assert service("clickhouse")["environment"]["CLICKHOUSE_DB"] == "stepline"


# --- Prometheus ------------------------------------------------------------------------------------------


def test_prometheus_scrapes_the_sidecar_and_loads_the_generated_rules() -> None:
    config = load_yaml(DEPLOY / "prometheus" / "prometheus.yml")
    prom = service("prometheus")
    container_mounts = mounts(prom)
    assert container_mounts["/etc/prometheus/prometheus.yml"] == "./prometheus/prometheus.yml"
    for rule in config["rule_files"]:
        source = container_mounts[str(Path("/etc/prometheus") / rule)]
        assert (DEPLOY / source).resolve() == REPO / "alerts" / "prometheus-rules.yaml"
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    target = jobs["stepline"]["static_configs"][0]["targets"][0]
    host, port = target.split(":")
    # Through the host in both profiles: the pod publishes the bundled sidecar's port, the attach one is on the host.
    assert f"{host}:host-gateway" in prom["extra_hosts"]
    pod_ports = {int(p.split(":")[-1]) for p in service("pod")["ports"]}
    assert service("stepline")["network_mode"] == "service:pod" and int(port) in pod_ports
    assert service("stepline-attach")["network_mode"] == "host"
    for sidecar in ("stepline", "stepline-attach"):
        assert int(port) == int(service(sidecar)["environment"]["STEPLINE_METRICS_PORT"]) == Settings.metrics_port
    assert 'job="stepline"' in (REPO / "alerts" / "prometheus-rules.yaml").read_text(encoding="utf-8")
    am_host, am_port = config["alerting"]["alertmanagers"][0]["static_configs"][0]["targets"][0].split(":")
    assert am_host in compose()["services"] and am_port == "9093"
    assert mounts(service("alertmanager"))["/etc/alertmanager/alertmanager.yml"] == \
        "../alerts/alertmanager.example.yaml"


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool not installed")
def test_promtool_accepts_the_prometheus_config(tmp_path: Path) -> None:
    # The config names container paths; rebuild the container's /etc/prometheus layout from the mounts.
    for target, source in mounts(service("prometheus")).items():
        if target.startswith("/etc/prometheus/"):
            dest = tmp_path / Path(target).relative_to("/etc/prometheus")
            dest.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(DEPLOY / source, dest)
    done = subprocess.run(["promtool", "check", "config", str(tmp_path / "prometheus.yml")],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr


# --- Grafana ---------------------------------------------------------------------------------------------


def test_grafana_provisioning_mounts_and_datasources_agree() -> None:
    grafana = service("grafana")
    m = mounts(grafana)
    assert grafana["environment"]["GF_PLUGINS_PREINSTALL_SYNC"].startswith("grafana-clickhouse-datasource@")
    assert m["/etc/grafana/provisioning/alerting"] == "../alerts/grafana"
    assert m["/etc/grafana/provisioning/datasources"] == "./grafana/provisioning/datasources"
    assert m["/etc/grafana/provisioning/dashboards"] == "./grafana/provisioning/dashboards"
    provider = load_yaml(DEPLOY / "grafana/provisioning/dashboards/stepline.yaml")["providers"][0]
    assert m[provider["options"]["path"]] == "../dashboards"

    datasources = load_yaml(DEPLOY / "grafana/provisioning/datasources/stepline.yaml")["datasources"]
    sources = {d["type"]: d for d in datasources}
    ch = sources["grafana-clickhouse-datasource"]
    assert ch["uid"] == provisioning.CLICKHOUSE_UID
    assert (ch["jsonData"]["host"], ch["jsonData"]["port"], ch["jsonData"]["protocol"]) == ("clickhouse", 8123, "http")
    assert ch["jsonData"]["defaultDatabase"] == service("clickhouse")["environment"]["CLICKHOUSE_DB"]
    assert ch["secureJsonData"]["password"].startswith("$__file{/run/secrets/")
    prom = sources["prometheus"]
    assert urlsplit(prom["url"]).hostname in compose()["services"]
    # The generated Grafana alert rules name their datasource through this variable.
    assert prom["uid"] == "${STEPLINE_PROMETHEUS_UID}"
    assert grafana["environment"]["STEPLINE_PROMETHEUS_UID"] == provisioning.PROMETHEUS_UID
    assert "${STEPLINE_PROMETHEUS_UID}" in (REPO / "alerts/grafana/alert-rules.yaml").read_text(encoding="utf-8")


def _secret_files(svc: dict[str, Any]) -> dict[str, tuple[str, int]]:
    """Container path -> (secret name, file mode) of a compose service's secrets (compose's defaults: target
    /run/secrets/<source>, mode 0400, owned by root: docker/compose pkg/compose/secrets.go `createTar`)."""
    out: dict[str, tuple[str, int]] = {}
    for entry in svc.get("secrets", []):
        spec: dict[str, Any] = {"source": entry} if isinstance(entry, str) else entry
        source, target = str(spec["source"]), str(spec.get("target") or spec["source"])
        out[target if target.startswith("/") else f"/run/secrets/{target}"] = (source, int(spec.get("mode", 0o400)))
    return out


def test_compose_passwords_reach_containers_as_files_never_as_environment(tmp_path: Path) -> None:
    """Item 13: no container's environment holds a password; each reads the one secret file it is given."""
    declared = compose()["secrets"]
    env_vars = {name: spec["environment"] for name, spec in declared.items()}
    assert env_vars == {"clickhouse_password": "CLICKHOUSE_PASSWORD",
                        "grafana_admin_password": "GRAFANA_ADMIN_PASSWORD",
                        "alertmanager_slack_api_url": "ALERTMANAGER_SLACK_API_URL"}
    example = (DEPLOY / ".env.example").read_text(encoding="utf-8").splitlines()
    assert all(f"{var}=CHANGE-ME" in example for var in env_vars.values())
    for name, svc in compose()["services"].items():
        values = " ".join(f"{k}={v}" for k, v in (svc.get("environment") or {}).items())
        assert not any(var in values for var in env_vars.values()), f"{name} has a password in its environment"
        assert {source for source, _ in _secret_files(svc).values()} <= set(declared), name

    password = "s3cret-pw_1.x"
    # The collector: the password file merged into a store URL that carries none.
    sidecar = service("stepline")["environment"]
    files = _secret_files(service("stepline"))
    assert files[sidecar["STEPLINE_STORE_PASSWORD_FILE"]][0] == "clickhouse_password"
    assert urlsplit(sidecar["STEPLINE_STORE"]).password is None
    secret = tmp_path / "clickhouse_password"
    secret.write_text(password + "\n", encoding="utf-8")
    settings = Settings.from_env({"STEPLINE_STORE": sidecar["STEPLINE_STORE"],
                                  "STEPLINE_STORE_PASSWORD_FILE": str(secret)})
    assert urlsplit(settings.store).password == password

    # Grafana (uid 472): the admin password through run.sh's GF_*__FILE, the datasource's through $__file{}; both
    # files must be readable by a user other than root.
    grafana = service("grafana")
    files = _secret_files(grafana)
    admin = grafana["environment"]["GF_SECURITY_ADMIN_PASSWORD__FILE"]
    assert files[admin][0] == "grafana_admin_password" and files[admin][1] & 0o004
    ds = load_yaml(DEPLOY / "grafana/provisioning/datasources/stepline.yaml")["datasources"]
    raw = next(d for d in ds if d["type"] == "grafana-clickhouse-datasource")["secureJsonData"]["password"]
    path = re.fullmatch(r"\$__file\{([^}]+)\}", raw)
    assert path and files[path.group(1)][0] == "clickhouse_password" and files[path.group(1)][1] & 0o004
    assert interpolate(raw, {}, {path.group(1): password + "\n"}) == password

    # ClickHouse: the entrypoint wrapper hands the file's contents to the image's entrypoint as CLICKHOUSE_PASSWORD.
    clickhouse = service("clickhouse")
    assert _secret_files(clickhouse)["/run/secrets/clickhouse_password"][0] == "clickhouse_password"
    assert "CLICKHOUSE_PASSWORD" not in clickhouse["environment"]
    argv = [a.replace("$$", "$") for a in clickhouse["entrypoint"]]  # $$ is Compose's literal $
    stub = tmp_path / "entrypoint.sh"
    stub.write_text('#!/bin/sh\nprintf "%s|%s" "$CLICKHOUSE_PASSWORD" "$#"\n', encoding="utf-8")
    stub.chmod(0o755)
    argv = [a.replace("/run/secrets/clickhouse_password", str(secret)).replace("/entrypoint.sh", str(stub))
            for a in argv]
    out = subprocess.run(argv, capture_output=True, text=True, timeout=10, check=True).stdout
    assert out == f"{password}|0"

    # Alertmanager (runs as nobody): the Slack URL its generated config reads on every notification, from the file
    # Compose makes of ALERTMANAGER_SLACK_API_URL.
    alertmanager = service("alertmanager")
    config = load_yaml(REPO / "alerts" / "alertmanager.example.yaml")
    read = {c["api_url_file"] for r in config["receivers"] for c in r.get("slack_configs", [])}
    files = _secret_files(alertmanager)
    assert read and all(files[path][0] == "alertmanager_slack_api_url" and files[path][1] & 0o004 for path in read)


# --- Kubernetes ------------------------------------------------------------------------------------------


def test_k8s_objects_are_well_formed() -> None:
    objects = k8s_objects()
    assert {o["kind"] for o in objects} >= {"Deployment", "Service", "StatefulSet", "Namespace"}
    for obj in objects:
        assert obj.get("apiVersion") and obj.get("kind") and obj["metadata"].get("name"), obj
        if obj["kind"] in ("Deployment", "StatefulSet"):
            spec = obj["spec"]["template"]["spec"]
            volumes = {v["name"] for v in spec.get("volumes", [])} | {
                t["metadata"]["name"] for t in obj["spec"].get("volumeClaimTemplates", [])}
            labels = obj["spec"]["template"]["metadata"]["labels"]
            assert obj["spec"]["selector"]["matchLabels"].items() <= labels.items()
            for c in spec["containers"]:
                assert c.get("image"), f"{obj['metadata']['name']}/{c['name']} has no image"
                assert c.get("resources", {}).get("requests"), f"{c['name']} has no resource requests"
                for mount in c.get("volumeMounts", []):
                    assert mount["name"] in volumes, f"{c['name']}: volume {mount['name']} not declared"


def test_k8s_services_select_pods_and_name_their_ports() -> None:
    workloads = [o for o in k8s_objects() if o["kind"] in ("Deployment", "StatefulSet")]
    for svc in (o for o in k8s_objects() if o["kind"] == "Service"):
        pods = [w for w in workloads
                if svc["spec"]["selector"].items() <= w["spec"]["template"]["metadata"]["labels"].items()]
        assert pods, f"Service {svc['metadata']['name']} selects no pod"
        ports = {p["name"]: p["containerPort"] for w in pods for c in pod_containers(w).values()
                 for p in c.get("ports", [])}
        for port in svc["spec"]["ports"]:
            assert ports.get(port["targetPort"]) == port["port"], (svc["metadata"]["name"], port)


def test_k8s_sidecar_agrees_with_vllm_and_compose() -> None:
    containers = pod_containers(k8s("Deployment", "vllm"))
    vllm, sidecar = containers["vllm"], containers["stepline"]
    venv, senv = k8s_env(vllm), k8s_env(sidecar)
    assert venv["STEPLINE_PLUGIN_SOCKET"] == senv["STEPLINE_PLUGIN_SOCKET"] == SOCKET
    socket_mounts = [{m["name"] for m in c["volumeMounts"] if m["mountPath"] == str(Path(SOCKET).parent)}
                     for c in (vllm, sidecar)]
    assert socket_mounts[0] == socket_mounts[1] and len(socket_mounts[0]) == 1
    endpoint = urlsplit(vllm["args"][vllm["args"].index("--otlp-traces-endpoint") + 1])
    assert (endpoint.hostname, endpoint.port) == ("127.0.0.1", int(senv["STEPLINE_OTLP_PORT"]))
    assert venv["OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"] == "http/protobuf"
    assert "--enable-logging-iteration-details" in vllm["args"]
    name, _, url = sidecar["args"][sidecar["args"].index("--engine") + 1].partition("=")
    assert venv["STEPLINE_ENGINE"] == venv["OTEL_SERVICE_NAME"] == name and url == "http://127.0.0.1:8000"
    # Named after the pod (downward API), so two replicas never share an engine name.
    assert name == "$(POD_NAME)"
    for env in (venv, senv):
        assert env["POD_NAME"] == {"fieldRef": {"fieldPath": "metadata.name"}}
        assert list(env).index("POD_NAME") < list(env).index("STEPLINE_ENGINE" if env is venv else "STEPLINE_STORE")
    sidecar_ports = {p["name"]: p["containerPort"] for p in sidecar["ports"]}
    assert sidecar_ports["metrics"] == int(senv["STEPLINE_METRICS_PORT"]) == 9465
    assert sidecar_ports["query"] == int(senv["STEPLINE_QUERY_PORT"]) == Settings.query_port
    assert int(service("stepline")["environment"]["STEPLINE_METRICS_PORT"]) == sidecar_ports["metrics"]
    # GPU on vLLM only; the sidecar reads NVML through the driver's utility capability.
    assert "nvidia.com/gpu" in vllm["resources"]["limits"]
    assert "nvidia.com/gpu" not in str(sidecar["resources"])
    assert senv["NVIDIA_DRIVER_CAPABILITIES"] == "utility" and "NVIDIA_VISIBLE_DEVICES" in senv
    for c in (vllm, sidecar):
        unknown = {k for k in k8s_env(c) if k.startswith("STEPLINE_")} - COLLECTOR_ENV - PLUGIN_ENV
        assert not unknown, f"{c['name']}: {unknown}"


def test_k8s_secret_references_agree() -> None:
    refs = {(env["valueFrom"]["secretKeyRef"]["name"], env["valueFrom"]["secretKeyRef"]["key"])
            for obj in k8s_objects() if obj["kind"] in ("Deployment", "StatefulSet")
            for c in pod_containers(obj).values() for env in c.get("env", [])
            if "secretKeyRef" in env.get("valueFrom", {})}
    # One key for the ClickHouse password: ClickHouse reads it from its environment (its image takes no file), the
    # collectors from the mounted Secret, so it is in no collector's environment.
    assert refs == {("stepline-clickhouse", "password"), ("stepline-otlp", "token")}
    volumes = {v["secret"]["secretName"] for obj in k8s_objects()
               if obj["kind"] in ("Deployment", "StatefulSet", "DaemonSet")
               for v in obj["spec"]["template"]["spec"].get("volumes", []) if "secret" in v}
    assert volumes == {"stepline-otlp", "stepline-clickhouse"}
    readme = (DEPLOY / "README.md").read_text(encoding="utf-8")
    assert all(f"create secret generic {name}" in readme for name, _ in refs | {(v, "") for v in volumes})
    assert all(f"--from-literal={key}=" in readme for _, key in refs)
    for kind, name, container in (("Deployment", "vllm", "stepline"), ("DaemonSet", "stepline-node", "stepline")):
        collector = k8s_env(pod_containers(k8s(kind, name))[container])
        assert collector["STEPLINE_STORE"] == "http://default@clickhouse:8123/stepline"  # no password in the URL
        assert "CLICKHOUSE_PASSWORD" not in collector
        assert collector["STEPLINE_STORE_PASSWORD_FILE"] == "/var/run/secrets/stepline-clickhouse/password"
    clickhouse_env = k8s_env(pod_containers(k8s("StatefulSet", "clickhouse"))["clickhouse"])
    assert clickhouse_env["CLICKHOUSE_DB"] == "stepline"


def kustomization_paths() -> list[str]:
    """Every file path kustomization.yaml names: resources and configMapGenerator files (KEY=PATH or PATH)."""
    kustomization = load_yaml(K8S / "kustomization.yaml")
    paths = list(kustomization["resources"])
    for generator in kustomization.get("configMapGenerator", []) + kustomization.get("secretGenerator", []):
        paths.extend(spec.partition("=")[2] if "=" in spec else spec for spec in generator.get("files") or [])
    return paths


def test_kustomization_loads_nothing_outside_its_folder() -> None:
    # kustomize's default load restrictor refuses any file not in or below the kustomization's folder.
    for rel in kustomization_paths():
        path = (K8S / rel).resolve()
        assert path.is_relative_to(K8S.resolve()), f"{rel} is not in or below deploy/kubernetes"
        assert path.is_file(), f"{rel} does not exist"


def test_kustomization_copies_match_the_generated_files_and_list_every_dashboard() -> None:
    generated = K8S / "generated"
    rules = generated / "prometheus-rules.yaml"
    assert rules.read_bytes() == (REPO / "alerts" / "prometheus-rules.yaml").read_bytes(), \
        "deploy/kubernetes/generated/ drifted: run `stepline alerts build`"
    dashboards = {p.name: p for p in (REPO / "dashboards").glob("*.json")}
    copies = {p.name: p for p in (generated / "dashboards").glob("*.json")}
    assert copies.keys() == dashboards.keys(), "deploy/kubernetes/generated/ drifted: run `stepline alerts build`"
    for name, path in dashboards.items():
        assert copies[name].read_bytes() == path.read_bytes(), f"{name} drifted: run `stepline alerts build`"
    listed = {(K8S / rel).resolve() for rel in kustomization_paths()}
    missing = {p.resolve() for p in copies.values()} - listed
    assert not missing, f"add to deploy/kubernetes/kustomization.yaml (stepline-dashboards): {sorted(missing)}"
    assert rules.resolve() in listed


def test_alerts_build_copies_into_the_kustomization(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    kustomization, dashboards = tmp_path / "k8s", tmp_path / "dashboards"
    kustomization.mkdir()
    dashboards.mkdir()
    (dashboards / "a.json").write_text('{"title": "a"}', encoding="utf-8")
    (kustomization / "generated" / "dashboards").mkdir(parents=True)
    (kustomization / "generated" / "dashboards" / "gone.json").write_text("{}", encoding="utf-8")
    parser = argparse.ArgumentParser()
    alerts_cli.add_arguments(parser)
    args = parser.parse_args(["build", "--out", str(tmp_path / "alerts"), "--kustomization", str(kustomization),
                              "--dashboards", str(dashboards)])
    assert alerts_cli.run(args) == 0
    copied = kustomization / "generated"
    assert (copied / "prometheus-rules.yaml").read_bytes() == (tmp_path / "alerts/prometheus-rules.yaml").read_bytes()
    assert sorted(p.name for p in (copied / "dashboards").iterdir()) == ["a.json"]  # the stale copy is gone
    assert str(copied / "prometheus-rules.yaml") in capsys.readouterr().out.splitlines()
    # No kustomization folder where it runs: nothing is created.
    args = parser.parse_args(["build", "--out", str(tmp_path / "b"), "--kustomization", str(tmp_path / "none")])
    assert alerts_cli.run(args) == 0
    assert not (tmp_path / "none").exists()


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl not installed")
def test_kustomize_builds() -> None:
    done = subprocess.run(["kubectl", "kustomize", str(K8S)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    kinds = {(d["kind"], d["metadata"]["name"]) for d in yaml.safe_load_all(done.stdout) if d}
    assert {("ConfigMap", "stepline-prometheus-rules"), ("Deployment", "vllm"), ("StatefulSet", "clickhouse")} <= kinds


def test_cluster_notes_use_the_schema_command() -> None:
    notes = (K8S / "clickhouse-cluster.md").read_text(encoding="utf-8")
    assert "stepline schema --cluster" in notes and "--multiquery" in notes and "Keeper" in notes


# --- stepline grafana-provisioning ---------------------------------------------------------------------


def test_write_provisioning_with_dashboards(tmp_path: Path) -> None:
    source = tmp_path / "src"
    source.mkdir()
    (source / "overview.json").write_text('{"title": "overview"}', encoding="utf-8")
    (source / "steps.json").write_text('{"title": "steps"}', encoding="utf-8")
    (source / "README.md").write_text("not a dashboard", encoding="utf-8")
    out = tmp_path / "grafana"
    written = provisioning.write_provisioning(out, query_url="http://10.0.0.5:9124", dashboards_dir=source,
                                              prometheus_url="http://127.0.0.1:9090")
    assert {p.relative_to(out.resolve()).as_posix() for p in written} == {
        "provisioning/datasources/stepline.yaml", "provisioning/dashboards/stepline.yaml",
        "dashboards/overview.json", "dashboards/steps.json"}
    sources = load_yaml(out / "provisioning/datasources/stepline.yaml")["datasources"]
    ch = next(d for d in sources if d["type"] == "grafana-clickhouse-datasource")
    assert ch["uid"] == "stepline-clickhouse"
    assert ch["jsonData"] == {"protocol": "http", "host": "10.0.0.5", "port": 9124, "secure": False,
                              "username": "default", "defaultDatabase": "stepline"}
    assert ch["secureJsonData"] == {"password": "${STEPLINE_QUERY_PASSWORD}"}
    prom = next(d for d in sources if d["type"] == "prometheus")
    assert (prom["uid"], prom["url"]) == ("stepline-prometheus", "http://127.0.0.1:9090")
    provider = load_yaml(out / "provisioning/dashboards/stepline.yaml")["providers"][0]
    assert Path(provider["options"]["path"]) == (out / "dashboards").resolve()
    assert json.loads((out / "dashboards/steps.json").read_text(encoding="utf-8")) == {"title": "steps"}


def test_write_provisioning_without_dashboards_writes_the_datasource_only(tmp_path: Path) -> None:
    written = provisioning.write_provisioning(tmp_path / "g", dashboards_dir=tmp_path / "absent")
    assert [p.name for p in written] == ["stepline.yaml"]
    ch = load_yaml(written[0])["datasources"][0]
    assert (ch["jsonData"]["host"], ch["jsonData"]["port"]) == ("127.0.0.1", 8124)
    assert len(load_yaml(written[0])["datasources"]) == 1


def test_write_provisioning_with_the_repository_dashboards(tmp_path: Path) -> None:
    written = provisioning.write_provisioning(tmp_path)
    copies = {p.name for p in written if p.suffix == ".json"}
    assert copies == {p.name for p in (REPO / "dashboards").glob("*.json")}
    for path in written:
        assert json.loads(path.read_text(encoding="utf-8")) if path.suffix == ".json" else load_yaml(path)


def test_query_url_forms() -> None:
    https = provisioning.clickhouse_datasource("https://reader@ch.example:8443/timeline")["jsonData"]
    assert https == {"protocol": "http", "host": "ch.example", "port": 8443, "secure": True,
                     "username": "reader", "defaultDatabase": "timeline"}
    for bad in ("chdb:///tmp/x", "http://", "http://default:secret@h:8123", "http://h:99999"):
        with pytest.raises(provisioning.ProvisioningError):
            provisioning.clickhouse_datasource(bad)
