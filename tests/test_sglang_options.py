"""The generation options of SGLang's chat API, one test body for both engines (issue 24).

Each test runs against the sim and against real SGLang 0.5.23 (the tiny CPU model, random
weights, ``--tool-call-parser qwen25``): stop strings, log-probabilities, grammars, tool calls,
token ids, SGLang's 400s and what a ``continue_final_message`` continuation of a constrained
request gives. Where the two differ the sim is wrong; what was measured is in
``docs/sglang-conformance.md`` ("Request options"). Greedy requests compare a stream with the
same request sent whole; grammar requests sample with a seed, since a greedy random model under a
JSON grammar writes whitespace until ``max_tokens``.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

import jsonschema
import pytest

from tests.engines import Engine, running_engine
from tests.sglang_client import post_json, sse_frames

USER = [{"role": "user", "content": "Tell me about caches and queues. Ünïcödé δέλτα 日本語 🚀"}]
GREEDY = {"model": "tm", "messages": USER, "temperature": 0}
STREAM_USAGE = {"stream_options": {"include_usage": True}}
SCHEMA = {  # bounded, so that even a random model's output must end
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 99},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}
JSON_SCHEMA = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "strict": True,
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string", "maxLength": 8}, "unit": {"enum": ["c", "f"]}},
                "required": ["city", "unit"],
                "additionalProperties": False,
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "add",
            "strict": True,
            "parameters": {
                "type": "object",
                "properties": {
                    "a": {"type": "integer", "minimum": 0, "maximum": 99},
                    "b": {"type": "integer", "minimum": 0, "maximum": 99},
                },
                "required": ["a", "b"],
                "additionalProperties": False,
            },
        },
    },
]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}


@pytest.fixture(scope="module")
def engine(tools_engine: Engine) -> Engine:
    return tools_engine


def whole(engine: Engine, body: dict[str, Any]) -> dict[str, Any]:
    status, answer = post_json(engine, "/v1/chat/completions", {**GREEDY, **body, "stream": False})
    assert status == 200, answer
    return answer


def streamed(engine: Engine, body: dict[str, Any]) -> dict[str, Any]:
    """A stream assembled as a client would: text, logprob entries, tool calls, the finish chunk."""
    frames = sse_frames(engine, {**GREEDY, **body})
    assert frames[-1] == "[DONE]", frames[-3:]
    chunks = [f for f in frames[:-1] if f.get("choices")]
    content, entries, calls, firsts = "", [], {}, {}
    for chunk in chunks:
        choice = chunk["choices"][0]
        delta = choice["delta"]
        content += delta.get("content") or ""
        if choice.get("logprobs"):
            entries += choice["logprobs"]["content"]
        for call in delta.get("tool_calls") or []:
            if call.get("id"):
                assert call["index"] not in calls, f"a second first delta for call {call['index']}"
                assert call["type"] == "function" and call["function"]["name"], call
                calls[call["index"]] = {"name": call["function"]["name"], "arguments": ""}
                firsts[call["index"]] = call
            else:
                assert call["function"].get("name") is None, call
            calls[call["index"]]["arguments"] += call["function"].get("arguments") or ""
    finish = chunks[-1]["choices"][0]
    assert finish["delta"] == {"reasoning_content": None}, finish
    return {
        "content": content,
        "logprobs": entries,
        "tool_calls": calls,
        "first_deltas": firsts,
        "finish": finish,
        "frames": frames,
    }


def test_a_stop_string_across_tokens_ends_the_output_before_it_streamed_and_whole(engine: Engine) -> None:
    base = whole(engine, {"max_tokens": 24, "logprobs": True})
    text = base["choices"][0]["message"]["content"]
    pieces = [e["token"] for e in base["choices"][0]["logprobs"]["content"]]
    assert "".join(pieces) == text, (pieces, text)
    boundary = len("".join(pieces[:6]))
    stop = text[boundary - 2 : boundary + 2]  # straddles the 6th and 7th tokens
    cut = text.find(stop)

    answer = whole(engine, {"max_tokens": 24, "stop": stop})
    stream = streamed(engine, {"max_tokens": 24, "stop": stop})

    choice = answer["choices"][0]
    assert choice["message"]["content"] == text[:cut] == stream["content"]
    assert choice["finish_reason"] == "stop" == stream["finish"]["finish_reason"]
    assert choice["matched_stop"] == stop == stream["finish"]["matched_stop"]
    ends = [len("".join(pieces[: i + 1])) for i in range(len(pieces))]
    completing = next(i for i, end in enumerate(ends) if end >= cut + len(stop))
    assert answer["usage"]["completion_tokens"] == completing + 1  # the token that completed it counts


def test_the_first_stop_string_of_a_list_to_appear_is_the_one_matched(engine: Engine) -> None:
    base = whole(engine, {"max_tokens": 16, "logprobs": True})["choices"][0]
    text = base["message"]["content"]
    words = [e["token"].strip() for e in base["logprobs"]["content"]]
    unique = [w for w in words if len(w) >= 3 and w.isascii() and w.isalnum() and text.count(w) == 1]
    assert len(unique) >= 2, words
    early, late = unique[0], unique[-1]

    answer = whole(engine, {"max_tokens": 16, "stop": ["\u2603 never", late, early]})

    choice = answer["choices"][0]
    assert choice["matched_stop"] == early and choice["message"]["content"] == text[: text.find(early)]


def test_logprobs_give_one_entry_per_completion_token_streamed_and_whole(engine: Engine) -> None:
    answer = whole(engine, {"max_tokens": 8, "logprobs": True, "top_logprobs": 2})
    stream = streamed(engine, {"max_tokens": 8, "logprobs": True, "top_logprobs": 2})

    entries = answer["choices"][0]["logprobs"]["content"]
    assert len(entries) == answer["usage"]["completion_tokens"] == 8 == len(stream["logprobs"])
    for entry in entries:
        assert set(entry) == {"token", "bytes", "logprob", "top_logprobs"}
        # the token's own bytes: its text's, unless it is part of a character (then text "\ufffd")
        assert all(0 <= b < 256 for b in entry["bytes"]) and entry["logprob"] <= 0
        if "\ufffd" not in entry["token"]:
            assert entry["bytes"] == list(entry["token"].encode())
        assert [set(t) for t in entry["top_logprobs"]] == [{"token", "bytes", "logprob"}] * 2
        assert entry["top_logprobs"][0]["token"] == entry["token"]  # greedy: the most probable
    assert [e["token"] for e in stream["logprobs"]] == [e["token"] for e in entries]
    assert [e["logprob"] for e in stream["logprobs"]] == pytest.approx(
        [e["logprob"] for e in entries], abs=1e-3
    )
    assert "".join(e["token"] for e in entries) == answer["choices"][0]["message"]["content"]


def test_logprobs_without_top_logprobs_have_an_empty_list(engine: Engine) -> None:
    entries = whole(engine, {"max_tokens": 3, "logprobs": True})["choices"][0]["logprobs"]["content"]

    assert len(entries) == 3 and all(e["top_logprobs"] == [] for e in entries)


def test_a_json_schema_output_validates_streamed_and_whole(engine: Engine) -> None:
    body = {"max_tokens": 64, "response_format": JSON_SCHEMA}
    answer = whole(engine, body)
    stream = streamed(engine, body)

    content = answer["choices"][0]["message"]["content"]
    jsonschema.validate(json.loads(content), SCHEMA)
    assert stream["content"] == content
    assert answer["choices"][0]["finish_reason"] == "stop" == stream["finish"]["finish_reason"]


def test_a_json_object_output_is_an_object_or_its_start(engine: Engine) -> None:
    choice = whole(engine, {"max_tokens": 64, "response_format": {"type": "json_object"}})["choices"][0]
    content = choice["message"]["content"]

    # the random model opens a key it never closes (any string is a key): only the start shows
    assert content.startswith("{"), content
    assert choice["finish_reason"] == "length" or isinstance(json.loads(content), dict), content


def test_a_regex_output_matches_the_regex(engine: Engine) -> None:
    regex = r"(yes|no), [a-z]{3,6}\."
    answer = whole(engine, {"max_tokens": 32, "regex": regex})
    stream = streamed(engine, {"max_tokens": 32, "regex": regex})

    content = answer["choices"][0]["message"]["content"]
    assert re.fullmatch(regex, content), content
    assert stream["content"] == content


def test_an_ebnf_output_is_a_sentence_of_the_grammar(engine: Engine) -> None:
    grammar = 'root ::= "Answer: " ("yes" | "no") "."'
    content = whole(engine, {"max_tokens": 32, "ebnf": grammar})["choices"][0]["message"]["content"]

    assert content in ("Answer: yes.", "Answer: no."), content


def test_a_tool_call_cut_by_max_tokens_streams_its_name_and_is_dropped_whole(engine: Engine) -> None:
    body = {"max_tokens": 20, "tools": TOOLS, "tool_choice": "required"}
    answer = whole(engine, body)
    stream = streamed(engine, body)

    choice = answer["choices"][0]
    assert choice["finish_reason"] == "length" == stream["finish"]["finish_reason"]
    assert choice["message"]["content"] == "" and "tool_calls" not in choice["message"]
    assert list(stream["tool_calls"]) == [0] and stream["tool_calls"][0]["name"] in SCHEMAS
    assert stream["content"] == ""
    first = stream["first_deltas"][0]
    assert re.fullmatch(r"call_[0-9a-f]{24}", first["id"]) and first["function"]["arguments"] == ""


@pytest.fixture(scope="module")
def sim(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engine]:
    """The sim alone: real SGLang's random model never closes a tool call (it writes whitespace
    inside the arguments: --constrained-json-disable-any-whitespace does not reach the tool-call
    grammar), so a whole call is checked on the sim only."""
    workdir = tmp_path_factory.mktemp("options-sim-tools")
    with running_engine("sim", workdir, "--tool-call-parser", "qwen25") as eng:
        yield eng


def test_required_tool_calls_come_as_openai_tool_calls_streamed_like_whole(sim: Engine) -> None:
    body = {"max_tokens": 128, "tools": TOOLS, "tool_choice": "required"}
    answer = whole(sim, body)
    stream = streamed(sim, body)

    choice = answer["choices"][0]
    assert choice["finish_reason"] == "tool_calls" == stream["finish"]["finish_reason"]
    assert choice["matched_stop"] is None and isinstance(stream["finish"]["matched_stop"], int)
    calls = choice["message"]["tool_calls"]
    assert calls and choice["message"]["content"] == ""
    for i, call in enumerate(calls):
        assert (
            call["index"] == i
            and call["type"] == "function"
            and re.fullmatch(r"call_[0-9a-f]{24}", call["id"])
        )
        jsonschema.validate(json.loads(call["function"]["arguments"]), SCHEMAS[call["function"]["name"]])
    assert [stream["tool_calls"][i] for i in sorted(stream["tool_calls"])] == [
        {"name": c["function"]["name"], "arguments": c["function"]["arguments"]} for c in calls
    ]


def test_token_ids_come_whole_and_are_refused_on_a_stream(engine: Engine) -> None:
    answer = whole(engine, {"max_tokens": 12, "return_token_ids": True})
    status, refused = post_json(
        engine, "/v1/chat/completions", {**GREEDY, "max_tokens": 12, "return_token_ids": True, "stream": True}
    )

    choice = answer["choices"][0]
    assert len(choice["response_token_ids"]) == answer["usage"]["completion_tokens"] == 12
    assert len(choice["prompt_token_ids"]) == answer["usage"]["prompt_tokens"]
    assert status == 400 and refused["type"] == "BadRequest"
    assert refused["message"] == (
        "return_token_ids is not supported with streaming on /v1/chat/completions. Please set "
        "stream=false when using return_token_ids=true."
    )


def test_a_stream_gives_the_output_ids_in_sglext_when_asked(engine: Engine) -> None:
    ids = whole(engine, {"max_tokens": 12, "return_token_ids": True})["choices"][0]["response_token_ids"]
    frames = sse_frames(engine, {**GREEDY, "max_tokens": 12, "return_output_ids_in_sglext": True})

    ext = [f for f in frames[:-1] if "sglext" in f]
    assert len(ext) == 1 and ext[0]["choices"] == [] and ext[0]["sglext"] == {"output_ids": [ids]}
    assert frames.index(ext[0]) == len(frames) - 2  # after the finish chunk, before [DONE]


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({"tool_choice": "required"}, "Tools cannot be empty if tool choice is set to required."),
        (
            {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "Tool 'nope' not found in tools list.",
        ),
        (
            {"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
            "tool_choice 'required' or a named tool cannot be combined with response_format, regex, "
            "or ebnf: the tool-call constraint and the output constraint cannot both be honored.",
        ),
        (
            {"regex": "a+", "response_format": {"type": "json_object"}},
            "Only one of json_schema, regex, ebnf, or structural_tag can be set.",
        ),
        (
            {"lora_path": "my-adapter"},
            "LoRA adapter 'my-adapter' was requested, but LoRA is not enabled. Please launch the "
            "server with --enable-lora flag and preload adapters using --lora-paths or "
            "/load_lora_adapter endpoint.",
        ),
    ],
)
def test_options_sglang_refuses_get_its_400_and_message(engine: Engine, body: dict, message: str) -> None:
    for stream in (False, True):
        status, answer = post_json(
            engine, "/v1/chat/completions", {**GREEDY, "max_tokens": 4, **body, "stream": stream}
        )

        assert status == 400, answer
        assert answer["message"] == message


def test_a_regex_that_does_not_compile_is_a_400(engine: Engine) -> None:
    status, answer = post_json(
        engine, "/v1/chat/completions", {**GREEDY, "max_tokens": 4, "regex": "(unclosed"}
    )

    frames = sse_frames(engine, {**GREEDY, "max_tokens": 4, "regex": "(unclosed", **STREAM_USAGE})

    assert status == 400, answer
    assert answer["message"].startswith("Failed to compile regex grammar: "), answer
    # streamed: HTTP 200 (sse_frames checks it), the error as an event, the usage chunk, [DONE]
    error, usage, done = frames
    assert error["error"]["message"].startswith("Failed to compile regex grammar: ")
    assert error["error"]["type"] == "BAD_REQUEST" and error["error"]["code"] == 400
    assert usage["choices"] == [] and done == "[DONE]"


def test_a_json_schema_continuation_starts_a_new_json_value(engine: Engine) -> None:
    body = {"max_tokens": 64, "response_format": JSON_SCHEMA}
    first = whole(engine, body)["choices"][0]["message"]["content"]
    partial = first[: len(first) // 2]

    cont = whole(
        engine,
        {
            **body,
            "messages": [*USER, {"role": "assistant", "content": partial}],
            "continue_final_message": True,
        },
    )["choices"][0]["message"]["content"]

    jsonschema.validate(json.loads(cont), SCHEMA)  # a whole value of its own
    with pytest.raises(json.JSONDecodeError):
        json.loads(partial + cont)


def test_a_grammar_output_ends_on_eos_which_is_counted_and_has_a_logprob(engine: Engine) -> None:
    body = {"max_tokens": 32, "regex": r"(yes|no), [a-z]{3,6}\.", "logprobs": True}
    answer = whole(engine, body)
    stream = streamed(engine, body)

    choice = answer["choices"][0]
    entries = choice["logprobs"]["content"]
    assert choice["finish_reason"] == "stop" and isinstance(choice["matched_stop"], int)  # the EOS id
    assert len(entries) == answer["usage"]["completion_tokens"]
    assert entries[-1]["token"] == "<|im_end|>" and entries[-1]["logprob"] == 0.0
    assert "".join(e["token"] for e in entries[:-1]) == choice["message"]["content"]
    assert [e["token"] for e in stream["logprobs"]] == [e["token"] for e in entries]


def test_tokenize_gives_the_prompts_token_ids(engine: Engine) -> None:
    status, one = post_json(engine, "/v1/tokenize", {"model": "tm", "prompt": "hello world ünï"})
    _, two = post_json(engine, "/tokenize", {"model": "tm", "prompt": ["hello", "hello world ünï"]})

    assert status == 200 and set(one) == {"tokens", "count", "max_model_len"}
    assert one["count"] == len(one["tokens"]) > 1 and all(isinstance(t, int) for t in one["tokens"])
    assert two["tokens"][1] == one["tokens"] and two["count"] == [len(two["tokens"][0]), one["count"]]


@pytest.fixture(scope="module")
def thinker(qwen3_engine: Engine) -> Engine:
    """An engine with Qwen3's reasoning parser: the tiny model's template opens a think block."""
    return qwen3_engine


@pytest.mark.parametrize(
    ("switch", "thinks"),
    [
        ({}, True),
        ({"chat_template_kwargs": {"enable_thinking": False}}, False),
        ({"reasoning_effort": "none"}, False),
        ({"reasoning_effort": "low"}, True),
    ],
)
def test_thinking_is_switched_by_chat_template_kwargs_and_reasoning_effort(
    thinker: Engine, switch: dict, thinks: bool
) -> None:
    answer = whole(thinker, {"max_tokens": 12, **switch})
    stream = streamed(thinker, {"max_tokens": 12, **switch})

    message, usage = answer["choices"][0]["message"], answer["usage"]
    if thinks:
        assert message["reasoning_content"] and message["content"] == "" and usage["reasoning_tokens"] == 12
    else:
        assert message["content"] and message["reasoning_content"] is None and usage["reasoning_tokens"] == 0
    assert stream["content"] == message["content"]


@pytest.fixture(scope="module")
def plain(plain_engine: Engine) -> Engine:
    """An engine with no reasoning or tool-call parser (the shared plain one: an API key)."""
    return plain_engine


def test_without_a_parser_a_stream_drops_the_logprobs_of_a_step_with_no_text(plain: Engine) -> None:
    body = {"max_tokens": 32, "regex": r"(yes|no), [a-z]{3,6}\.", "logprobs": True}
    answer = whole(plain, body)
    stream = streamed(plain, body)

    entries = answer["choices"][0]["logprobs"]["content"]
    assert len(entries) == answer["usage"]["completion_tokens"] and entries[-1]["token"] == "<|im_end|>"
    # the EOS step has no text: SGLang has no chunk to put its entry on when no parser runs
    assert [e["token"] for e in stream["logprobs"]] == [e["token"] for e in entries[:-1]]


def test_without_a_tool_parser_required_tools_give_a_json_array_in_the_content(plain: Engine) -> None:
    body = {"max_tokens": 128, "tools": TOOLS, "tool_choice": "required"}
    answer = whole(plain, body)
    stream = streamed(plain, body)

    choice = answer["choices"][0]
    assert "tool_calls" not in choice["message"] and choice["finish_reason"] == "stop"
    calls = json.loads(choice["message"]["content"])
    assert calls and all(set(c) == {"name", "parameters"} for c in calls)
    for call in calls:
        jsonschema.validate(call["parameters"], SCHEMAS[call["name"]])
    assert stream["content"] == choice["message"]["content"] and not stream["tool_calls"]


def test_n_greedy_choices_are_the_same_output_streamed_per_index(plain: Engine) -> None:
    answer = whole(plain, {"max_tokens": 6, "n": 2})
    if plain.kind == "sim":  # the sim answers n > 1 with one choice (tokenmill refuses n > 1)
        assert [c["index"] for c in answer["choices"]] == [0]
        return
    frames = sse_frames(plain, {**GREEDY, "max_tokens": 6, "n": 2, **STREAM_USAGE})

    texts = [c["message"]["content"] for c in answer["choices"]]
    assert [c["index"] for c in answer["choices"]] == [0, 1] and texts[0] == texts[1]
    assert answer["usage"]["completion_tokens"] == 12  # both choices' tokens
    streamed_texts, finishes = ["", ""], {}
    for frame in frames[:-2]:
        choice = frame["choices"][0]
        streamed_texts[choice["index"]] += choice["delta"].get("content") or ""
        if choice["finish_reason"]:
            finishes[choice["index"]] = choice["finish_reason"]
    assert streamed_texts == texts and finishes == {0: "length", 1: "length"}
    assert frames[-2]["choices"] == [] and frames[-2]["usage"]["completion_tokens"] == 12
