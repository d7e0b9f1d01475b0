"""A LiteLLM proxy callback that puts each routed attempt on the timeline as a decision record.

In the proxy's config.yaml (the module is imported by the proxy, in the proxy's environment, never by stepline):

    litellm_settings:
      callbacks: ["stepline.gateway.litellm.proxy_handler"]

with STEPLINE_OTLP_URL (default http://127.0.0.1:4318/v1/traces) and STEPLINE_GATEWAY_NAME (default litellm) in the
proxy's environment. Each attempt becomes one `stepline.gateway.decision` span (stepline.gateway.decisions): the
model group is the lane, the deployment's api_base the backend, the prompt measured in characters and bytes, and the
outcome. A routing hook that sizes requests says what it measured and against which threshold by putting
`stepline_size_chars`, `stepline_size_tokens`, `stepline_threshold` and `stepline_threshold_unit` (and
`stepline_swallowed`, for an exception it went on past) in the request's `metadata`.

The callback only reads and queues (DecisionRecorder: bounded, a thread of its own, every loss counted): it never
blocks the proxy's event loop, and an error of its own is counted and logged, rate limited, never raised into the
proxy. LiteLLM 1.108.7, read in its sources:
- `litellm/integrations/custom_logger.py`: `CustomLogger.async_log_success_event` / `async_log_failure_event`
  (kwargs, response_obj, start_time, end_time) after each attempt, and `async_post_call_failure_hook` (request_data,
  original_exception, user_api_key_dict) when the proxy fails a call, also with a 499 when the client disconnected
  (`proxy/common_request_processing.py`, `_CLIENT_DISCONNECT_DETAIL`).
- `litellm/types/utils.py` `StandardLoggingPayload`, in kwargs["standard_logging_object"]: `id`, `model_group`,
  `api_base`, `startTime`, `completionStartTime`, `endTime` (Unix seconds), `status`, `error_information`
  (`error_class`, `error_code`).
- `proxy/common_request_processing.py` `finalize_streaming_generator_cleanup`: a streaming client that went away
  closes the stream (`response.aclose()`), and a logging event follows only where partial spend is billed;
  `CustomLogger.async_post_call_streaming_iterator_hook` (request_data) wraps the stream, so its close is seen.
"""

from __future__ import annotations

import logging
import os
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from datetime import datetime
from typing import Any

from litellm.integrations.custom_logger import CustomLogger  # type: ignore[import-not-found]

from stepline.core.ratelimit import RateLimitedLog
from stepline.gateway.record import DecisionRecorder

log = logging.getLogger(__name__)
_REMEMBERED = 10_000
DEFAULT_URL = "http://127.0.0.1:4318/v1/traces"


def _metadata(kwargs: dict[str, Any]) -> dict[str, Any]:
    params = kwargs.get("litellm_params") or {}
    merged: dict[str, Any] = {}
    for source in (kwargs.get("metadata"), params.get("metadata")):
        if isinstance(source, dict):
            merged.update(source)
    return merged


def _prompt_text(messages: Any) -> str:
    """The prompt as the proxy received it, for measuring: message contents joined (text parts of a list too)."""
    if isinstance(messages, str):
        return messages
    parts: list[str] = []
    for message in messages if isinstance(messages, list) else []:
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, str):
            parts.append(content)
        elif isinstance(content, list):
            parts.extend(str(p.get("text", "")) for p in content if isinstance(p, dict))
    return "".join(parts)


def _measured(meta: dict[str, Any], text: str) -> dict[str, Any]:
    """The record's size and bar: what the routing hook put in `metadata`, else the prompt's characters and bytes."""
    return {"size_chars": _int(meta.get("stepline_size_chars")) or len(text), "size_bytes": len(text.encode("utf-8")),
            "size_tokens": _int(meta.get("stepline_size_tokens")), "threshold": meta.get("stepline_threshold"),
            "threshold_unit": str(meta.get("stepline_threshold_unit") or ""),
            "swallowed": meta.get("stepline_swallowed")}


def _int(value: Any) -> int | None:
    try:
        return None if value is None else int(value)
    except (TypeError, ValueError):
        return None


