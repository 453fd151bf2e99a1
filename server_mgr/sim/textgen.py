"""Deterministic output of the sim: what a request generates, computable by tests byte for byte.

Pure functions, no I/O. The output of a chat request is a sequence of tokens derived from a hash
of (messages, seed, temperature, top_p, sim_seed); with ``temperature == 0`` (greedy) the seed and
top_p are left out of the hash, as greedy decoding ignores them. Neither ``max_tokens`` nor the
model name enters the hash: ``max_tokens`` only truncates the natural output.

Every token carries its leading space (``" word"``), so a text splits back into tokens without
ambiguity; the vocabulary mixes ASCII with accents, CJK and emoji so that unicode paths are
exercised. With a reasoning parser, the first ``R`` tokens are reasoning text, the rest content.

A *continuation* (``continue_final_message`` with a final assistant message) continues the
uninterrupted output of the messages before it: ``partial + continuation == full`` byte for byte
when the partial is a prefix of that output (cut anywhere, even inside a token); any other
partial is continued too, as SGLang continues whatever it is given.
"""

from __future__ import annotations

import hashlib
import math
import struct
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
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
THINK_END = "</think>"  # ends the reasoning in a continued partial
EOS_TOKEN_ID = 151645  # matched_stop of a natural stop (Qwen's <|im_end|>)
VOCAB_ID_BASE = 1000  # the id of VOCAB[i] is VOCAB_ID_BASE + i
UNBOUNDED = 2**31  # the natural length of an output that ignores EOS
# Tokens the chat template adds around each message and for the generation prompt.
TOKENS_PER_MESSAGE = 4
TOKENS_FOR_REPLY = 3


class ContinuationError(ValueError):
    """A ``continue_final_message`` request without a final assistant message."""


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
    key: bytes = b""  # the hash the uninterrupted output is drawn from (log-probabilities use it)
    start: int = 0  # index of ``tokens[0]`` in that output


@dataclass(frozen=True, slots=True)
class Steering:
    """How request options bend the token choice, by vocabulary index: a large positive
    ``logit_bias`` forces a token everywhere, a large negative one bans it, ``stop_token_ids``
    are banned before ``min_tokens`` (SGLang's min-new-tokens penalty), and ``ignore_eos`` or
    ``min_tokens`` move the natural end."""

    forced: int | None = None
    banned: frozenset[int] = frozenset()
    banned_early: frozenset[int] = frozenset()
    min_tokens: int = 0
    ignore_eos: bool = False


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
    salt: Sequence[Any] = (),
) -> bytes:
    norm = [[str(m.get("role")), message_text(m.get("content"))] for m in messages]
    temp = None if temperature is None else float(temperature)
    if temp == 0.0:
        # greedy decoding does not depend on the sampling seed or top_p
        seed, top_p = None, None
    tp = None if top_p is None else float(top_p)
    fields: list[Any] = [norm, seed, temp, tp, int(sim_seed)]
    if salt:  # options that change the output (penalties); absent, keys are as they always were
        fields.append(list(salt))
    payload = orjson.dumps(fields)
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


def _tokens(key: bytes, n: int, perturb: float, steering: Steering | None = None) -> list[str]:
    vocab_size = len(VOCAB)
    picks = _words(key, b"tok")
    ids = [next(picks) % vocab_size for _ in range(n)]
    if steering is not None:
        ids = [_steer(i, pos, steering) for pos, i in enumerate(ids)]
    if perturb > 0.0:
        # separate streams decide which tokens to swap and for what, so that a perturbed output
        # keeps its length and differs from the clean one exactly at the swapped positions
        flips, shifts = _words(key, b"perturb"), _words(key, b"shift")
        for i in range(n):
            if next(flips) / 2**32 < perturb:
                ids[i] = (ids[i] + 1 + next(shifts) % (vocab_size - 1)) % vocab_size
    return [VOCAB[i] for i in ids]


def _steer(index: int, position: int, steering: Steering) -> int:
    if steering.forced is not None:
        return steering.forced
    banned = steering.banned | (steering.banned_early if position < steering.min_tokens else frozenset())
    for _ in range(len(VOCAB)):
        if index not in banned:
            return index
        index = (index + 1) % len(VOCAB)
    return index


