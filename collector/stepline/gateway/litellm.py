"""A LiteLLM proxy callback that puts each routed attempt on the timeline as a decision record.

In the proxy's config.yaml (the module is imported by the proxy, in the proxy's environment, never by stepline):

    litellm_settings:
      callbacks: ["stepline.gateway.litellm.proxy_handler"]

with STEPLINE_OTLP_URL (default http://127.0.0.1:4318/v1/traces) and STEPLINE_GATEWAY_NAME (default litellm) in the
proxy's environment. Each attempt becomes one `stepline.gateway.decision` span (stepline.gateway.decisions): the
model group is the lane, the deployment's api_base the backend, the prompt measured in characters and bytes, and the
outcome. A routing hook that sizes requests says what it measured and against which threshold by putting
`stepline_size_chars`, `stepline_size_tokens`, `stepline_threshold` and `stepline_threshold_unit` (and
`stepline_swallowed`, for an exception it went on past, and `stepline_lane`, the lane it chose, for a request it then
refuses) in the request's `metadata`. A request refused before any deployment is called (the hook's exception, a
rate or parallel-request limiter, a budget) is one decision, recorded from the proxy's failure hook with the request
as the hooks left it: its size, its lane, the refusal's status and exception, no backend.

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

Retries and fallbacks: every deployment call of one request, the first, each retry (`num_retries`) and each fallback
hop, is its own decision, numbered 1, 2, ... in the order the router made them, with the same request id
(`litellm_call_id`, which the router carries through the whole chain). Read in 1.108.7:
- `litellm/utils.py` `client`'s `wrapper_async` awaits `async_pre_call_deployment_hook` (kwargs, call_type) before
  each deployment call and `async_post_call_failure_deployment_hook` (request_data, exception, call_type,
  fallback_depth) when it fails, "once per failed deployment attempt - attempt 1, every retry, and every fallback
  chain step" (`integrations/custom_logger.py`); the deployment hook runs first, then the logging object's
  `async_failure_handler`.
- `litellm/litellm_core_utils/litellm_logging.py` `Logging._async_failure_handler_body`: the REQUEST-LEVEL
  `async_log_failure_event` is gated by `has_logged_async_failure` on the logging object the router shares across
  the chain, so it fires once, for the first failure; `async_log_success_event` fires for the attempt that succeeded.
- `litellm/router.py` `Router.async_function_with_retries` (metadata `attempted_retries`, the retry's index within
  the current model group), `Router.log_retry` (metadata `request_retry_count`, `previous_models`), and
  `litellm/router_utils/fallback_event_handlers.py` `run_async_fallback` (each hop: `kwargs["fallback_depth"]`,
  metadata `attempted_fallbacks`, `original_model_group`, `model_group`).
"""

from __future__ import annotations

import logging
import os
import sys
import time
from collections import OrderedDict, deque
from collections.abc import AsyncIterator, Callable, Iterable, Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from litellm.integrations.custom_logger import CustomLogger  # type: ignore[import-not-found]

from stepline.core.ratelimit import RateLimitedLog
from stepline.gateway.record import DecisionRecorder

log = logging.getLogger(__name__)
_REMEMBERED = 10_000
DEFAULT_URL = "http://127.0.0.1:4318/v1/traces"


def _metadata(kwargs: Mapping[str, Any]) -> dict[str, Any]:
    params = kwargs.get("litellm_params") or {}
    merged: dict[str, Any] = {}
    # The router keeps its bookkeeping in `metadata`, or `litellm_metadata` for some endpoints
    # (router_utils/fallback_event_handlers.py, get_router_metadata_variable_name).
    for source in (kwargs.get("litellm_metadata"), kwargs.get("metadata"), params.get("metadata")):
        if isinstance(source, dict):
            merged.update(source)
    return merged


def _request_text(data: Mapping[str, Any]) -> str:
    """The prompt of a request as the proxy holds it: a chat request's `messages`, else a completion's `prompt`."""
    return _prompt_text(data.get("messages") if data.get("messages") is not None else data.get("prompt"))


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


