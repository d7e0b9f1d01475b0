"""Test doubles, public and documented like OpenTelemetry's in-memory exporters, for stepline's tests, its users'
tests and the demo: an in-memory sink (`sink`), a fake NVML (`fake_nvml`) and psutil (`fake_psutil`), vLLM
stand-ins for the plugin (`vllm_standins`), and a writable ClickHouse endpoint over an embedded store
(`storeserver`)."""
