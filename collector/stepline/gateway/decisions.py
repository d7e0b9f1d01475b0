"""The decision record: one OTLP span per routing attempt, named attributes, and the row it becomes.

A gateway (LiteLLM, vllm-router, a home-made router) reports each attempt as a span named DECISION_SPAN, sent to
the collector's OTLP/HTTP receiver like vLLM's own spans. The span's start is when the gateway decided, its end when
the attempt ended; the attributes below say what it measured and chose. Names follow OpenTelemetry's semantic
conventions where one exists (http.response.status_code, error.type); the rest are stepline's own. Every
attribute is optional: a decision with no measured size is itself the evidence of a hook that failed open.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from typing import Any

from stepline.config.settings import url_host_port
from stepline.model.rows import GatewayDecision

DECISION_SPAN = "stepline.gateway.decision"
GATEWAY = "stepline.gateway.name"  # else the resource's service.name
REQUEST_ID = "stepline.gateway.request_id"
ATTEMPT = "stepline.gateway.attempt"
LANE = "stepline.gateway.lane"
BACKEND = "stepline.gateway.backend"  # a URL (http://10.0.0.5:8000/v1) or a name
CANDIDATES = "stepline.gateway.candidates"
SIZE_CHARS = "stepline.gateway.size.chars"
SIZE_BYTES = "stepline.gateway.size.bytes"
SIZE_TOKENS = "stepline.gateway.size.tokens"
THRESHOLD = "stepline.gateway.threshold"
THRESHOLD_UNIT = "stepline.gateway.threshold.unit"
HEALTH = "stepline.gateway.health"
IN_FLIGHT = "stepline.gateway.in_flight"  # the backend's slots the gateway holds, this request's included
STATUS = "http.response.status_code"
ERROR_TYPE = "error.type"
CLIENT_DISCONNECTED = "stepline.gateway.client_disconnected"
FIRST_BYTE = "stepline.gateway.first_byte_unix_nano"
SWALLOWED = "stepline.gateway.swallowed_exception"
# Who sent the request, where the gateway knows (all optional; never a key itself): the model the backend was asked
# for (a LoRA adapter's name where the request named one), the API key's alias, its team, its user, and the end user
# the client named (OpenAI's `user` field).
MODEL = "stepline.gateway.model"
KEY = "stepline.gateway.key"
TEAM = "stepline.gateway.team"
USER = "stepline.gateway.user"
END_USER = "stepline.gateway.end_user"
UNITS = ("chars", "bytes", "tokens")
DEFAULT_GATEWAY = "gateway"
_MAX_SIZE = (1 << 63) - 1
_MAX_TEXT = 2000  # a swallowed exception's text is kept to this many characters
# An id or name (request id, engine, gateway, model, lane) kept in a column is at most this many UTF-8 bytes. Real ones
# are tens of bytes (a vLLM request id about 45, a model path about 150); a longer one is a bug or an attack, and
# cutting it could merge two identities, so the span carrying it is refused, never truncated.
MAX_NAME_BYTES = 1024
_DIGITS = re.compile(r"[0-9]+")  # ASCII only: str.isdigit() also takes "²", which int() refuses


class DecisionRejected(ValueError):
    """One decision span cannot become a row; the message names the attribute and why."""


def backend_engine(backend: str) -> str:
    """A backend as stepline names engines: a URL's host:port (the default name of --engine URL,
    config.settings.url_host_port), else as given."""
    text = backend.strip()
    if "://" not in text:
        return text
    try:
        hostname, port = url_host_port(text)
    except ValueError:
        return text
    return f"{hostname}:{port}"


def to_decision(attrs: Mapping[str, Any], start_ns: int, end_ns: int, gateway: str, host: str) -> GatewayDecision:
    """The row for one decision span; attrs are plain values (str, int, float, bool, lists of them)."""
    request_id = _text(attrs, REQUEST_ID)
    where = f"decision {request_id[:64]!r}" if request_id else "decision"
    _check_name(request_id, REQUEST_ID, where)
    unit = _text(attrs, THRESHOLD_UNIT).lower()
    if unit not in ("", *UNITS):
        raise DecisionRejected(f"{where}: {THRESHOLD_UNIT} is {unit[:32]!r}, not one of {', '.join(UNITS)}")
    threshold = _number(attrs, THRESHOLD, where)
    if threshold is not None and not (math.isfinite(threshold) and threshold >= 0):
        raise DecisionRejected(f"{where}: {THRESHOLD} is {threshold}, not a finite non-negative number")
    first_byte = _whole(attrs, FIRST_BYTE, where, _MAX_SIZE)
    candidates = attrs.get(CANDIDATES, [])
    if not isinstance(candidates, list | tuple) or not all(isinstance(c, str) for c in candidates):
        raise DecisionRejected(f"{where}: {CANDIDATES} is not an array of strings")
    for candidate in candidates:
        _check_name(candidate, CANDIDATES, where)
    return GatewayDecision(
        ts=_micros(start_ns), host=host, engine=backend_engine(_name(attrs, BACKEND, where)),
        gateway=_name(attrs, GATEWAY, where) or _check_name(gateway, "the resource's gateway name", where),
        request_id=request_id, attempt=_whole(attrs, ATTEMPT, where, 65535) or 1, lane=_name(attrs, LANE, where),
        candidates=[backend_engine(c) for c in candidates],
        size_chars=_whole(attrs, SIZE_CHARS, where, _MAX_SIZE), size_bytes=_whole(attrs, SIZE_BYTES, where, _MAX_SIZE),
        size_tokens=_whole(attrs, SIZE_TOKENS, where, _MAX_SIZE), threshold=threshold,
        threshold_unit=unit, health=_name(attrs, HEALTH, where),
        in_flight=_whole(attrs, IN_FLIGHT, where, (1 << 32) - 1),
        status=_whole(attrs, STATUS, where, 999) or 0, error_type=_name(attrs, ERROR_TYPE, where),
        client_disconnected=_flag(attrs, CLIENT_DISCONNECTED, where),
        first_byte_ts=None if first_byte is None else _micros(first_byte), end_ts=_micros(end_ns),
        swallowed_exception=_text(attrs, SWALLOWED)[:_MAX_TEXT], model=_name(attrs, MODEL, where),
        key=_name(attrs, KEY, where), team=_name(attrs, TEAM, where), user=_name(attrs, USER, where),
        end_user=_name(attrs, END_USER, where))


def text_cut(attrs: Mapping[str, Any]) -> bool:
    """Whether to_decision keeps less of the span's free text (its swallowed exception) than the span holds."""
    return len(_text(attrs, SWALLOWED)) > _MAX_TEXT


