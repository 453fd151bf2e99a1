"""What an SGLang server says it can hold: its KV pool and context length, read over HTTP.

``/server_info`` (``/get_server_info`` before 0.5.10) carries ``max_total_num_tokens`` at its
top level. Its ``context_length`` is the ``--context-length`` flag as given, so it is null when
the server takes the model's own length; that length is ``max_model_len`` on ``/v1/models``
(seen on SGLang 0.5.23). Both endpoints need the API key when the server has one.
"""

from __future__ import annotations

import urllib.error
import urllib.request
from typing import Any, NamedTuple

import orjson

from tokenmill.url_secrets import redact_url, split_userinfo


class Capacity(NamedTuple):
    max_total_num_tokens: int | None
    context_length: int | None


def request(url: str, api_key: str | None = None) -> urllib.request.Request:
    """A GET of ``url``: bearer auth when ``api_key``, else basic auth when the URL has a
    ``user:password@`` (which urllib would take for part of the host name)."""
    bare, basic = split_userinfo(url)
    auth = f"Bearer {api_key}" if api_key else basic
    return urllib.request.Request(bare, headers={"Authorization": auth} if auth else {})


def get_bytes(url: str, api_key: str | None, timeout_s: float) -> bytes:
    """GET ``url``'s body (bearer auth when ``api_key``); raises OSError."""
    with urllib.request.urlopen(request(url, api_key), timeout=timeout_s) as resp:
        body: bytes = resp.read()
        return body


def get_json(url: str, api_key: str | None, timeout_s: float) -> dict[str, Any]:
    """GET ``url`` as a JSON object (bearer auth when ``api_key``); raises OSError or ValueError."""
    data = orjson.loads(get_bytes(url, api_key, timeout_s))
    if not isinstance(data, dict):
        raise ValueError(f"{redact_url(url)} did not answer a JSON object")
    return data


def server_info(base_url: str, api_key: str | None, timeout_s: float) -> dict[str, Any]:
    """``/server_info`` (0.5.10+), falling back to ``/get_server_info`` (0.5.5)."""
    try:
        return get_json(base_url + "/server_info", api_key, timeout_s)
    except urllib.error.HTTPError as exc:
        if exc.code != 404:
            raise
    return get_json(base_url + "/get_server_info", api_key, timeout_s)


def fetch(base_url: str, api_key: str | None, timeout_s: float) -> Capacity:
    """The server's capacity: the pool size ``/server_info`` states, and its context length when
    configured, else ``max_model_len`` of the first model card on ``/v1/models`` (the context in
    force); raises OSError or ValueError when ``/server_info`` fails."""
    info = server_info(base_url, api_key, timeout_s)
    total = info.get("max_total_num_tokens")
    states = info.get("internal_states") or []
    if total is None and states and isinstance(states[0], dict):
        total = (states[0].get("memory_usage") or {}).get("token_capacity")
    context = _int(info.get("context_length"))
    if context is None:
        try:
            cards = get_json(base_url + "/v1/models", api_key, timeout_s).get("data") or []
            context = _int(cards[0].get("max_model_len")) if cards and isinstance(cards[0], dict) else None
        except (OSError, ValueError):
            pass  # the pool size is what admission needs; the context length is informative
    return Capacity(_int(total), context)


def _int(value: Any) -> int | None:
    try:
        return None if value is None else int(value)
    except (TypeError, ValueError):
        return None
