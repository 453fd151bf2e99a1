"""Deterministic output of the sim: what a request generates, computable by tests byte for byte.

Pure functions, no I/O. The output of a chat request is a sequence of tokens derived from a hash
of (messages, seed, temperature, top_p, sim_seed); with ``temperature == 0`` (greedy) the seed and
top_p are left out of the hash, as greedy decoding ignores them. Neither ``max_tokens`` nor the
model name enters the hash: ``max_tokens`` only truncates the natural output.

Every token carries its leading space (``" word"``), so a text splits back into tokens without
ambiguity; the vocabulary mixes ASCII with accents, CJK and emoji so that unicode paths are
exercised. With a reasoning parser, the first ``R`` tokens are reasoning text, the rest content.

A *continuation* (``continue_final_message`` with a final assistant message) continues the
uninterrupted output of the messages before it: ``partial + continuation == full`` byte for byte.
"""

from __future__ import annotations

import hashlib
import math
import struct
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import orjson

Message = Mapping[str, Any]
FinishReason = Literal["stop", "length"]

_WORDS = (
    "the of and to in is that for it as was with be by on not he this are or his from at which "
    "but have an they you were her she there one all we their been has when who will more no if "
    "out so said what up its about into than them can only other new some time could these two "
    "may then do first any my now such like our over man me even most made after also did many "
    "before must through back years where much your way well down should because each just "
    "those people how too little state good very make world still own see men work long get "
    "here between both life being under never day same another know while last might us great "
    "old year off come since against go came right used take three model token cache queue "
    "server stream batch prompt ledger worker lease retry shard GPU kernel tensor layer vector "
    "café naïve résumé über Größe façade señor jalapeño smörgåsbord é ß Ω π λ ∑ → "
    "日本 東京 中文 漢字 한국어 русский ελληνικά العربية עברית हिन्दी "
    '🙂 🚀 ✨ 🎉 🧪 👍🏽 ☕ 🌍 ok. yes, no; (see) [note] {x} "quote" it\'s 42 3.14 100% #tag @user'
).split()
VOCAB: tuple[str, ...] = tuple(" " + w for w in dict.fromkeys(_WORDS))
EOS_TOKEN_ID = 151645  # matched_stop of a natural stop (Qwen's <|im_end|>)
# Tokens the chat template adds around each message and for the generation prompt.
TOKENS_PER_MESSAGE = 4
TOKENS_FOR_REPLY = 3


class ContinuationError(ValueError):
    """The final assistant message is not a token prefix of what the sim would generate."""


@dataclass(frozen=True, slots=True)
class Completion:
    """What one request generates (for a continuation: only the new tokens)."""

    reasoning_content: str | None
    content: str
    finish_reason: FinishReason
    completion_tokens: int
    tokens: list[str]
    reasoning_tokens: int = 0  # how many leading entries of ``tokens`` are reasoning
    prompt_tokens: int = 0


def message_text(content: Any) -> str:
    """The text of a message's ``content``: a string, or the text parts of a parts list."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(str(p.get("text", "")) for p in content if isinstance(p, Mapping) and "text" in p)
    return str(content)


def count_prompt_tokens(messages: Sequence[Message]) -> int:
    """A deterministic tokenizer estimate: utf-8 bytes / 4 per message plus template overhead."""
    total = TOKENS_FOR_REPLY
    for m in messages:
        size = len(message_text(m.get("content")).encode())
        total += TOKENS_PER_MESSAGE + (size + 3) // 4
    return total


def generation_budget(prompt_tokens: int, *, context_length: int, max_total_tokens: int | None = None) -> int:
    """Most tokens a request may generate: SGLang's silent scheduler clamp (§4.2)."""
    max_req_len = context_length - 1
    if max_total_tokens is not None:
        max_req_len = min(max_req_len, max_total_tokens - 1)
    return max(0, max_req_len - prompt_tokens - 1)


def _hash_key(
    messages: Sequence[Message],
    seed: int | None,
    temperature: float | None,
    top_p: float | None,
    sim_seed: int,
) -> bytes:
    norm = [[str(m.get("role")), message_text(m.get("content"))] for m in messages]
    temp = None if temperature is None else float(temperature)
    if temp == 0.0:
        # greedy decoding does not depend on the sampling seed or top_p
        seed, top_p = None, None
    tp = None if top_p is None else float(top_p)
    payload = orjson.dumps([norm, seed, temp, tp, int(sim_seed)])
    return hashlib.blake2b(payload, digest_size=32).digest()


def _words(key: bytes, label: bytes) -> Iterator[int]:
    """An endless stream of uint32 values drawn from ``key`` (portable across Pythons)."""
    block = 0
    while True:
        digest = hashlib.blake2b(key + label + block.to_bytes(8, "little")).digest()
        yield from struct.unpack("<16I", digest)
        block += 1


def _shape(key: bytes, mean_output_tokens: int) -> tuple[int, float]:
    """(natural length L, reasoning fraction) of the output for ``key``."""
    u_len, u_reason = (next(w) / 2**32 for w in (_words(key, b"len"), _words(key, b"reason")))
    length = max(1, round(mean_output_tokens * (0.25 + 1.5 * u_len)))
    return length, 0.2 + 0.5 * u_reason


def _reasoning_split(length: int, fraction: float) -> int:
    """How many leading tokens of an output of ``length`` are reasoning (leaves >= 1 content)."""
    if length < 2:
        return 0
    return min(length - 1, max(1, math.floor(length * fraction)))


