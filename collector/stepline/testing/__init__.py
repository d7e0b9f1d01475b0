"""Test doubles, public and documented like OpenTelemetry's in-memory exporters, for stepline's tests, its users'
tests and the simulator: an in-memory sink (`sink`), a fake NVML (`fake_nvml`), psutil (`fake_psutil`) and /proc
(`fake_procfs`), vLLM stand-ins for the plugin (`vllm_standins`), a writable ClickHouse endpoint over an embedded
store (`storeserver`), and the generated alert rules in a real Prometheus and Alertmanager paging a webhook that
keeps what it is sent (`alertstack`)."""
