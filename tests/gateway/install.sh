#!/usr/bin/env bash
# The gateways the gateway tests run for real, in an environment of their own: LiteLLM's proxy and vllm-router from
# the package index (versions pinned here), with stepline installed as a wheel, `--no-deps` (the LiteLLM callback
# needs only the standard library and LiteLLM). Prints the environment's path. Reuses an environment that already
# has these versions; always reinstalls stepline.
set -euo pipefail
litellm=1.108.7  # the newest whose [proxy] extra resolves on the index (1.110 needs a litellm-proxy package it lacks)
router=0.1.17
venv="${STEPLINE_GATEWAY_VENV:-$HOME/.cache/stepline/gateway}"
repo="$(cd "$(dirname "$0")/../.." && pwd)"

if ! "$venv/bin/python" -c "import importlib.metadata as m, sys; sys.exit(m.version('litellm') != '$litellm' or m.version('vllm-router') != '$router')" 2>/dev/null; then
  rm -rf "$venv"
  python3 -m venv "$venv"
  # prometheus_client: the proxy's own `callbacks: ["prometheus"]` needs it and the [proxy] extra does not pull it in.
  "$venv/bin/python" -m pip install --quiet --disable-pip-version-check "litellm[proxy]==$litellm" \
    "vllm-router==$router" prometheus_client >&2
fi
wheels="$(mktemp -d)"
trap 'rm -rf "$wheels"' EXIT
python3 -m pip wheel --quiet --disable-pip-version-check --no-deps --wheel-dir "$wheels" "$repo" >&2
"$venv/bin/python" -m pip install --quiet --disable-pip-version-check --no-deps --force-reinstall "$wheels"/stepline-*.whl >&2
echo "$venv"
