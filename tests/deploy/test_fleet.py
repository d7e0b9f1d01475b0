"""deploy/fleet and deploy/kubernetes/fleet: a ClickHouse cluster for stepline, its files agreeing with each other
and with stepline's settings. No Docker or Kubernetes here: files are parsed, the shell scripts run with stand-ins."""

from __future__ import annotations

import hashlib
import json
import os
import shlex
import shutil
import subprocess
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

import pytest
import yaml

from stepline.config.settings import _ENV, _SECRETS, STORE_PASSWORD_VARS, Settings
from stepline.store.url import parse_store_url

REPO = Path(__file__).resolve().parents[2]
FLEET = REPO / "deploy" / "fleet"
K8S_FLEET = REPO / "deploy" / "kubernetes" / "fleet"
CLUSTER_DOC = REPO / "deploy" / "kubernetes" / "clickhouse-cluster.md"
COLLECTOR_ENV = {var for _, var, _ in _ENV} | {f"{var}_FILE" for _, var in _SECRETS} | set(STORE_PASSWORD_VARS)
SERVER_IMAGE, KEEPER_IMAGE = "clickhouse/clickhouse-server:", "clickhouse/clickhouse-keeper:"


def compose() -> dict[str, Any]:
    data: dict[str, Any] = yaml.safe_load((FLEET / "docker-compose.yml").read_text(encoding="utf-8"))
    return data


def services(image_prefix: str) -> dict[str, dict[str, Any]]:
    return {name: svc for name, svc in compose()["services"].items() if svc.get("image", "").startswith(image_prefix)}


def mounts(svc: dict[str, Any]) -> dict[str, str]:
    """Container path -> source of a compose service's volumes."""
    return {spec.split(":")[1]: spec.split(":")[0] for spec in svc.get("volumes", [])}


def mounted_xml(svc: dict[str, Any], target: str) -> ET.Element:
    return ET.parse(FLEET / mounts(svc)[target]).getroot()


def element(root: ET.Element, path: str) -> ET.Element:
    found = root.find(path)
    assert found is not None, f"no {path} in <{root.tag}>"
    return found


def sidecars() -> dict[str, dict[str, Any]]:
    return {name: svc for name, svc in compose()["services"].items() if svc.get("command", [None])[0] == "collect"}


def remote_servers() -> tuple[str, list[list[tuple[str, int]]]]:
    """The one cluster of fleet.xml: its name and, per shard, its replicas' (host, port)."""
    clusters = list(element(ET.parse(FLEET / "clickhouse" / "fleet.xml").getroot(), "remote_servers"))
    assert len(clusters) == 1, [c.tag for c in clusters]
    shards = []
    for shard in clusters[0].findall("shard"):
        assert shard.findtext("internal_replication") == "true", "Replicated *_local tables copy rows themselves"
        shards.append([(r.findtext("host", ""), int(r.findtext("port", "0"))) for r in shard.findall("replica")])
    return clusters[0].tag, shards


def schema_argv() -> list[str]:
    """The `stepline schema ...` command line of the compose schema job's script."""
    script = compose()["services"]["schema"]["command"][0].replace("$$", "$")
    line = next(line for line in script.splitlines() if line.strip().startswith("stepline schema"))
    argv = shlex.split(line)
    return argv[: argv.index("&&")] if "&&" in argv else argv


def store(url: str) -> tuple[str, int | None, str, str, str | None]:
    """(host, port, database, cluster, username) of a store URL, as stepline parses it."""
    parsed = parse_store_url(url)
    parts = urlsplit(url)
    assert parts.password is None, "no password in a store URL: it comes from STEPLINE_STORE_PASSWORD_FILE"
    cluster = getattr(parsed, "cluster", parse_qs(parts.query)["cluster"][0])
    return parsed.host, parsed.port, parsed.database, cluster, parts.username


# --- compose: Keeper, servers, schema job, sidecars ------------------------------------------------------------


