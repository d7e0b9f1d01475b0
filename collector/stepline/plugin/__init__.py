"""The vLLM stat-logger plugin: a vLLM-free core, and a thin class vLLM loads (`vllm_logger`)."""
