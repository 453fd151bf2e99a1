"""Request options: the generation options of SGLang's chat API a job may carry, and which of
them a crashed job may be continued with.

A row's top-level field, or a run's ``--param``, that names one of :data:`OPTIONS` is an option
of the request, sent to ``/v1/chat/completions`` under the same name and shape (SGLang 0.5.23's
``ChatCompletionRequest``); :data:`REFUSED` names the fields that would break tokenmill's
contract (it streams every request itself, one completion per job, and owns the request id).
Any other field is the row's metadata. The producer checks values (``producer/options.py``);
the worker decides here whether a checkpoint may be continued (:func:`restart_reason`).
"""

from __future__ import annotations

from typing import Any

# Sampling: they change the output, so they are part of the job's identity like every option.
SAMPLING = (
    "temperature", "top_p", "top_k", "min_p", "seed", "frequency_penalty", "presence_penalty",
    "repetition_penalty", "logit_bias", "min_tokens", "ignore_eos", "no_stop_trim",
    "skip_special_tokens",
)  # fmt: skip
STOPS = ("stop", "stop_token_ids", "stop_regex")
GRAMMARS = ("response_format", "regex", "ebnf")
TOOLS = ("tools", "tool_choice", "parallel_tool_calls")
TEMPLATE = ("chat_template_kwargs", "reasoning_effort", "thinking", "separate_reasoning")
PER_TOKEN = ("logprobs", "top_logprobs", "return_token_ids")
ADAPTERS = ("lora_path",)
OPTIONS = frozenset((*SAMPLING, *STOPS, *GRAMMARS, *TOOLS, *TEMPLATE, *PER_TOKEN, *ADAPTERS))

REFUSED = {
    "stream": "tokenmill streams every request itself",
    "stream_options": "tokenmill streams every request itself and sets stream_options",
    "continue_final_message": "tokenmill uses it to continue a crashed job from its checkpoint",
    "rid": "tokenmill names each attempt's request itself",
    "return_output_ids_in_sglext": "ask for return_token_ids instead",
    "return_hidden_states": "hidden states are not kept in the ledger",
}
# Fields of a run's --param/--params only: a run-wide value would make every row the same job.
RUN_REFUSED = {
    "messages": "the messages are each row's own",
    "prompt": "the prompt is each row's own",
    "model": "use --model (or TOKENMILL_MODEL)",
    "max_tokens": "use --short-max-tokens and --long-max-tokens (a row's own max_tokens wins)",
    "max_completion_tokens": "use --short-max-tokens and --long-max-tokens",
    "id": "ids are each row's own",
    "metadata": "metadata is each row's own",
}

# SGLang's response field that carries a completion's token ids when streaming (0.5.23): the
# request asks for it with this flag, and the last chunk before the usage holds
# ``{"choices": [], "sglext": {"output_ids": [[...]]}}``. ``return_token_ids`` itself is refused
# on a stream ("return_token_ids is not supported with streaming on /v1/chat/completions").
SGLEXT_OUTPUT_IDS = "return_output_ids_in_sglext"


def answered_whole(request: dict[str, Any]) -> bool:
    """Whether the job is sent whole (``stream: false``) rather than streamed.

    A job that asks for log-probabilities: SGLang 0.5.23 streams a decode step's entries on the
    chunk that carries its text, and a step with no text (a token that is part of a UTF-8
    character, the EOS token) sends no chunk on a server without a reasoning or tool-call
    parser, so its entries are lost (measured: 8 tokens whole gave 8 entries, streamed 6). The
    whole answer has one entry per completion token. Such jobs are never continued anyway
    (:func:`restart_reason`), so a stream's checkpoints would buy nothing.
    """
    return bool(request.get("logprobs"))


def restart_reason(request: dict[str, Any]) -> str | None:
    """Why a checkpoint of ``request`` cannot be continued (None: it can).

    A continuation is a new request whose prompt ends with the partial text. SGLang applies a
    grammar (``response_format``, ``regex``, ``ebnf``, a tool-call constraint) from the start of
    what it generates, so a continued JSON value starts again (measured on SGLang 0.5.23: the
    checkpoint plus the continuation is not valid JSON); its tool-call parser reads only the
    continuation, so a call split by the checkpoint is lost; log-probabilities and token ids
    would cover only the continuation's tokens, and its prompt is the partial text tokenized
    again (not the tokens generated). Such jobs start over; the tokens of the checkpoint are
    counted as thrown away. ``stop`` strings are continued (the worker cuts a stop string that
    straddles the checkpoint); ``stop_regex`` is not, as a regex match across the cut cannot be
    checked from the text alone.
    """
    for name in GRAMMARS:
        value = request.get(name)
        if value is not None and not (name == "response_format" and value.get("type") == "text"):
            return f"{name} constrains the output from its first token"
    if request.get("tools") and request.get("tool_choice", "auto") != "none":
        return "tool calls are parsed from the whole output"
    if request.get("logprobs") or request.get("return_token_ids"):
        return "log-probabilities and token ids must cover every generated token"
    if request.get("stop_regex"):
        return "a stop_regex match across the checkpoint cannot be checked"
    return None


def stop_strings(request: dict[str, Any]) -> tuple[str, ...]:
    """The request's ``stop`` as a tuple of strings (empty when unset)."""
    stop = request.get("stop")
    if stop is None:
        return ()
    return (stop,) if isinstance(stop, str) else tuple(stop)
