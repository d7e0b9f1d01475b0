"""A vLLM 0.33-compatible engine simulator: the scheduler (`scheduler`), step costs (`costmodel`), the engine that runs
them (`engine`, configured by `config`), workloads and traffic (`workloads`, `traffic`), simulated GPUs (`gpu`), the
telemetry a real engine sends (`metrics` for /metrics, `telemetry` and `records` for plugin datagrams and spans), an
OpenAI-compatible server over it (`vllm_server`, parsing requests with `completions`) and replays of recorded
requests (`replay`). Incidents run through the collector live in `stepline.drills`."""
