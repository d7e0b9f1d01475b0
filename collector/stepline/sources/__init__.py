"""What the collector reads, one module per source behind one protocol (`base.Source`): vLLM's /metrics
(`vllm_metrics`), the plugin's datagrams (`plugin_receiver`), OTLP/HTTP spans (`otlp`, decoded by `otlp_decode`),
NVML (the `gpu` package), the host and engine processes (`host`), the kubelet's pod resources (`podresources`).
`registry.REGISTRY` names them with their intervals and on/off switches."""
