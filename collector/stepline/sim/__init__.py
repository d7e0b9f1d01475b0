"""A vLLM 0.33-compatible engine simulator: scheduler, step costs, workloads, /metrics, replay."""