def test_compose_files_exist_and_parse() -> None:
    data = compose()
    for name, svc in data["services"].items():
        for target, source in mounts(svc).items():
            if source.startswith("."):
                assert (FLEET / source).is_file(), f"{name}: {source} (mounted at {target}) does not exist"
                if source.endswith(".xml"):
                    assert ET.parse(FLEET / source).getroot().tag == "clickhouse", source
            else:
                assert source in data["volumes"], f"{name}: volume {source} is not declared"
        if "build" in svc:
            assert (FLEET / svc["build"]["context"] / svc["build"]["dockerfile"]).is_file(), name
    dockerfile = (REPO / "deploy" / "collector" / "Dockerfile").read_text(encoding="utf-8")
    entrypoints = [json.loads(line.removeprefix("ENTRYPOINT ")) for line in dockerfile.splitlines()
                   if line.startswith("ENTRYPOINT ")]
    assert entrypoints[-1:] == [["stepline"]], "the collector services' commands are stepline's subcommands"


def test_keepers_share_one_raft_configuration_and_the_servers_name_them() -> None:
    keepers = services(KEEPER_IMAGE)
    assert len(keepers) == 3
    rafts, client_ports = set(), set()
    for name, svc in keepers.items():
        server = mounted_xml(svc, "/etc/clickhouse-keeper/keeper_config.xml").find("keeper_server")
        assert server is not None, name
        raft = tuple(sorted((int(s.findtext("id", "0")), s.findtext("hostname", ""), int(s.findtext("port", "0")))
                            for s in server.iterfind("raft_configuration/server")))
        rafts.add(raft)
        own_id = int(server.findtext("server_id", "0"))
        assert [host for id_, host, _ in raft if id_ == own_id] == [name] == [svc["hostname"]], \
            f"{name}: server_id {own_id} must be its own entry in raft_configuration"
        client_ports.add(int(server.findtext("tcp_port", "0")))
    assert len(rafts) == 1, "the three raft_configuration sections differ"
    (raft,) = rafts
    assert sorted(id_ for id_, _, _ in raft) == [1, 2, 3] and {port for _, _, port in raft} == {9234}
    assert client_ports == {9181}
    expected = {(host, 9181) for _, host, _ in raft}
    for name, svc in services(SERVER_IMAGE).items():
        nodes = {(n.findtext("host", ""), int(n.findtext("port", "0")))
                 for n in mounted_xml(svc, "/etc/clickhouse-server/config.d/fleet.xml").iterfind("zookeeper/node")}
        assert nodes == expected, name


def test_remote_servers_are_the_compose_servers_and_macros_match_their_place() -> None:
    name, shards = remote_servers()
    assert name == "fleet"
    servers = services(SERVER_IMAGE)
    place = {host: (str(index + 1), host) for index, replicas in enumerate(shards) for host, _ in replicas}
    assert set(place) == set(servers), "every server is a replica of the cluster and every replica a server"
    assert {port for replicas in shards for _, port in replicas} == {9000}
    macros = set()
    for host, svc in servers.items():
        assert svc["hostname"] == host  # what the other server reaches, and what it gives replicas to fetch from
        assert mounts(svc)["/etc/clickhouse-server/config.d/fleet.xml"] == "./clickhouse/fleet.xml"
        assert mounts(svc)["/etc/clickhouse-server/users.d/stepline.xml"] == "./clickhouse/users.xml"
        xml = mounted_xml(svc, "/etc/clickhouse-server/config.d/macros.xml")
        pair = (xml.findtext("macros/shard"), xml.findtext("macros/replica"))
        assert pair == place[host], f"{host}: macros {pair}, place in remote_servers {place[host]}"
        macros.add(pair)
    assert len(macros) == len(servers)


