"""A fast, deterministic prompt-token estimate, shared by routing and admission.

UTF-8 bytes / 4 rounded up, plus 4 per message. Only an estimate: the server's tokenizer has
the final word.
"""

from __future__ import annotations

from typing import Any

BYTES_PER_TOKEN = 4
TOKENS_PER_MESSAGE = 4


def estimate_prompt_tokens(messages: list[dict[str, Any]]) -> int:
    """The estimate for a chat list (run once per row by the producer, hence the plain loop)."""
    total = 0
    for m in messages:
        content = m.get("content")
        if type(content) is str:
            total += len(content) if content.isascii() else len(content.encode("utf-8"))
        else:
            total += _content_bytes(content)
    return -(-total // BYTES_PER_TOKEN) + TOKENS_PER_MESSAGE * len(messages)


def _content_bytes(content: Any) -> int:
    if isinstance(content, str):
        return len(content) if content.isascii() else len(content.encode("utf-8"))
    if isinstance(content, list):
        return sum(_content_bytes(p.get("text")) for p in content if isinstance(p, dict))
    return 0
