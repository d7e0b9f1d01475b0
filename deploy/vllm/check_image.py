"""Run at image build time: exit 1 unless vLLM can trace over OTLP and loads stepline's stat-logger plugin."""

import sys
from importlib.metadata import entry_points

PLUGIN = "stepline.plugin.vllm_logger:SteplineStatLogger"


def problems() -> list[str]:
    found = []
    import vllm.tracing

    if not vllm.tracing.is_otel_available():
        found.append("vllm.tracing.is_otel_available() is False: --otlp-traces-endpoint would fail\n"
                     f"{getattr(vllm.tracing, 'otel_import_error_traceback', '')}")
    plugins = [ep for ep in entry_points(group="vllm.stat_logger_plugins") if ep.name == "stepline"]
    if [ep.value for ep in plugins] != [PLUGIN]:
        found.append(f"entry point vllm.stat_logger_plugins:stepline is {[ep.value for ep in plugins]}, not [{PLUGIN}]")
    else:
        from vllm.v1.metrics.loggers import StatLoggerBase

        if not issubclass(plugins[0].load(), StatLoggerBase):
            found.append(f"{PLUGIN} does not subclass vllm.v1.metrics.loggers.StatLoggerBase")
    return found


if __name__ == "__main__":
    failed = problems()
    for line in failed:
        print(f"check_image: {line}", file=sys.stderr)
    print("check_image: OTLP tracing available, stepline plugin visible" if not failed else "", file=sys.stderr)
    sys.exit(1 if failed else 0)