def _who(meta: Mapping[str, Any], request: Mapping[str, Any], model: Any) -> dict[str, Any]:
    """Who sent the request, as the proxy's auth put it in `metadata` (proxy/litellm_pre_call_utils.py
    `add_litellm_data_to_request`: user_api_key_alias, _team_alias, _team_id, _user_id, _end_user_id; the
    StandardLoggingUserAPIKeyMetadata of types/utils.py), and the model the backend was asked for. The key is named
    by its alias, else by the first 12 characters of its hash, never by itself; the end user is the client's
    OpenAI `user` field where the proxy kept none."""
    key = meta.get("user_api_key_alias") or str(meta.get("user_api_key_hash") or "")[:12]
    return {"model": str(model or "").rpartition("/")[2], "key": str(key or ""),
            "team": str(meta.get("user_api_key_team_alias") or meta.get("user_api_key_team_id") or ""),
            "user": str(meta.get("user_api_key_user_id") or ""),
            "end_user": str(meta.get("user_api_key_end_user_id") or request.get("user") or "")}


def _int(value: Any) -> int | None:
    try:
        return None if value is None else int(value)
    except (TypeError, ValueError):
        return None


@dataclass
class _Chain:
    """One request's deployment calls so far: how many, when the latest began, the model groups it may go to
    (the original and its fallbacks), and the attempts already recorded."""

    attempts: int = 0
    started: float = 0.0
    candidates: list[str] = field(default_factory=list)
    recorded: set[int] = field(default_factory=set)


def _unique(groups: Iterable[Any]) -> list[str]:
    seen: list[str] = []
    for group in groups:
        if isinstance(group, str) and group and group not in seen:
            seen.append(group)
    return seen


def _fallback_groups(fallbacks: Any, group: str) -> list[str]:
    """The model groups `fallbacks` sends `group` on to, in order: the router's shape (`[{"fast": ["heavy"]}]`, a
    `"*"` entry for any group) or a request's own list (`["heavy"]`, `[{"model": "heavy", ...}]`). Mirrors
    `router_utils/fallback_event_handlers.py` `get_fallback_model_group` (exact match, else `"*"`) and
    `_get_fallback_target_model_group` (a dict target's `model`)."""
    if not isinstance(fallbacks, list):
        return []
    exact: list[Any] | None = None
    generic: list[Any] | None = None
    flat: list[Any] = []
    for item in fallbacks:
        if isinstance(item, str):
            flat.append(item)
        elif isinstance(item, dict) and isinstance(item.get("model"), str):
            flat.append(item["model"])
        elif isinstance(item, dict) and len(item) == 1:
            key, targets = next(iter(item.items()))
            if key == group and exact is None:
                exact = targets if isinstance(targets, list) else []
            elif key == "*" and generic is None:
                generic = targets if isinstance(targets, list) else []
    targets = flat or exact or generic or []
    return _unique(t if isinstance(t, str) else t.get("model") if isinstance(t, dict) else None for t in targets)


