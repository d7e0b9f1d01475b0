"""How the deploy files place the sidecar beside vLLM: namespaces, probes, tokens, names, limits, logs."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from stepline.alerting.config import AlertConfig

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
K8S = DEPLOY / "kubernetes"


def compose_services() -> dict[str, dict[str, Any]]:
    services: dict[str, dict[str, Any]] = yaml.safe_load((DEPLOY / "docker-compose.yml").read_text())["services"]
    return services


def vllm_pod() -> dict[str, Any]:
    for doc in yaml.safe_load_all((K8S / "vllm.yaml").read_text()):
        if doc and doc["kind"] == "Deployment" and doc["metadata"]["name"] == "vllm":
            spec: dict[str, Any] = doc["spec"]["template"]["spec"]
            return spec
    raise AssertionError("no Deployment vllm")


def containers() -> dict[str, dict[str, Any]]:
    return {c["name"]: c for c in vllm_pod()["containers"]}


def env(container: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container.get("env", [])}


def test_compose_sidecar_outlives_vllm_and_still_sees_its_process() -> None:
    services = compose_services()
    vllm, sidecar = services["vllm"], services["stepline"]
    # The process namespace belongs to neither: PID 1 exiting kills every process in its namespace.
    owner = sidecar["pid"].removeprefix("service:")
    assert sidecar["pid"] == vllm["pid"] and owner not in ("vllm", "stepline"), sidecar["pid"]
    holder = services[owner]
    assert holder.get("init") is True  # docker-init is PID 1 and reaps vLLM's orphans
    assert holder["entrypoint"] == ["sleep", "infinity"] and "command" not in holder
    # One network namespace too, so 127.0.0.1:8000 is vLLM for the sidecar, across restarts of vLLM.
    assert sidecar["network_mode"] == vllm["network_mode"] == f"service:{owner}"
    assert "ports" not in vllm and "ports" not in sidecar and holder["ports"]


def test_compose_otlp_receiver_needs_the_token_vllm_sends() -> None:
    services = compose_services()
    vllm, sidecar = services["vllm"]["environment"], services["stepline"]["environment"]
    command = services["stepline"]["command"]
    listen = command[command.index("--listen") + 1] if "--listen" in command else sidecar.get("STEPLINE_LISTEN")
    if listen not in ("127.0.0.1", "::1", "localhost", None):
        token = sidecar["STEPLINE_OTLP_TOKEN"]
        assert token.startswith("${STEPLINE_OTLP_TOKEN:?")
        # sources/otlp.py accepts `Authorization: Bearer <token>`; the OTel SDK URL-decodes header values.
        assert vllm["OTEL_EXPORTER_OTLP_TRACES_HEADERS"] == "Authorization=Bearer%20" + token


def test_compose_rotates_vllm_logs_limits_clickhouse_and_keeps_the_model_cache() -> None:
    services = compose_services()
    logging = services["vllm"]["logging"]
    assert logging["driver"] == "json-file" and logging["options"]["max-size"] and int(logging["options"]["max-file"])
    assert services["clickhouse"]["deploy"]["resources"]["limits"]["memory"]
    hf_home = services["vllm"]["environment"]["HF_HOME"]
    assert any(v.split(":")[1] == hf_home and not v.startswith(".") for v in services["vllm"]["volumes"])


def test_k8s_sidecar_never_gates_vllm_readiness() -> None:
    sidecar = containers()["stepline"]
    # A pod is Ready only when every container is: a sidecar readiness probe takes vLLM out of its Service.
    assert "readinessProbe" not in sidecar
    assert sidecar["livenessProbe"]["httpGet"]["port"] == "metrics"
    assert sidecar["startupProbe"]["httpGet"]["port"] == "metrics"


def test_k8s_otlp_receiver_needs_the_token_vllm_sends() -> None:
    vllm, sidecar = env(containers()["vllm"]), env(containers()["stepline"])
    assert sidecar["STEPLINE_LISTEN"] == "0.0.0.0"
    token_file = Path(sidecar["STEPLINE_OTLP_TOKEN_FILE"])
    mounts = {m["mountPath"]: m["name"] for m in containers()["stepline"]["volumeMounts"]}
    volumes = {v["name"]: v for v in vllm_pod()["volumes"]}
    secret = volumes[mounts[str(token_file.parent)]]["secret"]["secretName"]
    assert vllm["OTLP_TOKEN"] == {"secretKeyRef": {"name": secret, "key": token_file.name}}
    assert vllm["OTEL_EXPORTER_OTLP_TRACES_HEADERS"] == "Authorization=Bearer%20$(OTLP_TOKEN)"
    assert list(vllm).index("OTLP_TOKEN") < list(vllm).index("OTEL_EXPORTER_OTLP_TRACES_HEADERS")


def test_k8s_vllm_has_startup_probe_shm_and_model_cache() -> None:
    vllm = containers()["vllm"]
    assert vllm["startupProbe"]["httpGet"]["path"] == "/health"
    assert vllm["startupProbe"]["periodSeconds"] * vllm["startupProbe"]["failureThreshold"] >= 600
    volumes = {v["name"]: v for v in vllm_pod()["volumes"]}
    mounts = {m["mountPath"]: m["name"] for m in vllm["volumeMounts"]}
    assert volumes[mounts["/dev/shm"]]["emptyDir"]["medium"] == "Memory"
    assert mounts[env(vllm)["HF_HOME"]] in volumes


def test_k8s_clickhouse_has_a_memory_limit() -> None:
    for doc in yaml.safe_load_all((K8S / "clickhouse.yaml").read_text()):
        if doc and doc["kind"] == "StatefulSet":
            for c in doc["spec"]["template"]["spec"]["containers"]:
                assert c["resources"]["limits"]["memory"]


def test_every_scrape_config_names_the_job_the_alert_rules_select() -> None:
    selector = AlertConfig().selector
    assert selector == 'job="stepline"'
    for path in (DEPLOY / "prometheus" / "prometheus.yml", DEPLOY / "prometheus" / "kubernetes-scrape-config.yaml"):
        jobs = [job["job_name"] for job in yaml.safe_load(path.read_text())["scrape_configs"]]
        assert "stepline" in jobs, path
    k8s_job = yaml.safe_load((DEPLOY / "prometheus" / "kubernetes-scrape-config.yaml").read_text())["scrape_configs"]
    keep = k8s_job[0]["relabel_configs"][0]
    assert keep["action"] == "keep" and keep["regex"] == "stepline;metrics"
    # Annotation-based scraping would add the sidecar under another job name.
    for doc in yaml.safe_load_all((K8S / "vllm.yaml").read_text()):
        if doc:
            assert not any(k.startswith("prometheus.io/") for k in doc["metadata"].get("annotations", {})), doc


def test_compose_attach_profile_joins_a_running_vllm_with_the_bundled_sidecars_settings() -> None:
    services = compose_services()
    bundled, attach = services["stepline"], services["stepline-attach"]
    assert {name for name, svc in services.items() if "bundled" in svc.get("profiles", [])} == {"pod", "vllm",
                                                                                               "stepline"}
    assert attach["profiles"] == ["attach"]
    assert not {"pod", "vllm"} & set(attach.get("depends_on", {})), "attach must not need the bundled vLLM"
    assert (attach["network_mode"], attach["pid"]) == ("host", "host")
    assert attach["command"][attach["command"].index("--engine") + 1].endswith("=${VLLM_URL:-http://127.0.0.1:8000}")
    # The same settings but the store, which the host's network reaches through ClickHouse's published port.
    differ = {k for k in bundled["environment"] if bundled["environment"][k] != attach["environment"].get(k)}
    assert differ == {"STEPLINE_STORE"}
    store_port = attach["environment"]["STEPLINE_STORE"].rsplit(":", 1)[1].split("/")[0]
    assert f"127.0.0.1:{store_port}:8123" in services["clickhouse"]["ports"]
    assert "${STEPLINE_RUN_DIR:-/run/stepline}:/run/stepline" in attach["volumes"]
    for sidecar in (bundled, attach):
        assert sidecar["environment"]["STEPLINE_EXPECT_GPUS"] == "${STEPLINE_EXPECT_GPUS:-1}"
    example = dict(line.split("=", 1) for line in (DEPLOY / ".env.example").read_text().splitlines()
                   if line and not line.startswith("#"))
    assert example["COMPOSE_PROFILES"] == "bundled", "`docker compose up` must keep starting the whole stack"
    assert {"VLLM_URL", "STEPLINE_RUN_DIR", "STEPLINE_EXPECT_GPUS"} <= set(example)
