"""The class vLLM loads from the `vllm.stat_logger_plugins` entry point; it only delegates to PluginCore.

Supported: vLLM 0.33 (v1 engine). Enable with `pip install stepline` in the vLLM image, then start
vLLM with `--enable-logging-iteration-details` (per-step batch composition and timing) and, when
VLLM_PLUGINS is set, include `stepline` in it. STEPLINE_PLUGIN_SOCKET points at the sidecar's socket
(default /tmp/stepline-plugin.sock), STEPLINE_ENGINE names the engine (default OTEL_SERVICE_NAME or "vllm"),
STEPLINE_PLUGIN_TOKEN (or STEPLINE_PLUGIN_TOKEN_FILE) gives the token the collector was started with.

Imports nothing outside the standard library and vLLM: it is installed into vLLM images with `--no-deps`.
vLLM gives stat loggers no shutdown call; the plugin's outbox sends what it still holds at exit (atexit).
"""

from __future__ import annotations

import os
from typing import Any

from vllm.v1.metrics.loggers import StatLoggerBase

from stepline.plugin.config import batch_queue, describe_config, token_from_env
from stepline.plugin.core import DEFAULT_SOCKET, PluginCore, engine_name_from_env


class SteplineStatLogger(StatLoggerBase):  # type: ignore[misc]  # vLLM is not installed where stepline is typed
    """Ships every engine step and finished request to the stepline sidecar."""

    def __init__(self, vllm_config: Any, engine_index: int = 0) -> None:
        self.engine_index = engine_index
        self._config = describe_config(vllm_config, engine_index)
        details = self._config.get("enable_logging_iteration_details")
        # Known on: scheduler stats without details (idle, 0-token steps) are never a step. Not known: learned.
        self._core = PluginCore(engine_name_from_env(), os.environ.get("STEPLINE_PLUGIN_SOCKET", DEFAULT_SOCKET),
                                token=token_from_env(),
                                iteration_details=details if isinstance(details, bool) else None,
                                batch_queue=batch_queue(self._config))

    def record(self, scheduler_stats: Any, iteration_stats: Any, mm_cache_stats: Any = None,
               engine_idx: int = 0) -> None:
        self._core.record(scheduler_stats, iteration_stats, engine_idx)

    def log_engine_initialized(self) -> None:
        self._core.engine_initialized(self._config)

    def log(self) -> None:
        """vLLM calls this about every 10 s, idle or not: a periodic flush (the sender thread does the rest)."""
        self._core.flush()