class StepLineLogger(CustomLogger):  # type: ignore[misc]
    """Records every attempt the proxy makes; see the module's docstring."""

    def __init__(self, url: str | None = None, gateway: str | None = None) -> None:
        super().__init__()
        self.recorder = DecisionRecorder(url or os.environ.get("STEPLINE_OTLP_URL", DEFAULT_URL),
                                         gateway or os.environ.get("STEPLINE_GATEWAY_NAME", "litellm"))
        self.errors = 0
        self._log = RateLimitedLog(log)
        self._disconnected: set[str] = set()  # call ids recorded as disconnects, the newest _REMEMBERED
        self._order: deque[str] = deque()

    async def async_log_success_event(self, kwargs: dict[str, Any], response_obj: Any, start_time: Any,
                                      end_time: Any) -> None:
        self._safely(kwargs, None)

    async def async_log_failure_event(self, kwargs: dict[str, Any], response_obj: Any, start_time: Any,
                                      end_time: Any) -> None:
        self._safely(kwargs, kwargs.get("exception"))

    async def async_post_call_failure_hook(self, request_data: dict[str, Any], original_exception: Exception,
                                           user_api_key_dict: Any, traceback_str: str | None = None) -> None:
        # A client that went away is reported here with a 499 (the logging events may never come for it); every
        # other failure comes to async_log_failure_event too, which records it.
        if getattr(original_exception, "status_code", None) == 499:
            self._guarded(self._record_disconnect, request_data)

    async def async_post_call_streaming_iterator_hook(self, user_api_key_dict: Any, response: Any,
                                                      request_data: dict[str, Any]) -> AsyncIterator[Any]:
        # Every chunk passes through unchanged. A stream the client leaves is closed mid-way (aclose): no logging
        # event may follow (1.108.7 fires one only where it bills partial spend), so the decision is recorded here.
        finished = False
        try:
            async for item in response:
                yield item
            finished = True
        finally:
            if not finished:
                self._guarded(self._record_disconnect, request_data)

    def _record_disconnect(self, data: dict[str, Any]) -> None:
        call_id = str(data.get("litellm_call_id") or "")
        if call_id in self._disconnected:
            return
        self._remember(call_id)
        logging_obj = data.get("litellm_logging_obj")
        details = getattr(logging_obj, "model_call_details", None) or {}
        params = details.get("litellm_params") or data.get("litellm_params") or {}
        started = getattr(logging_obj, "start_time", None)
        start_s = started.timestamp() if isinstance(started, datetime) else time.time()
        meta = _metadata({"metadata": data.get("metadata"), "litellm_params": params})
        text = _prompt_text(data.get("messages") if data.get("messages") is not None else data.get("prompt"))
        self.recorder.record(
            request_id=call_id, lane=str(data.get("model") or ""), backend=str(params.get("api_base") or ""),
            start_s=start_s, end_s=time.time(), status=499, error_type="client_disconnected",
            client_disconnected=True, **_measured(meta, text))

    def _remember(self, call_id: str) -> None:
        self._disconnected.add(call_id)
        self._order.append(call_id)
        if len(self._order) > _REMEMBERED:
            self._disconnected.discard(self._order.popleft())

    def _safely(self, kwargs: dict[str, Any], exception: Any) -> None:
        if str(kwargs.get("litellm_call_id") or "") in self._disconnected:
            return  # recorded as a disconnect already
        self._guarded(self._record, kwargs, exception)

    def _guarded(self, record: Callable[..., None], *args: Any) -> None:
        """Run one recording: the callback's own bug is counted and logged, never raised into the proxy."""
        try:
            record(*args)
        except Exception as exc:
            self.errors += 1
            self._log.warning("callback", "stepline LiteLLM callback failed (%d so far): %s", self.errors, exc)

    def _record(self, kwargs: dict[str, Any], exception: Any) -> None:
        payload = kwargs.get("standard_logging_object") or {}
        meta = _metadata(kwargs)
        text = _prompt_text(kwargs.get("messages") if kwargs.get("messages") is not None else payload.get("messages"))
        error = payload.get("error_information") or {}
        disconnected = bool(meta.get("client_disconnected"))
        failed = payload.get("status") == "failure" or exception is not None
        code = _int(error.get("error_code")) if failed else 200
        started = float(payload.get("startTime") or time.time())
        first = payload.get("completionStartTime")
        self.recorder.record(
            request_id=str(kwargs.get("litellm_call_id") or payload.get("id") or ""),
            lane=str(payload.get("model_group") or kwargs.get("model") or ""),
            backend=str(payload.get("api_base") or (kwargs.get("litellm_params") or {}).get("api_base") or ""),
            start_s=started, end_s=float(payload.get("endTime") or started),
            status=499 if disconnected else (code or (500 if failed else 200)),
            error_type=str(error.get("error_class") or (type(exception).__name__ if exception is not None else "")),
            client_disconnected=disconnected,
            first_byte_s=float(first) if first and not failed else None, **_measured(meta, text))


proxy_handler = StepLineLogger()
"""The instance a proxy's config names (`callbacks: ["stepline.gateway.litellm.proxy_handler"]`)."""