def test_one_clickhouse_release_for_keepers_and_servers_everywhere() -> None:
    tags = {svc["image"].partition(":")[2] for svc in compose()["services"].values()
            if svc.get("image", "").startswith(("clickhouse/clickhouse-server", "clickhouse/clickhouse-keeper"))}
    single = yaml.safe_load((REPO / "deploy" / "docker-compose.yml").read_text(encoding="utf-8"))
    assert tags == {single["services"]["clickhouse"]["image"].partition(":")[2]}
    for path, container in ((K8S_FLEET / "clickhouse-installation.yaml", "clickhouse"),
                            (K8S_FLEET / "keeper.yaml", "clickhouse-keeper")):
        spec = yaml.safe_load(path.read_text(encoding="utf-8"))["spec"]["templates"]["podTemplates"][0]["spec"]
        image = next(c["image"] for c in spec["containers"] if c["name"] == container)
        assert image.partition(":")[2] in tags, path


def test_schema_job_and_sidecars_name_the_cluster_and_database_of_remote_servers() -> None:
    cluster, shards = remote_servers()
    hosts = {host for replicas in shards for host, _ in replicas}
    argv = schema_argv()
    assert argv[:5] == ["stepline", "schema", "--cluster", cluster, "--apply"] and len(argv) == 6
    job = store(argv[5])
    assert job[0] in hosts and job[1:] == (8123, "stepline", cluster, "stepline")
    written = {}
    for name, svc in sidecars().items():
        url = svc["environment"]["STEPLINE_STORE"]
        assert getattr(parse_store_url(url), "cluster", "fleet") == "fleet"
        host, *rest = store(url)
        assert host in hosts and tuple(rest) == job[1:], name
        written[name] = host
    assert len(written) == 2 and set(written.values()) == hosts, "the sidecars spread over both servers"
    users = element(ET.parse(FLEET / "clickhouse" / "users.xml").getroot(), "users")
    assert users.find(job[4] or "-") is not None, "the URLs' user is the one users.xml makes"


def test_sidecars_wait_for_the_schema_job_and_the_job_for_every_server() -> None:
    for name, svc in sidecars().items():
        assert svc["depends_on"]["schema"] == {"condition": "service_completed_successfully"}, name
    job = compose()["services"]["schema"]
    assert job["restart"] == "no"
    assert {name: dep["condition"] for name, dep in job["depends_on"].items()} == \
        dict.fromkeys(services(SERVER_IMAGE), "service_healthy")
    for svc in services(SERVER_IMAGE).values():
        assert "/ping" in " ".join(svc["healthcheck"]["test"])


def _run_schema_job(tmp_path: Path, answers: list[int]) -> tuple[int, list[list[str]]]:
    """Run the compose schema job's script with a `stepline` that exits with each of `answers` in turn (then 1)."""
    bin_dir, calls = tmp_path / "bin", tmp_path / "calls"
    bin_dir.mkdir(parents=True)
    (tmp_path / "answers").write_text("\n".join(map(str, answers)) + "\n", encoding="utf-8")
    (bin_dir / "stepline").write_text(
        f'#!/bin/sh\nprintf "%s\\037" "$@" >> {calls}; echo >> {calls}\n'
        f'code=$(head -n 1 {tmp_path}/answers); sed -i 1d {tmp_path}/answers; exit "${{code:-1}}"\n', encoding="utf-8")
    (bin_dir / "sleep").write_text("#!/bin/sh\nexit 0\n", encoding="utf-8")
    for stub in bin_dir.iterdir():
        stub.chmod(0o755)
    job = compose()["services"]["schema"]
    script = job["command"][0].replace("$$", "$")
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}"}
    done = subprocess.run([*job["entrypoint"], script], env=env, capture_output=True, text=True, timeout=60)
    lines = calls.read_text(encoding="utf-8").splitlines() if calls.exists() else []
    return done.returncode, [["stepline", *line.split("\x1f")[:-1]] for line in lines]


@pytest.mark.skipif(shutil.which("sh") is None or shutil.which("seq") is None, reason="needs sh and seq")
def test_schema_job_tries_again_until_the_cluster_answers(tmp_path: Path) -> None:
    code, calls = _run_schema_job(tmp_path / "a", [1, 1, 0])
    assert code == 0 and calls == [schema_argv()] * 3
    code, calls = _run_schema_job(tmp_path / "b", [])
    assert code == 1 and len(calls) == 30


