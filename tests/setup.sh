#!/usr/bin/env bash
# Everything the test suite runs for real, installed where it is missing: the README's second command and `.ci/run`
# both start here. Debian's chromium (the report drawn headless), promtool and amtool (the alert, dashboard and deploy
# tests), Node.js with the pinned @clickhouse/client (the query endpoint's client tests), this checkout with its test
# extras, and in environments of their own under ~/.cache/stepline vLLM's CPU build (tests/realvllm/install.sh) and
# LiteLLM's proxy with vllm-router (tests/gateway/install.sh).
# The first run downloads about 4.5 GB and takes minutes; with everything in place it checks, puts this checkout's
# wheel into the two environments again (about 12 s each on the project's 2-core VM) and returns.
set -euo pipefail
cd "$(dirname "$0")/.."

# need TOOL PACKAGE: Debian's PACKAGE provides TOOL (tests/docs/test_readme.py reads these lines).
packages=()
need() { command -v "$1" >/dev/null || packages+=("$2"); }
need chromium chromium
need promtool prometheus
need amtool prometheus-alertmanager
need node nodejs
need npm npm
if ((${#packages[@]})); then
  if ! command -v apt-get >/dev/null; then
    echo "tests/setup.sh: no apt-get here: install ${packages[*]} (or what provides them) and run it again" >&2
    exit 1
  fi
  sudo=()
  if [ "$(id -u)" != 0 ]; then
    command -v sudo >/dev/null || { echo "tests/setup.sh: installing ${packages[*]} needs root or sudo" >&2; exit 1; }
    sudo=(sudo)
  fi
  "${sudo[@]}" apt-get update -qq
  "${sudo[@]}" env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${packages[@]}"
fi

# npm ci empties node_modules first, so the stamp of the lock file it installed goes with it.
node=tests/clients/node  # the pinned @clickhouse/client
lock="$(sha256sum "$node/package-lock.json" | cut -d' ' -f1)"
if [ "$(cat "$node/node_modules/.stepline-lock-sha256" 2>/dev/null)" != "$lock" ]; then
  npm ci --prefix tests/clients/node --no-audit --no-fund --loglevel=error
  echo "$lock" >"$node/node_modules/.stepline-lock-sha256"
fi

# This checkout, editable, with the test extras at their pins; pip runs only when one of them is not so.
if ! python3 - <<'EOF'
import importlib.metadata as metadata
import json
import pathlib
import re
import sys
import tomllib

project = tomllib.loads(pathlib.Path("pyproject.toml").read_text(encoding="utf-8"))["project"]
for requirement in [*project["dependencies"], *project["optional-dependencies"]["test"]]:
    requirement, _, marker = requirement.partition(";")
    if marker:
        try:
            from packaging.markers import Marker  # pytest's dependency: there once the test extras are
        except ImportError:
            sys.exit(1)
        if not Marker(marker).evaluate():
            continue  # not for this platform
    pinned = re.fullmatch(r"([A-Za-z0-9_.-]+)(?:\[[^]]*\])?==(\S+)", requirement.strip())
    if pinned is None:
        sys.exit(1)  # a range: pip judges it
    try:
        installed = metadata.version(pinned[1])
    except metadata.PackageNotFoundError:
        sys.exit(1)
    if installed.lower().removeprefix("v") != pinned[2].lower():  # PEP 440 reads "v0.0.21" as 0.0.21
        sys.exit(1)
try:
    url = json.loads(metadata.distribution("stepline").read_text("direct_url.json") or "{}")
except metadata.PackageNotFoundError:
    sys.exit(1)
editable = url.get("dir_info", {}).get("editable", False)
sys.exit(0 if editable and url.get("url") == pathlib.Path.cwd().as_uri() else 1)
EOF
then
  python3 -m pip install --quiet --disable-pip-version-check -e '.[test]'
fi

# Each reuses an environment that already has its pinned versions and refreshes stepline's wheel in it.
bash tests/realvllm/install.sh >/dev/null
bash tests/gateway/install.sh >/dev/null
echo "tests/setup.sh: the suite's tools and environments are in place"
