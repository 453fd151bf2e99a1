"""``tokenmill export --format openai-batch``: OpenAI's Batch API output format, one line per
request, so that a job moves between OpenAI's Batch API and one's own GPUs with no code.

A done job is ``{"id", "custom_id", "response": {"status_code": 200, "request_id", "body": <a
chat.completion>}, "error": null}`` (a choice a stop string ended also carries SGLang's
``matched_stop``), built from its export row (the same row whether it is read
from Redis or from a sealed shard); a truncated one is written too, with ``finish_reason:
"length"``, as OpenAI would return it. A failed job is the error it ended with: an answer of the
server (an over-long prompt, an invalid request, a refused key) as ``response`` with its HTTP
status and OpenAI's error body, any other failure (retries exhausted) as ``error``; a cancelled
job is ``error`` with code ``batch_cancelled``. ``custom_id`` is the input line's own (the row's
``id``), with ``#<k>`` for sample k of ``--samples``. Ids are derived from the run and job, so
two exports of a run give the same lines; ``created`` is the time of the export.
"""

from __future__ import annotations

import hashlib
import time
from typing import Any

# The error classes that are an answer of the server, and the HTTP status it answered with.
HTTP_STATUS = {"context_length": 400, "invalid_request": 400, "unsupported_option": 400, "auth": 401}


def custom_id(row: dict[str, Any]) -> str:
    sample = row.get("sample")
    return str(row["id"]) if sample is None else f"{row['id']}#{sample}"


def _ids(run: str, job_id: str) -> tuple[str, str, str]:
    digest = hashlib.blake2b(f"{run}/{job_id}".encode(), digest_size=12).hexdigest()
    return f"batch_req_{digest}", f"req_{digest}", f"chatcmpl-{digest}"


def done_line(run: str, job_id: str, row: dict[str, Any]) -> dict[str, Any]:
    """The output line of a done job, from its export row."""
    line_id, request_id, completion_id = _ids(run, job_id)
    message = row["messages"][-1]
    usage = row.get("usage") or {}
    prompt, completion = usage.get("prompt_tokens") or 0, usage.get("completion_tokens") or 0
    choice: dict[str, Any] = {
        "index": 0,
        "message": message,
        "logprobs": row.get("logprobs"),
        "finish_reason": row.get("finish_reason"),
    }
    if row.get("matched_stop") is not None:  # SGLang's field of a choice, kept when a stop ended it
        choice["matched_stop"] = row["matched_stop"]
    body = {
        "id": completion_id,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": row.get("model"),
        "choices": [choice],
        "usage": {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
        },
    }
    response = {"status_code": 200, "request_id": request_id, "body": body}
    return {"id": line_id, "custom_id": custom_id(row), "response": response, "error": None}


def failed_line(run: str, job_id: str, row_id: str, error_class: str, message: str) -> dict[str, Any]:
    """The output line of a failed or cancelled job (``row_id`` is its :func:`custom_id`)."""
    line_id, request_id, _ = _ids(run, job_id)
    status = HTTP_STATUS.get(error_class)
    if status is None:
        code = "batch_cancelled" if error_class == "cancelled" else error_class
        error = {"code": code, "message": message}
        return {"id": line_id, "custom_id": row_id, "response": None, "error": error}
    kind = "authentication_error" if status == 401 else "invalid_request_error"
    body = {"error": {"message": message, "type": kind, "param": None, "code": error_class}}
    response = {"status_code": status, "request_id": request_id, "body": body}
    return {"id": line_id, "custom_id": row_id, "response": response, "error": None}