def test_sidecars_scrape_their_own_simulated_engine() -> None:
    hosts = set()
    for name, svc in sidecars().items():
        engine_service = svc["network_mode"].removeprefix("service:")
        engine = compose()["services"][engine_service]
        command = engine["command"]
        assert command[0] == "sim" and svc["depends_on"][engine_service] == {"condition": "service_started"}
        spec = svc["command"][svc["command"].index("--engine") + 1]
        assert spec == f"{command[command.index('--engine-name') + 1]}=http://127.0.0.1:8000", name
        socket = svc["environment"]["STEPLINE_PLUGIN_SOCKET"]
        assert command[command.index("--plugin-socket") + 1] == socket
        folder = str(Path(socket).parent)
        assert mounts(svc)[folder] == mounts(engine)[folder], f"{name}: the plugin socket is not shared"
        assert urlsplit(command[command.index("--otlp-endpoint") + 1]).port == Settings.otlp_port
        unknown = {k for k in svc["environment"] if k.startswith("STEPLINE_")} - COLLECTOR_ENV
        assert not unknown, f"{name}: {unknown}"
        hosts.add(svc["environment"]["STEPLINE_HOST_NAME"])
    assert len(hosts) == len(sidecars()), "one host name per sidecar: rows shard by cityHash64(host, engine)"


def test_writer_user_may_set_the_insert_settings() -> None:
    """The collectors send async_insert, wait_for_async_insert, async_insert_deduplicate, insert_deduplication_token and
    distributed_foreground_insert: the writer's profile is not readonly and constrains none of them."""
    users_xml = ET.parse(FLEET / "clickhouse" / "users.xml").getroot()
    assert element(users_xml, "users/default").get("remove") == "remove"  # the image's passwordless user
    profile = element(users_xml, "users/stepline").findtext("profile", "")
    assert profile == "default"  # the image's users.xml: an empty profile
    assert users_xml.find(f"profiles/{profile}/readonly") is None
    assert users_xml.find(f"profiles/{profile}/constraints") is None
    chi = yaml.safe_load((K8S_FLEET / "clickhouse-installation.yaml").read_text(encoding="utf-8"))["spec"]
    assert chi["configuration"]["users"]["stepline/profile"] == "default"
    profiles = chi["configuration"].get("profiles", {})
    assert not any(key.startswith(("default/readonly", "default/constraints")) for key in profiles), profiles


# --- passwords: files and Secrets, never environment values ------------------------------------------------------