def _check_name(text: str, what: str, where: str) -> str:
    """The id or name as given; DecisionRejected when it is over MAX_NAME_BYTES."""
    # Characters first: a long resource name is checked once per span, and len() does not read it.
    if len(text) > MAX_NAME_BYTES or len(text.encode("utf-8", "surrogatepass")) > MAX_NAME_BYTES:
        raise DecisionRejected(f"{where}: {what} is over the {MAX_NAME_BYTES}-byte limit for ids and names "
                               f"({len(text)} characters)")
    return text


def _micros(nanos: int) -> int:
    return (nanos + 500) // 1000


def _text(attrs: Mapping[str, Any], key: str) -> str:
    value = attrs.get(key)
    if isinstance(value, bool) or value is None:
        return ""
    return str(value).strip() if isinstance(value, str | int) else ""


def _name(attrs: Mapping[str, Any], key: str, where: str) -> str:
    return _check_name(_text(attrs, key), key, where)


def _number(attrs: Mapping[str, Any], key: str, where: str) -> float | None:
    value = attrs.get(key)
    if value is None:
        return None
    if isinstance(value, str):
        try:
            return float(value.strip())
        except ValueError:
            raise DecisionRejected(f"{where}: {key} is {value[:32]!r}, not a number") from None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise DecisionRejected(f"{where}: {key} is a {type(value).__name__}, not a number")
    return float(value)


def _whole(attrs: Mapping[str, Any], key: str, where: str, most: int) -> int | None:
    value = attrs.get(key)
    if value is None:
        return None
    text = value.strip() if isinstance(value, str) else ""
    if _DIGITS.fullmatch(text) and len(text.lstrip("0")) <= 19:  # no bound needs more; int() refuses 4301
        value = int(text)
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= most:
        raise DecisionRejected(f"{where}: {key} is {str(value)[:32]!r}, not a whole number in 0-{most}")
    return value


def _flag(attrs: Mapping[str, Any], key: str, where: str) -> bool:
    value = attrs.get(key, False)
    if not isinstance(value, bool):
        raise DecisionRejected(f"{where}: {key} is {str(value)[:32]!r}, not a boolean")
    return value
