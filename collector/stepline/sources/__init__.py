"""What the collector reads, one module per source (vLLM /metrics, the plugin receiver, OTLP, NVML, host, pod
resources) behind one protocol (`base.Source`); `registry.REGISTRY` names them with their defaults."""
