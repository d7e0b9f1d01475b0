"""A LiteLLM custom auth for the gateway tests: two virtual keys of two teams, named as a proxy with a key database
names them (`user_api_key_alias`, `user_api_key_team_id`, `user_api_key_team_alias`, `user_api_key_user_id` in each
request's metadata: proxy/litellm_pre_call_utils.py `get_sanitized_user_information_from_key`, 1.108.7).

LiteLLM's own virtual keys live in a Postgres database (`/key/generate`); a custom auth
(`general_settings: custom_auth: team_auth.user_api_key_auth`, proxy/auth/user_api_key_auth.py) returns the same
`UserAPIKeyAuth` fields without one. Loaded by the proxy from its config directory (tests/gateway/proxy.py copies
it there); never imported by stepline or its tests' own process.
"""

from __future__ import annotations

from typing import Any

# key -> (its alias, its team's id, its team's alias, its user)
KEYS = {"sk-alpha-1": ("alpha-key", "team-a1", "alpha", "ann"), "sk-beta-1": ("beta-key", "team-b1", "beta", "bo")}


async def user_api_key_auth(request: Any, api_key: str) -> Any:
    # Imported here: the tests read KEYS in their own process, which has no LiteLLM.
    from litellm.proxy._types import UserAPIKeyAuth  # type: ignore[import-not-found]

    key = api_key.removeprefix("Bearer ").strip()
    if key not in KEYS:
        raise ValueError("unknown key")
    alias, team_id, team_alias, user = KEYS[key]
    return UserAPIKeyAuth(api_key=key, key_alias=alias, team_id=team_id, team_alias=team_alias, user_id=user)