def test_compose_passwords_reach_containers_as_files_never_as_environment(tmp_path: Path) -> None:
    declared = {name: spec["environment"] for name, spec in compose()["secrets"].items()}
    assert declared == {"clickhouse_password": "CLICKHOUSE_PASSWORD",
                        "clickhouse_cluster_secret": "CLICKHOUSE_CLUSTER_SECRET"}
    example = (FLEET / ".env.example").read_text(encoding="utf-8").splitlines()
    assert all(f"{var}=CHANGE-ME" in example for var in declared.values())
    for name, svc in compose()["services"].items():
        values = " ".join(f"{k}={v}" for k, v in (svc.get("environment") or {}).items())
        assert not any(var in values for var in declared.values()), f"{name} has a secret in its environment"
        assert set(svc.get("secrets", [])) <= set(declared), name
    for text in (p.read_text(encoding="utf-8") for p in (FLEET / "clickhouse").glob("*.xml")):
        assert "<password>" not in text and "<password_sha256_hex>" not in text, "no literal password in a file"

    password, cluster_secret = "s3cret pw_1.x", "inter-server"
    secrets = tmp_path / "secrets"
    secrets.mkdir()
    (secrets / "clickhouse_password").write_text(f"  {password}\n", encoding="utf-8")
    (secrets / "clickhouse_cluster_secret").write_text(cluster_secret + "\n", encoding="utf-8")

    # The collectors (sidecars and the schema job): the password file merged into a URL that carries none.
    for name in [*sidecars(), "schema"]:
        svc = compose()["services"][name]
        path = svc["environment"]["STEPLINE_STORE_PASSWORD_FILE"]
        assert path == "/run/secrets/clickhouse_password" and "clickhouse_password" in svc["secrets"], name
    url = next(iter(sidecars().values()))["environment"]["STEPLINE_STORE"]
    settings = Settings.from_env({"STEPLINE_STORE": url,
                                  "STEPLINE_STORE_PASSWORD_FILE": str(secrets / "clickhouse_password")})
    assert parse_store_url(settings.store).password == password
    assert urlsplit(settings.store).query == urlsplit(url).query

    # The servers: entrypoint.sh hands the image's entrypoint the hash of the same password and the cluster secret,
    # under the names users.xml and fleet.xml read.
    users_xml = ET.parse(FLEET / "clickhouse" / "users.xml").getroot()
    hash_var = element(users_xml, "users/stepline/password_sha256_hex").get("from_env")
    secret_var = element(ET.parse(FLEET / "clickhouse" / "fleet.xml").getroot(), "remote_servers/fleet/secret").get(
        "from_env")
    stub = tmp_path / "entrypoint.sh"
    stub.write_text(f'#!/bin/sh\nprintf "%s|%s|%s" "${hash_var}" "${secret_var}" "$*"\n', encoding="utf-8")
    stub.chmod(0o755)
    for name, svc in services(SERVER_IMAGE).items():
        script_path = svc["entrypoint"][-1]
        assert mounts(svc)[script_path] == "./clickhouse/entrypoint.sh" and set(svc["secrets"]) == set(declared), name
        assert "CLICKHOUSE_PASSWORD" not in svc["environment"] and "CLICKHOUSE_USER" not in svc["environment"]
    script = (FLEET / "clickhouse" / "entrypoint.sh").read_text(encoding="utf-8")
    script = script.replace("/run/secrets/", f"{secrets}/")
    wrapper = tmp_path / "wrapper.sh"
    wrapper.write_text(script.replace("exec /entrypoint.sh", f"exec {stub}"), encoding="utf-8")
    argv = [*next(iter(services(SERVER_IMAGE).values()))["entrypoint"][:-1], str(wrapper), "--listen_host=::"]
    out = subprocess.run(argv, capture_output=True, text=True, timeout=10, check=True).stdout
    assert out == f"{hashlib.sha256(password.encode()).hexdigest()}|{cluster_secret}|--listen_host=::"
    (secrets / "clickhouse_cluster_secret").write_text("\n", encoding="utf-8")
    done = subprocess.run(argv, capture_output=True, text=True, timeout=10)
    assert done.returncode != 0 and not done.stdout, "an empty secret must stop the server, not open it"


# --- Kubernetes: the operator's names ----------------------------------------------------------------------------


def k8s_fleet() -> dict[str, dict[str, Any]]:
    kustomization = yaml.safe_load((K8S_FLEET / "kustomization.yaml").read_text(encoding="utf-8"))
    assert kustomization["namespace"] == "stepline"
    objects = {}
    for rel in kustomization["resources"]:
        path = (K8S_FLEET / rel).resolve()
        assert path.parent == K8S_FLEET.resolve() and path.is_file(), rel
        for doc in yaml.safe_load_all(path.read_text(encoding="utf-8")):
            objects[doc["kind"]] = doc
    assert set(objects) == {"ClickHouseInstallation", "ClickHouseKeeperInstallation", "Job"}
    return objects


