"""``POST /generate`` as a scorer uses SGLang 0.5.23's native endpoint: token ids in, each
input token's log-probability out, nothing generated (``max_new_tokens: 0``).

Body: ``input_ids`` (a list of ids, or a batch of lists), ``return_logprob``,
``logprob_start_len`` (an int or one a sequence), ``sampling_params.max_new_tokens`` (must be
0: the sim generates only on its chat endpoint). Answer, per sequence (a list for a batch):
``{"text": "", "output_ids": [], "meta_info": {..., "input_token_logprobs": [[logprob,
token_id, null], ...], "output_token_logprobs": []}}``, the entries from ``logprob_start_len``
on, the first one's logprob ``null`` (SGLang's ``[None] + logprobs[:-1]``). A token's
log-probability is a pure function of the token before it, its position and itself
(:func:`server_mgr.sim.tokens.logprob`), so a sequence always scores the same.
"""

from __future__ import annotations

import uuid
from typing import Any

from aiohttp import web

from server_mgr.sim import tokens
from server_mgr.sim.chat import json_response, read_json
from server_mgr.sim.errors import RequestError


def score(ids: list[int], start: int, rid: str) -> dict[str, Any]:
    """One sequence's answer."""
    if not 0 <= start <= len(ids):
        raise RequestError(
            f"req.logprob_start_len={start} is higher than the number of input tokens "
            f"len(req.origin_input_ids)={len(ids)}. Please use a smaller logprob_start_len."
        )
    rows: list[list[Any]] = [[None, ids[start], None]] if start < len(ids) else []
    rows += [
        [tokens.logprob(str(ids[i - 1]).encode(), i, str(ids[i])), ids[i], None]
        for i in range(start + 1, len(ids))
    ]
    meta = {
        "id": rid,
        "finish_reason": {"type": "length", "length": 0},
        "prompt_tokens": len(ids),
        "completion_tokens": 0,
        "cached_tokens": 0,
        "input_token_logprobs": rows,
        "output_token_logprobs": [],
    }
    return {"text": "", "output_ids": [], "meta_info": meta}


async def generate(request: web.Request) -> web.StreamResponse:
    try:
        body = await read_json(request)
        ids = body.get("input_ids")
        if not isinstance(ids, list) or not ids:
            raise RequestError("the sim's /generate takes input_ids (a list of ids or a batch of lists)")
        if (body.get("sampling_params") or {}).get("max_new_tokens", 128) != 0:
            raise RequestError("the sim's /generate only scores its input: set max_new_tokens to 0")
        batch = isinstance(ids[0], list)
        seqs: list[list[int]] = ids if batch else [ids]
        start = body.get("logprob_start_len", -1)
        starts = start if isinstance(start, list) else [start] * len(seqs)
        starts = [len(s) if st == -1 else int(st) for s, st in zip(seqs, starts, strict=True)]
        rid = uuid.uuid4().hex
        answers = [score(s, st, f"{rid}-{i}") for i, (s, st) in enumerate(zip(seqs, starts, strict=True))]
    except RequestError as exc:
        return json_response(exc.body(), exc.status)
    return json_response(answers if batch else answers[0])
