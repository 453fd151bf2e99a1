"""What an attempt keeps of a stream's per-token data: tool calls, log-probabilities, token ids."""

from __future__ import annotations

from typing import Any

import pytest

from tokenmill import errors
from workers.attempt import _per_token_data
from workers.stream import Progress

CALL = {"id": "call_1", "index": 0, "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}


def kept(req: dict[str, Any], **progress: Any) -> dict[str, Any]:
    result: dict[str, Any] = {}
    _per_token_data(req, Progress(**progress), result)
    return result


def test_tool_calls_are_kept_when_the_answer_ended_by_itself() -> None:
    got = kept({"tools": []}, tool_calls=[CALL], finish_reason="tool_calls", chunks=3)
    assert got == {"tool_calls": [CALL]}


def test_an_answer_cut_by_max_tokens_keeps_no_tool_call_even_one_whose_arguments_parse() -> None:
    # (SGLang's whole answer drops a call whose closing marker did not come; a stream cannot say)
    assert kept({"tools": []}, tool_calls=[CALL], finish_reason="length", chunks=3) == {}


def test_log_probabilities_that_miss_a_token_are_an_error_not_a_short_row() -> None:
    entry = {"token": "a", "logprob": -0.1, "top_logprobs": []}
    assert kept({"logprobs": True}, logprobs=[entry] * 2, chunks=2) == {"logprobs": {"content": [entry] * 2}}
    with pytest.raises(errors.IncompleteOutputError, match="1 log-probabilities for 2 tokens"):
        kept({"logprobs": True}, logprobs=[entry], chunks=2)


def test_token_ids_missing_or_short_are_errors() -> None:
    assert kept({"return_token_ids": True}, output_ids=[5, 6], chunks=2) == {"output_token_ids": [5, 6]}
    with pytest.raises(errors.UnsupportedOptionError, match="no token ids"):
        kept({"return_token_ids": True}, chunks=2)
    with pytest.raises(errors.IncompleteOutputError, match="1 token ids for 2 tokens"):
        kept({"return_token_ids": True}, output_ids=[5], chunks=2)