def operator_services(chi: dict[str, Any], chk: dict[str, Any]) -> dict[str, int]:
    """The Services the operator makes (name -> the port used here): keeper-<CHK> (2181), clickhouse-<CHI> (8123) and
    one per server, chi-<CHI>-<cluster>-<shard>-<replica> (9000), counting from 0 (Altinity/clickhouse-operator
    pkg/model/{chi,chk}/namer/patterns.go, pkg/model/common/namer/name.go, pkg/model/chk/creator/service.go)."""
    name = chi["metadata"]["name"]
    out = {f"keeper-{chk['metadata']['name']}": 2181, f"clickhouse-{name}": 8123}
    for cluster in chi["spec"]["configuration"]["clusters"]:
        layout = cluster["layout"]
        for shard in range(layout["shardsCount"]):
            for replica in range(layout["replicasCount"]):
                out[f"chi-{name}-{cluster['name']}-{shard}-{replica}"] = 9000
    return out


def test_k8s_installation_keeper_and_job_name_each_other() -> None:
    objects = k8s_fleet()
    chi, chk, job = objects["ClickHouseInstallation"], objects["ClickHouseKeeperInstallation"], objects["Job"]
    assert (chi["apiVersion"], chk["apiVersion"]) == ("clickhouse.altinity.com/v1", "clickhouse-keeper.altinity.com/v1")
    made = operator_services(chi, chk)
    (keeper_cluster,) = chk["spec"]["configuration"]["clusters"]
    assert keeper_cluster["layout"]["replicasCount"] == 3
    assert chi["spec"]["configuration"]["zookeeper"]["nodes"] == [
        {"host": host, "port": port} for host, port in made.items() if host.startswith("keeper-")]
    (cluster,) = chi["spec"]["configuration"]["clusters"]
    assert cluster["name"] == remote_servers()[0]
    assert (cluster["layout"]["shardsCount"], cluster["layout"]["replicasCount"]) == (3, 2)
    assert len([host for host in made if host.startswith("chi-")]) == 6
    (container,) = job["spec"]["template"]["spec"]["containers"]
    args = container["args"]
    assert args[:4] == ["schema", "--cluster", cluster["name"], "--apply"] and len(args) == 5
    host, port, database, url_cluster, user = store(args[4])
    assert made.get(host) == port == 8123 and host == f"clickhouse-{chi['metadata']['name']}"
    assert (database, url_cluster) == ("stepline", cluster["name"])
    assert f"{user}/password" in chi["spec"]["configuration"]["users"]
    assert job["spec"]["backoffLimit"] > 0 and container["resources"]["requests"]
    # The collectors are pointed at the cluster by hand (../clickhouse-cluster.md): with the job's URL.
    assert f"STEPLINE_STORE={args[4]}" in CLUSTER_DOC.read_text(encoding="utf-8").replace("`", "")


def test_k8s_password_comes_from_the_one_secret_as_a_file() -> None:
    objects = k8s_fleet()
    pod = objects["Job"]["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    env = {e["name"]: e for e in container["env"]}
    assert set(env) <= COLLECTOR_ENV and all("value" in e for e in env.values())
    path = Path(env["STEPLINE_STORE_PASSWORD_FILE"]["value"])
    mount = next(m for m in container["volumeMounts"] if m["mountPath"] == str(path.parent))
    volume = next(v for v in pod["volumes"] if v["name"] == mount["name"])
    ref = objects["ClickHouseInstallation"]["spec"]["configuration"]["users"]["stepline/password"]["valueFrom"]
    assert ref == {"secretKeyRef": {"name": volume["secret"]["secretName"], "key": path.name}}
    assert ref["secretKeyRef"] == {"name": "stepline-clickhouse", "key": "password"}  # the single-server recipe's


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl not installed")
def test_kustomize_builds_the_fleet() -> None:
    done = subprocess.run(["kubectl", "kustomize", str(K8S_FLEET)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    kinds = {(d["kind"], d["metadata"]["name"], d["metadata"]["namespace"]) for d in yaml.safe_load_all(done.stdout)}
    assert kinds == {("ClickHouseInstallation", "stepline", "stepline"),
                     ("ClickHouseKeeperInstallation", "stepline", "stepline"), ("Job", "stepline-schema", "stepline")}
