"""The plugin vLLM loads imports nothing outside the standard library and vLLM: it goes into vLLM images with
`pip install --no-deps`, where stepline's own dependencies are absent."""

from __future__ import annotations

import json
import subprocess
import sys
import sysconfig
import textwrap
from pathlib import Path

from stepline.testing import vllm_standins as standins

COLLECTOR_DIR = str(Path(__file__).resolve().parents[2] / "collector")

# Run with -S -I: no site-packages, no user site, no PYTHONPATH; sys.path is set by hand to the standard library,
# stepline's source and the stand-in vllm, so importing anything else fails, and whatever was imported is listed.
_IMPORT_ONLY = textwrap.dedent("""
    import sys
    sys.path[:] = [*{stdlib!r}, {collector!r}, {standin!r}]
    import stepline.plugin.vllm_logger as plugin

    logger = plugin.SteplineStatLogger(object(), 0)  # construct, record and log as vLLM does: lazy imports count too
    logger.log_engine_initialized()
    logger.record(None, None)
    logger.log()
    import json
    modules = {{name: getattr(module, "__file__", None) for name, module in list(sys.modules.items())}}
    print(json.dumps(modules))
""")


def _stdlib_dirs() -> list[str]:
    # The base installation's, not a virtualenv's: inside one, platstdlib names the venv, which has no lib-dynload.
    base = {"base": sys.base_prefix, "platbase": sys.base_exec_prefix, "installed_base": sys.base_prefix,
            "installed_platbase": sys.base_exec_prefix}
    paths = sysconfig.get_paths(vars=base)
    dirs = [paths["stdlib"], paths["platstdlib"], str(Path(paths["platstdlib"]) / "lib-dynload")]
    return [d for d in dict.fromkeys(dirs) if Path(d).is_dir()]


def test_the_plugin_imports_only_the_standard_library_and_vllm(tmp_path: Path) -> None:
    standin = standins.write_vllm_package(tmp_path / "standin")
    stdlib = _stdlib_dirs()
    script = _IMPORT_ONLY.format(stdlib=stdlib, collector=COLLECTOR_DIR, standin=str(standin))
    result = subprocess.run([sys.executable, "-S", "-I", "-c", script], capture_output=True, text=True, timeout=60,
                            env={"STEPLINE_PLUGIN_SOCKET": str(tmp_path / "none.sock"), "PATH": "/usr/bin:/bin"})
    assert result.returncode == 0, result.stderr
    modules: dict[str, str | None] = json.loads(result.stdout.splitlines()[-1])
    allowed_roots = (*stdlib, str(standin), str(Path(COLLECTOR_DIR) / "stepline"))
    outside = {name: file for name, file in modules.items()
               if name.partition(".")[0] not in {*sys.stdlib_module_names, "__main__", "stepline", "vllm"}
               or (file is not None and not file.startswith(allowed_roots))}
    assert outside == {}, f"the plugin imported modules outside the standard library and vLLM: {outside}"
    assert "stepline.plugin.vllm_logger" in modules and "vllm.v1.metrics.loggers" in modules