def _tokens(key: bytes, n: int, perturb: float) -> list[str]:
    vocab_size = len(VOCAB)
    picks = _words(key, b"tok")
    ids = [next(picks) % vocab_size for _ in range(n)]
    if perturb > 0.0:
        # separate streams decide which tokens to swap and for what, so that a perturbed output
        # keeps its length and differs from the clean one exactly at the swapped positions
        flips, shifts = _words(key, b"perturb"), _words(key, b"shift")
        for i in range(n):
            if next(flips) / 2**32 < perturb:
                ids[i] = (ids[i] + 1 + next(shifts) % (vocab_size - 1)) % vocab_size
    return [VOCAB[i] for i in ids]


def _assemble(
    tokens: list[str], start: int, split: int, reasoning: bool, finish: FinishReason, prompt: int
) -> Completion:
    """A Completion for ``tokens``, the slice of the full output that begins at index ``start``."""
    n_reason = max(0, min(len(tokens), split - start)) if reasoning else 0
    reasoning_text = "".join(tokens[:n_reason])
    return Completion(
        reasoning_content=reasoning_text or None,
        content="".join(tokens[n_reason:]),
        finish_reason=finish,
        completion_tokens=len(tokens),
        tokens=tokens,
        reasoning_tokens=n_reason,
        prompt_tokens=prompt,
    )


def expected_completion(
    messages: Sequence[Message],
    *,
    seed: int | None = None,
    temperature: float | None = None,
    top_p: float | None = None,
    max_tokens: int | None = None,
    reasoning: bool = False,
    mean_output_tokens: int = 200,
    perturb: float = 0.0,
    sim_seed: int = 0,
    context_length: int = 32768,
    max_total_tokens: int | None = None,
) -> Completion:
    """What the sim generates for ``messages`` (no continuation).

    ``max_tokens`` is the request's effective limit (``max_completion_tokens or max_tokens``);
    None or 0 means unlimited, as in SGLang. Without it, output stops at its natural length or
    at the context edge (finish ``length``).
    """
    key = _hash_key(messages, seed, temperature, top_p, sim_seed)
    length, fraction = _shape(key, mean_output_tokens)
    prompt = count_prompt_tokens(messages)
    limit = generation_budget(prompt, context_length=context_length, max_total_tokens=max_total_tokens)
    if max_tokens:
        limit = min(limit, max_tokens)
    n = min(length, limit)
    finish: FinishReason = "length" if n < length else "stop"
    split = _reasoning_split(length, fraction)
    return _assemble(_tokens(key, n, perturb), 0, split, reasoning, finish, prompt)


def split_partial(messages: Sequence[Message]) -> tuple[list[Message], Message]:
    """(messages before the final assistant message, that message). ValueError if none."""
    if not messages or messages[-1].get("role") != "assistant":
        raise ContinuationError(
            "continue_final_message requires the last message to be an assistant message."
        )
    return list(messages[:-1]), messages[-1]


def _prefix_length(tokens: list[str], text: str) -> int | None:
    """k such that ``"".join(tokens[:k]) == text``, or None when ``text`` is no token prefix."""
    pos = 0
    for k, tok in enumerate(tokens):
        if pos == len(text):
            return k
        if not text.startswith(tok, pos):
            return None
        pos += len(tok)
    return len(tokens) if pos == len(text) else None


def expected_continuation(
    messages: Sequence[Message],
    *,
    max_tokens: int | None = None,
    reasoning: bool = False,
    **params: Any,
) -> Completion:
    """The new tokens of a ``continue_final_message`` request (``messages`` ends with the partial).

    The partial (its ``reasoning_content`` then ``content``) must be a token prefix of the
    uninterrupted output of the earlier messages, else :class:`ContinuationError`. ``max_tokens``
    limits the new tokens only; ``prompt_tokens`` counts the partial's tokens as input.
    ``params`` are those of :func:`expected_completion`.
    """
    base, partial = split_partial(messages)
    full = expected_completion(base, reasoning=reasoning, **params)
    p_reason = message_text(partial.get("reasoning_content"))
    p_content = message_text(partial.get("content"))
    k = _prefix_length(full.tokens, p_reason + p_content)
    if k is None:
        raise ContinuationError(
            "The final assistant message is not a prefix of this model's output for these "
            "messages and sampling parameters; it cannot be continued."
        )
    if reasoning and _prefix_length(full.tokens, p_reason) != min(k, full.reasoning_tokens):
        raise ContinuationError(
            "The final assistant message splits reasoning_content and content at another place "
            "than this model's output; it cannot be continued."
        )
    end = len(full.tokens) if not max_tokens else min(len(full.tokens), k + max_tokens)
    finish: FinishReason = "length" if end < len(full.tokens) else full.finish_reason
    split = full.reasoning_tokens if reasoning else 0
    return _assemble(full.tokens[k:end], k, split, reasoning, finish, full.prompt_tokens + k)


def resolve(
    messages: Sequence[Message], *, continue_final_message: bool = False, **params: Any
) -> Completion:
    """The completion a request gets: a continuation when asked for, else the full output."""
    if continue_final_message and messages and messages[-1].get("role") == "assistant":
        return expected_continuation(messages, **params)
    return expected_completion(messages, **params)


def full_output(messages: Sequence[Message], **params: Any) -> tuple[str | None, str]:
    """(reasoning_content, content) of partial + continuation, for a continuation request.

    Equals the uninterrupted output's when ``max_tokens`` did not cut the continuation short.
    """
    _, partial = split_partial(messages)
    new = expected_continuation(messages, **params)
    reasoning = message_text(partial.get("reasoning_content")) + (new.reasoning_content or "")
    content = message_text(partial.get("content")) + new.content
    return reasoning or None, content
