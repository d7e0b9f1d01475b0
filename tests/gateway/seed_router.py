"""A home-made size router for LiteLLM, with the three bugs of the incident stepline was built for.

Loaded by the LiteLLM proxy from its config directory (`callbacks: ["seed_router.hook"]`, the file copied there by
tests/gateway/proxy.py); never imported by stepline or its tests' own process. It is written the way such routers
are: for the chat API, in characters, with its slots counted in the proxy's memory.
1. **A bar in characters set from a token estimate**: BAR_CHARS, from the operator's bar in tokens at an estimated
   characters per token. A prompt that runs more tokens per character than the estimate (dense JSON, code) measures
   under the bar and goes to the fast lane however many tokens the engine counts.
2. **A catch-all that fails open**: the router reads `data["messages"]`; a request of the legacy completions API has
   a `prompt` instead, the read raises KeyError('messages'), and the router lets it go on to the lane the client
   asked for (fast), whatever its size.
3. **Slots released on success or failure, never on a client's disconnect**: the heavy lane holds HEAVY_SLOTS
   requests; a slot is taken before the call and given back by the proxy's post-call hooks: on success, at the end of
   a stream, on failure. A streaming client that leaves has its stream closed mid-way (LiteLLM 1.108.7,
   `proxy/common_request_processing.py` `async_streaming_data_generator`: "the nested iterator hook ... only sees
   GeneratorExit"), so the release written after the stream's loop never runs. (LiteLLM's own limiter is released
   on that path; a router's own count is not.) Once they are all held, the lane refuses everything (429) while its
   engine idles.

SEED_ROUTER_ANNOTATE=1 makes it say what it measured and against what (the `stepline_*` keys of `metadata`, as
docs/gateway.md asks); with 0 it is the same router saying nothing, as most are.
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from typing import Any

from fastapi import HTTPException  # type: ignore[import-not-found]
from litellm.integrations.custom_logger import CustomLogger  # type: ignore[import-not-found]

BAR_CHARS = int(os.environ.get("SEED_ROUTER_BAR_CHARS", "8000"))
HEAVY_SLOTS = int(os.environ.get("SEED_ROUTER_HEAVY_SLOTS", "2"))
ANNOTATE = os.environ.get("SEED_ROUTER_ANNOTATE", "1") == "1"


class SeedRouter(CustomLogger):  # type: ignore[misc]
    def __init__(self) -> None:
        super().__init__()
        self.holding: set[str] = set()  # the proxy's call ids that hold a heavy slot

    async def async_pre_call_hook(self, user_api_key_dict: Any, cache: Any, data: dict[str, Any],
                                  call_type: Any) -> dict[str, Any]:
        metadata = data.setdefault("metadata", {})
        try:
            chars = sum(len(m["content"]) for m in data["messages"])
        except Exception as exc:  # bug 2: whatever went wrong, the request goes on as it came
            if ANNOTATE:
                metadata["stepline_swallowed"] = f"{type(exc).__name__}: {exc}"
            return data
        lane = "heavy" if chars >= BAR_CHARS else "fast"  # bug 1: characters, not the engine's tokens
        data["model"] = lane
        if ANNOTATE:
            metadata.update({"stepline_size_chars": chars, "stepline_threshold": BAR_CHARS,
                             "stepline_threshold_unit": "chars", "stepline_lane": lane})
        if lane == "heavy":
            if len(self.holding) >= HEAVY_SLOTS:
                raise HTTPException(status_code=429, detail=f"lane heavy is full ({len(self.holding)} in flight)")
            self.holding.add(str(data.get("litellm_call_id")))
        return data

    # Bug 3: the slot comes back when the response is done, a stream's at its end, or when the call failed; a stream
    # the client leaves is closed where it stands (GeneratorExit at the `yield`), and the line after the loop, with
    # no `finally` around it, never runs.
    async def async_post_call_success_hook(self, data: dict[str, Any], user_api_key_dict: Any, response: Any) -> Any:
        self.holding.discard(str(data.get("litellm_call_id")))

    async def async_post_call_failure_hook(self, request_data: dict[str, Any], original_exception: Exception,
                                           user_api_key_dict: Any, traceback_str: str | None = None) -> None:
        self.holding.discard(str(request_data.get("litellm_call_id")))

    async def async_post_call_streaming_iterator_hook(self, user_api_key_dict: Any, response: Any,
                                                      request_data: dict[str, Any]) -> AsyncIterator[Any]:
        async for item in response:
            yield item
        self.holding.discard(str(request_data.get("litellm_call_id")))


hook = SeedRouter()
