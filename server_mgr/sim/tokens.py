"""The sim's tokenizer: text into token pieces, pieces into ids, and each token's log-probability.

Free text is generated as vocabulary tokens (``textgen.VOCAB``, each a leading space and a word);
constrained text (JSON, a regex's match, a grammar's sentence, a tool call) is generated as a
string and cut here into pieces: a vocabulary word stays whole, anything else splits into runs of
word characters and single punctuation marks, as a BPE tokenizer splits code. A piece's id is its
vocabulary index, or a stable hash above the vocabulary; ids stay below the model's vocabulary
size and never equal the EOS id.

Log-probabilities are a pure function of the request's key, the token's position in the whole
output and its text, so a streamed and a non-streamed request, and a continuation of a
checkpoint, see the same values. The generated token is the most probable one, as under greedy
decoding; ``top_logprobs`` lists it first, then other vocabulary tokens in decreasing order.
"""

from __future__ import annotations

import hashlib
import re
import struct
from typing import Any

from server_mgr.sim.textgen import EOS_TOKEN_ID, VOCAB, VOCAB_ID_BASE

VOCAB_IDS = {tok: i + VOCAB_ID_BASE for i, tok in enumerate(VOCAB)}
HASHED_ID_BASE = 20000
HASHED_ID_SPAN = 130000  # ids stay below EOS_TOKEN_ID (151645) and the vocabulary size
VOCAB_SIZE = 151936  # Qwen2's: logit_bias keys are checked against it
EOS_TEXT = "<|im_end|>"  # the EOS token's text in log-probabilities (absent from the content)
_CHUNK = re.compile(r"\s?\S+|\s+")
_PIECE = re.compile(r"\s?\w+|\s?[^\w\s]|\s+")


def pieces(text: str) -> list[str]:
    """Token pieces of ``text``; their concatenation is ``text``."""
    out: list[str] = []
    for chunk in _CHUNK.findall(text):
        if chunk in VOCAB_IDS:
            out.append(chunk)
        else:
            out.extend(_PIECE.findall(chunk))
    return out


def token_id(piece: str) -> int:
    """The id of a token piece."""
    if piece == EOS_TEXT:
        return EOS_TOKEN_ID
    known = VOCAB_IDS.get(piece)
    if known is not None:
        return known
    digest = hashlib.blake2b(piece.encode(), digest_size=8).digest()
    return HASHED_ID_BASE + int.from_bytes(digest, "little") % HASHED_ID_SPAN


def ids(tokens: list[str]) -> list[int]:
    return [token_id(t) for t in tokens]


def _unit(key: bytes, position: int, label: bytes) -> float:
    digest = hashlib.blake2b(key + label + position.to_bytes(8, "little"), digest_size=8).digest()
    value: int = struct.unpack("<Q", digest)[0]
    return value / 2**64


def logprob(key: bytes, position: int, token: str) -> float:
    """The log-probability of ``token`` at ``position`` (in [-3, 0))."""
    return -round(3.0 * _unit(key + token.encode(), position, b"lp") + 1e-4, 4)


def entry(key: bytes, position: int, token: str, top: int) -> dict[str, Any]:
    """One ``choices[].logprobs.content`` entry in SGLang's shape."""
    # EOS after a complete grammar is the only token allowed: probability 1, as SGLang reports
    lp = 0.0 if token == EOS_TEXT else logprob(key, position, token)
    alternatives = []
    if top:
        alternatives.append({"token": token, "bytes": list(token.encode()), "logprob": lp})
        start = int(_unit(key, position, b"alt") * len(VOCAB))
        gap = lp
        for j in range(top - 1):
            alt = VOCAB[(start + j) % len(VOCAB)]
            if alt == token:
                alt = VOCAB[(start + j + len(VOCAB) // 2) % len(VOCAB)]
            gap -= round(0.5 + 2.0 * _unit(key, position * 64 + j, b"gap"), 4)
            alternatives.append({"token": alt, "bytes": list(alt.encode()), "logprob": round(gap, 4)})
    return {"token": token, "bytes": list(token.encode()), "logprob": lp, "top_logprobs": alternatives}


def entries(key: bytes, start: int, tokens: list[str], top: int) -> list[dict[str, Any]]:
    """Entries of ``tokens``, the first at ``start`` in the whole output."""
    return [entry(key, start + i, tok, top) for i, tok in enumerate(tokens)]