def _configured_fallbacks(kwargs: Mapping[str, Any]) -> Any:
    """The fallbacks this request runs under: its own (the client's body, `fallbacks`), else the proxy router's.
    `Router.async_function_with_fallbacks` reads `kwargs.get("fallbacks", self.fallbacks)` and
    `async_function_with_retries` pops it, so a deployment call's kwargs no longer carry it; the client's body is in
    `proxy_server_request`, the router is `litellm/proxy/proxy_server.py`'s module global `llm_router`, read only
    where the proxy already imported it (never imported here)."""
    request = kwargs.get("proxy_server_request") or (kwargs.get("litellm_params") or {}).get("proxy_server_request")
    body = request.get("body") if isinstance(request, dict) else None
    if isinstance(body, dict) and body.get("fallbacks"):
        return body["fallbacks"]
    server = sys.modules.get("litellm.proxy.proxy_server")
    return getattr(getattr(server, "llm_router", None), "fallbacks", None)


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
        # Requests in flight, by call id: dropped when the request ends (success, the proxy's failure, a disconnect);
        # the oldest go beyond _REMEMBERED (one whose end never came to this callback).
        self._chains: OrderedDict[str, _Chain] = OrderedDict()

    async def async_pre_call_deployment_hook(self, kwargs: dict[str, Any], call_type: Any) -> dict[str, Any] | None:
        # Before every deployment call (utils.py `client`.wrapper_async): the chain's next attempt begins. Returns
        # None: the request goes on unchanged.
        self._guarded(self._begin, kwargs)
        return None

    async def async_post_call_failure_deployment_hook(self, request_data: Mapping[str, Any], exception: Exception,
                                                      call_type: Any, fallback_depth: int | None = None) -> None:
        # Once per failed deployment call, retries and fallback hops included (custom_logger.py): the only event that
        # says a retry or a hop past the first failure failed at all.
        self._guarded(self._record_failed_attempt, request_data, exception)

    async def async_log_success_event(self, kwargs: dict[str, Any], response_obj: Any, start_time: Any,
                                      end_time: Any) -> None:
        self._safely(kwargs, None)
        self._guarded(self._end, kwargs)

    async def async_log_failure_event(self, kwargs: dict[str, Any], response_obj: Any, start_time: Any,
                                      end_time: Any) -> None:
        # Once per request, for its first failure (litellm_logging.py, `has_logged_async_failure`): the attempt the
        # deployment hook recorded already is not recorded again; one that failed outside the deployment call (a
        # hook's error, a request refused before routing) is recorded here.
        self._safely(kwargs, kwargs.get("exception"))

    async def async_post_call_failure_hook(self, request_data: dict[str, Any], original_exception: Exception,
                                           user_api_key_dict: Any, traceback_str: str | None = None) -> None:
        # A client that went away is reported here with a 499 (the logging events may never come for it); every
        # other failure came to the deployment hook or async_log_failure_event, which recorded it. Either way the
        # request is over.
        if getattr(original_exception, "status_code", None) == 499:
            self._guarded(self._record_disconnect, request_data)
        elif str(request_data.get("litellm_call_id") or "") not in self._chains:
            # No deployment was called (its hook never ran): refused before routing, by a hook's exception, a
            # rate or parallel-request limiter, a budget. Only here is the request as the hooks left it.
            self._guarded(self._record_refusal, request_data, original_exception)
        self._guarded(self._end, request_data)

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
                self._guarded(self._end, request_data)

    def _chain(self, call_id: str) -> _Chain:
        chain = self._chains.get(call_id)
        if chain is None:
            chain = self._chains[call_id] = _Chain()
            if len(self._chains) > _REMEMBERED:
                self._chains.popitem(last=False)
        return chain

    def _begin(self, kwargs: Mapping[str, Any]) -> None:
        call_id = str(kwargs.get("litellm_call_id") or "")
        if not call_id or call_id in self._disconnected:
            return
        meta = _metadata(kwargs)
        chain = self._chain(call_id)
        # The attempt's place in the chain. LiteLLM 1.108.7 has no one field for it: `kwargs["fallback_depth"]` and
        # metadata `attempted_fallbacks` count fallback hops only (fallback_event_handlers.py run_async_fallback),
        # metadata `attempted_retries` is the retry's index within the current model group, back to 0 in the next
        # (router.py Router.async_function_with_retries), and metadata `request_retry_count` (router.py
        # Router.log_retry) is bumped for a group's last failed retry and again for the hop after it, so it runs
        # ahead (3 before a third attempt). So the deployment calls are counted here: one per
        # async_pre_call_deployment_hook of this litellm_call_id, which the router keeps for the whole chain. A hop
        # that reached no deployment (its group cooled down) is no attempt, and leaves no gap in the numbers.
        chain.attempts += 1
        chain.started = time.time()
        lane = str(meta.get("model_group") or "")
        original = str(meta.get("original_model_group") or lane)
        chain.candidates = _unique([*chain.candidates, original,
                                    *_fallback_groups(_configured_fallbacks(kwargs), original), lane])

    def _end(self, data: Mapping[str, Any]) -> None:
        self._chains.pop(str(data.get("litellm_call_id") or ""), None)

    def _claim(self, call_id: str) -> tuple[int, list[str]] | None:
        """The attempt now running for `call_id` and its candidates, or None where it was recorded already: the
        deployment hook and the request-level failure event both come for a request's first failure."""
        chain = self._chains.get(call_id) if call_id else None
        if chain is None:
            return 1, []
        attempt = max(chain.attempts, 1)
        if attempt in chain.recorded:
            return None
        chain.recorded.add(attempt)
        return attempt, list(chain.candidates)

    def _record_failed_attempt(self, data: Mapping[str, Any], exception: Exception) -> None:
        call_id = str(data.get("litellm_call_id") or "")
        if not call_id or call_id in self._disconnected:
            return  # without an id it cannot be told from the failure event's record, which records it
        claimed = self._claim(call_id)
        if claimed is None:
            return
        attempt, candidates = claimed
        chain = self._chains.get(call_id)
        meta = _metadata(data)
        text = _request_text(data)
        started = chain.started if chain is not None and chain.started else time.time()
        self.recorder.record(
            request_id=call_id, lane=str(meta.get("model_group") or data.get("model") or ""),
            backend=str(data.get("api_base") or meta.get("api_base") or ""), start_s=started, end_s=time.time(),
            attempt=attempt, candidates=candidates, status=_int(getattr(exception, "status_code", None)) or 500,
            error_type=type(exception).__name__, **_measured(meta, text),
            **_who(meta, data, (data.get("litellm_params") or {}).get("model") or data.get("model")))

    def _record_refusal(self, data: Mapping[str, Any], exception: Exception) -> None:
        """A request refused before any deployment was called: the size it had, the lane the hook chose
        (`stepline_lane` in metadata, else the model the hooks left it asking for), the refusal's status and
        reason, and no backend."""
        call_id = str(data.get("litellm_call_id") or "")
        if call_id in self._disconnected:
            return
        meta = _metadata(data)
        text = _request_text(data)
        now = time.time()
        self.recorder.record(
            request_id=call_id, lane=str(meta.get("stepline_lane") or data.get("model") or ""), backend="",
            start_s=now, end_s=now, attempt=1, candidates=[], status=_int(getattr(exception, "status_code", None))
            or 500, error_type=type(exception).__name__, **_measured(meta, text), **_who(meta, data, ""))

    def _record_disconnect(self, data: dict[str, Any]) -> None:
        call_id = str(data.get("litellm_call_id") or "")
        if call_id in self._disconnected:
            return
        self._remember(call_id)
        claimed = self._claim(call_id)
        if claimed is None:
            return  # this attempt's failure was recorded already
        attempt, candidates = claimed
        logging_obj = data.get("litellm_logging_obj")
        details = getattr(logging_obj, "model_call_details", None) or {}
        params = details.get("litellm_params") or data.get("litellm_params") or {}
        started = getattr(logging_obj, "start_time", None)
        start_s = started.timestamp() if isinstance(started, datetime) else time.time()
        meta = _metadata({"metadata": data.get("metadata"), "litellm_params": params})
        text = _request_text(data)
        self.recorder.record(
            request_id=call_id, lane=str(data.get("model") or ""), backend=str(params.get("api_base") or ""),
            start_s=start_s, end_s=time.time(), attempt=attempt, candidates=candidates, status=499,
            error_type="client_disconnected", client_disconnected=True, **_measured(meta, text),
            **_who(meta, data, params.get("model")))

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
        request_id = str(kwargs.get("litellm_call_id") or payload.get("id") or "")
        api_base = payload.get("api_base") or (kwargs.get("litellm_params") or {}).get("api_base")
        if exception is not None and not api_base and str(kwargs.get("litellm_call_id") or "") not in self._chains:
            return  # refused before any deployment: async_post_call_failure_hook records it, as the hooks left it
        claimed = self._claim(str(kwargs.get("litellm_call_id") or ""))
        if claimed is None:
            return  # the deployment hook recorded this attempt
        attempt, candidates = claimed
        meta = _metadata(kwargs)
        text = _prompt_text(kwargs.get("messages") if kwargs.get("messages") is not None else payload.get("messages"))
        error = payload.get("error_information") or {}
        disconnected = bool(meta.get("client_disconnected"))
        failed = payload.get("status") == "failure" or exception is not None
        code = _int(error.get("error_code")) if failed else 200
        started = float(payload.get("startTime") or time.time())
        first = payload.get("completionStartTime")
        lane = str(payload.get("model_group") or kwargs.get("model") or "")
        self.recorder.record(
            request_id=request_id, lane=lane, backend=str(api_base or ""),
            start_s=started, end_s=float(payload.get("endTime") or started), attempt=attempt,
            candidates=candidates or _unique([meta.get("original_model_group"), lane]),
            status=499 if disconnected else (code or (500 if failed else 200)),
            error_type=str(error.get("error_class") or (type(exception).__name__ if exception is not None else "")),
            client_disconnected=disconnected,
            first_byte_s=float(first) if first and not failed else None, **_measured(meta, text),
            **_who(meta, kwargs, payload.get("model") or (kwargs.get("litellm_params") or {}).get("model")))


proxy_handler = StepLineLogger()
"""The instance a proxy's config names (`callbacks: ["stepline.gateway.litellm.proxy_handler"]`)."""