def _assemble(
    tokens: list[str],
    start: int,
    split: int,
    reasoning: bool,
    finish: FinishReason,
    prompt: int,
    key: bytes = b"",
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
        key=key,
        start=start,
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
    steering: Steering | None = None,
    salt: Sequence[Any] = (),
) -> Completion:
    """What the sim generates for ``messages`` (no continuation).

    ``max_tokens`` is the request's effective limit (``max_completion_tokens or max_tokens``);
    None or 0 means unlimited, as in SGLang. Without it, output stops at its natural length or
    at the context edge (finish ``length``). ``steering`` and ``salt`` carry the request options
    that change the tokens (see :class:`Steering`; ``salt``: the penalties' values).
    """
    key = _hash_key(messages, seed, temperature, top_p, sim_seed, salt)
    natural, fraction = _shape(key, mean_output_tokens)
    length = natural
    if steering is not None:
        length = UNBOUNDED if steering.ignore_eos else max(natural, steering.min_tokens)
    prompt = count_prompt_tokens(messages)
    limit = generation_budget(prompt, context_length=context_length, max_total_tokens=max_total_tokens)
    if max_tokens:
        limit = min(limit, max_tokens)
    n = min(length, limit)
    finish: FinishReason = "length" if n < length else "stop"
    split = _reasoning_split(natural, fraction)
    return _assemble(_tokens(key, n, perturb, steering), 0, split, reasoning, finish, prompt, key)


def split_partial(messages: Sequence[Message]) -> tuple[list[Message], Message]:
    """(messages before the final assistant message, that message). ValueError if none."""
    if not messages or messages[-1].get("role") != "assistant":
        raise ContinuationError(
            "continue_final_message requires the last message to be an assistant message."
        )
    return list(messages[:-1]), messages[-1]


def _cut(tokens: list[str], text: str) -> tuple[int, str] | None:
    """Where ``text`` ends inside ``"".join(tokens)``: ``(k, rest)`` when it is ``tokens[:k]``
    followed by a proper start of ``tokens[k]`` (``rest`` is what is left of that token, empty
    when the cut falls between tokens); None when ``text`` is not a prefix of the output."""
    pos = 0
    for k, tok in enumerate(tokens):
        if pos == len(text):
            return k, ""
        if text.startswith(tok, pos):
            pos += len(tok)
            continue
        tail = text[pos:]
        return (k, tok[len(tail) :]) if tok.startswith(tail) else None
    return (len(tokens), "") if pos == len(text) else None


def partial_text(partial: Message, reasoning: bool) -> tuple[str, str]:
    """(reasoning, content) of a final assistant message to continue, read as SGLang 0.5.23 reads
    it: only its ``content`` counts (``reasoning_content`` is dropped), and with a reasoning
    parser that text is reasoning up to the first ``</think>``, content after it."""
    raw = message_text(partial.get("content"))
    if not reasoning:
        return "", raw
    reason, _, content = raw.partition(THINK_END)
    return reason, content


def expected_continuation(
    messages: Sequence[Message],
    *,
    max_tokens: int | None = None,
    reasoning: bool = False,
    **params: Any,
) -> Completion:
    """The new tokens of a ``continue_final_message`` request (``messages`` ends with the partial).

    As SGLang does, any final assistant message is continued. When the partial (read by
    :func:`partial_text`) is a prefix of the uninterrupted output of the
    earlier messages, the continuation is the rest of that output (a token the partial cut in two
    is finished as one token), so ``partial + continuation == full`` byte for byte. Any other
    partial gets an output of its own, drawn from all the messages. ``max_tokens`` limits the new
    tokens only; ``prompt_tokens`` counts the partial as input. ``params`` are those of
    :func:`expected_completion`.
    """
    base, partial = split_partial(messages)
    full = expected_completion(base, reasoning=reasoning, **params)
    p_reason, p_content = partial_text(partial, reasoning)
    cut = _cut(full.tokens, p_reason + p_content)
    if cut is None:
        return _foreign_continuation(messages, max_tokens=max_tokens, reasoning=reasoning, **params)
    k, rest = cut
    tokens = ([rest] if rest else []) + full.tokens[k + bool(rest) :]
    first = k  # index in the full output of the first new token
    end = len(tokens) if not max_tokens else min(len(tokens), max_tokens)
    finish: FinishReason = "length" if end < len(tokens) else full.finish_reason
    split = full.reasoning_tokens if reasoning else 0
    return _assemble(tokens[:end], first, split, reasoning, finish, full.prompt_tokens + k, full.key)


def _foreign_continuation(
    messages: Sequence[Message], *, max_tokens: int | None, reasoning: bool, **params: Any
) -> Completion:
    """A partial this model would not have produced: continued with an output of its own."""
    base, partial = split_partial(messages)
    as_input = [*base, {"role": "assistant", "content": message_text(partial.get("content"))}]
    fresh = expected_completion(as_input, max_tokens=max_tokens, reasoning=False, **params)
    return replace(fresh, prompt_tokens=count_prompt_tokens(as_input) - TOKENS_PER_MESSAGE)


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
    p_reason, p_content = partial_text(partial, bool(params.get("reasoning")))
    return (p_reason + (new.reasoning_content or "")) or None, p_content + new.content
