"""Request options at enqueue: read from rows, runs and OpenAI batch lines, checked with errors that
name the row and the option, combined (a row's own value wins), and part of the job's identity."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import orjson
import pytest

from producer.enqueue import Routing
from producer.options import run_params
from producer.rows import normalize_row
from tests.pipeline import cli, write_jsonl
from tokenmill.errors import InputError
from tokenmill.options import restart_reason

SRC = "data/part.jsonl:7"
USER = [{"role": "user", "content": "hi"}]
SCHEMA = {"type": "object", "properties": {"answer": {"type": "string"}}, "required": ["answer"]}
TOOL = {
    "type": "function",
    "function": {"name": "get_weather", "description": "now", "parameters": SCHEMA},
}

GOOD: list[tuple[str, Any]] = [
    ("stop", "\n\n"),
    ("stop", ["END", "###"]),
    ("stop_token_ids", [2, 7]),
    ("top_k", 20),
    ("top_k", -1),
    ("min_p", 0.05),
    ("min_tokens", 4),
    ("frequency_penalty", -0.5),
    ("presence_penalty", 2),
    ("repetition_penalty", 1.1),
    ("logit_bias", {"42": -100, "7": 3.5}),
    ("response_format", {"type": "json_object"}),
    (
        "response_format",
        {"type": "json_schema", "json_schema": {"name": "qa", "schema": SCHEMA, "strict": True}},
    ),
    ("regex", r"(yes|no)\.[a-z]{2,5}"),
    ("ebnf", 'root ::= "yes" | "no"'),
    ("tools", [TOOL]),
    ("parallel_tool_calls", False),
    ("chat_template_kwargs", {"enable_thinking": False}),
    ("reasoning_effort", "low"),
    ("logprobs", True),
    ("return_token_ids", True),
    ("lora_path", "my-adapter"),
    ("seed", -(2**63)),
]


@pytest.mark.parametrize(("name", "value"), GOOD)
def test_a_known_option_is_the_requests_not_metadata(name: str, value: Any) -> None:
    row = normalize_row(SRC, {"messages": USER, name: value, "topic": "t"})
    assert row.options == {name: value} and row.metadata == {"topic": "t"}


def test_numbers_are_floats_so_that_1_and_1_0_are_one_job() -> None:
    assert normalize_row(SRC, {"messages": USER, "temperature": 1}).options == {"temperature": 1.0}
    assert (
        type(normalize_row(SRC, {"messages": USER, "presence_penalty": 2}).options["presence_penalty"])
        is float
    )


BAD: list[tuple[dict[str, Any], str]] = [
    ({"stop": ""}, '"stop": each must be a non-empty string'),
    ({"stop": ["a", 3]}, '"stop": each must be a non-empty string, got 3'),
    ({"stop_token_ids": [1, -2]}, '"stop_token_ids" must be a list of token ids'),
    ({"top_k": 0}, '"top_k" must be -1 (off) or an integer in [1, 2147483647], got 0'),
    ({"min_p": 1.5}, '"min_p" must be a number in [0, 1], got 1.5'),
    ({"min_tokens": -1}, '"min_tokens" must be an integer in [0, 2147483647], got -1'),
    ({"repetition_penalty": 0}, '"repetition_penalty" must be a number in (0, 2], got 0'),
    ({"frequency_penalty": "high"}, '"frequency_penalty" must be a number in [-2, 2]'),
    (
        {"logit_bias": {"the": 1}},
        '"logit_bias": keys must be token ids (digits, at most 9223372036854775807)',
    ),
    ({"logit_bias": {"5": 101}}, '"logit_bias": values must be numbers in [-100, 100]'),
    ({"response_format": {"type": "xml"}}, '"response_format": "type" must be one of text, json_object'),
    ({"response_format": {"type": "json_schema"}}, '"response_format": type "json_schema" needs'),
    (
        {
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": {"type": "objekt"}},
            }
        },
        '"response_format": "json_schema.schema" is not a valid JSON Schema',
    ),
    ({"regex": "(unclosed"}, "\"regex\": '(unclosed' does not compile: missing ), unterminated subpattern"),
    ({"ebnf": "   "}, '"ebnf" must be a non-empty grammar string'),
    ({"tools": [{"name": "f"}]}, '"tools": tools[0] has no "function" object'),
    ({"tools": [{"type": "retrieval"}]}, '"tools": tools[0] must be {"type": "function", "function": {...}}'),
    ({"tools": [{"type": "function", "function": {"name": "has space"}}]}, "tools[0].function.name must be"),
    (
        {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": 5}}}]},
        '"tools": "tools[0].function.parameters" is not a valid JSON Schema',
    ),
    ({"tools": [TOOL, TOOL]}, "function 'get_weather' is defined twice"),
    ({"tool_choice": "always"}, '"tool_choice" must be one of none, auto, required or a named function'),
    ({"tool_choice": {"function": "f"}}, '"tool_choice" must be "none", "auto", "required" or'),
    ({"chat_template_kwargs": ["enable_thinking"]}, '"chat_template_kwargs" must be an object, got a list'),
    ({"reasoning_effort": "extreme"}, '"reasoning_effort" must be one of none, minimal, low'),
    ({"logprobs": "yes"}, '"logprobs" must be true or false'),
    ({"top_logprobs": 21, "logprobs": True}, '"top_logprobs" must be an integer in [0, 20], got 21'),
    ({"lora_path": 3}, '"lora_path" must be the name of a loaded LoRA adapter'),
    ({"stream": True}, '"stream" cannot be set: tokenmill streams every request itself'),
    ({"stream_options": {"include_usage": True}}, '"stream_options" cannot be set'),
    ({"continue_final_message": True}, '"continue_final_message" cannot be set: tokenmill uses it'),
    ({"rid": "mine"}, '"rid" cannot be set'),
    ({"n": 4}, '"n" must be 1 (got 4): for several completions of a prompt, enqueue with --samples N'),
    ({"max_completion_tokens": 0}, '"max_completion_tokens" must be a positive integer'),
    (
        {"max_tokens": 5, "max_completion_tokens": 6},
        '"max_tokens" (5) and "max_completion_tokens" (6) disagree',
    ),
]


@pytest.mark.parametrize(("fields", "problem"), BAD)
def test_a_bad_option_is_refused_naming_the_row_and_the_option(fields: dict[str, Any], problem: str) -> None:
    with pytest.raises(InputError) as info:
        normalize_row(SRC, {"messages": USER, **fields})
    assert info.value.source == SRC
    assert problem in info.value.problem


COMBINATIONS: list[tuple[dict[str, Any], str]] = [
    (
        {"regex": "a+", "ebnf": 'root ::= "a"'},
        "only one of response_format, regex, ebnf may be set; got regex and ebnf",
    ),
    ({"tool_choice": "required"}, '"tool_choice" \'required\' needs "tools"'),
    (
        {"tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
        '"tool_choice" names \'nope\', which "tools" lacks (get_weather)',
    ),
    ({"tools": [TOOL], "tool_choice": "required", "regex": "a+"}, 'cannot be combined with "regex"'),
    ({"top_logprobs": 3}, '"top_logprobs" needs "logprobs": true'),
    ({"min_tokens": 50, "max_tokens": 10}, '"min_tokens" (50) is above max_tokens (10)'),
]


@pytest.mark.parametrize(("fields", "problem"), COMBINATIONS)
def test_options_that_do_not_go_together_are_refused_naming_the_row(
    fields: dict[str, Any], problem: str
) -> None:
    row = normalize_row(SRC, {"messages": USER, **fields})
    with pytest.raises(InputError) as info:
        Routing(model="m").spec(row, "P", SRC)
    assert info.value.source == SRC
    assert problem in info.value.problem


def test_text_response_format_is_no_grammar() -> None:
    row = normalize_row(SRC, {"messages": USER, "response_format": {"type": "text"}, "regex": "a+"})
    spec = Routing(model="m").spec(row, "P", SRC)
    assert spec.request["regex"] == "a+"


def test_a_rows_own_value_wins_over_the_runs_and_every_option_is_in_the_id() -> None:
    routing = Routing(model="m", params={"stop": ["\n\n"], "top_k": 20, "chat_template_kwargs": {"x": 1}})
    plain = routing.spec(normalize_row(SRC, {"prompt": "p"}), "P", SRC)
    own = routing.spec(normalize_row(SRC, {"prompt": "p", "stop": "END"}), "P", SRC)

    assert plain.request["stop"] == ["\n\n"] and own.request["stop"] == "END"
    assert own.request["top_k"] == 20 and own.request["chat_template_kwargs"] == {"x": 1}
    assert plain.job_id != own.job_id
    # The same options again: the same job
    again = Routing(model="m", params={"top_k": 20, "chat_template_kwargs": {"x": 1}, "stop": ["\n\n"]})
    assert again.spec(normalize_row(SRC, {"prompt": "p"}), "P", SRC).job_id == plain.job_id


def test_samples_keep_the_options_and_vary_only_the_seed() -> None:
    routing = Routing(model="m", params={"logprobs": True})
    row = normalize_row(SRC, {"prompt": "p", "response_format": {"type": "json_object"}})
    specs = routing.samples(row, "P", SRC, 3)
    assert {s.request["response_format"]["type"] for s in specs} == {"json_object"}
    assert all(s.request["logprobs"] for s in specs)
    assert len({s.request["seed"] for s in specs}) == len({s.job_id for s in specs}) == 3


def test_run_params_come_from_a_file_then_each_param_then_the_flags(tmp_path: Path) -> None:
    path = tmp_path / "params.json"
    path.write_bytes(orjson.dumps({"stop": ["A"], "top_k": 5, "temperature": 0.3}))
    got = run_params(str(path), ["top_k=40", 'stop=["B"]'], {"temperature": 0.9, "top_p": None, "seed": None})
    assert got == {"stop": ["B"], "top_k": 40, "temperature": 0.9}


@pytest.mark.parametrize(
    ("params", "problem"),
    [
        (["messages=[]"], '--param messages: "messages" cannot be a run-wide option'),
        (['model="x"'], '--param model: "model" cannot be a run-wide option: use --model'),
        (["max_tokens=5"], "use --short-max-tokens and --long-max-tokens"),
        (["stream=true"], '--param stream: "stream" cannot be set'),
        (["n=2"], "enqueue with --samples N"),
        (["temprature=0.5"], "--param temprature: 'temprature' is not a request option tokenmill knows"),
        (["stop"], "--param stop: expected NAME=JSON"),
        (["stop=END"], "--param stop: 'END' is not JSON (strings need quotes: --param 'stop=\"END\"')"),
        (["top_k=0"], '--param top_k: "top_k" must be -1 (off) or an integer in [1, 2147483647]'),
    ],
)
def test_a_bad_run_param_is_refused_naming_it(params: list[str], problem: str) -> None:
    with pytest.raises(InputError, match=None) as info:
        run_params(None, params, {})
    assert problem in str(info.value)


def test_a_params_file_that_is_not_an_object_of_options_is_refused_naming_it(tmp_path: Path) -> None:
    bad = tmp_path / "p.json"
    bad.write_text("[1, 2]")
    with pytest.raises(InputError, match=r"p\.json: expected a JSON object of request options, got a list"):
        run_params(str(bad), [], {})
    bad.write_text("{nope")
    with pytest.raises(InputError, match=r"p\.json: invalid JSON"):
        run_params(str(bad), [], {})


def test_an_openai_batch_line_is_the_job_its_body_is() -> None:
    line = {
        "custom_id": "req-1",
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": {
            "model": "gpt-4o-mini",
            "messages": USER,
            "max_completion_tokens": 64,
            "stop": ["x"],
            "user": "u7",
        },
    }
    row = normalize_row(SRC, line)
    assert row.record_id == "req-1" and row.max_tokens == 64
    assert row.options == {"stop": ["x"]}
    assert row.metadata == {"model": "gpt-4o-mini", "user": "u7"}


@pytest.mark.parametrize(
    ("line", "problem"),
    [
        (
            {"url": "/v1/embeddings"},
            "OpenAI batch line has url '/v1/embeddings'; tokenmill runs /v1/chat/completions",
        ),
        ({"method": "GET"}, "OpenAI batch line has method 'GET'"),
        ({"custom_id": ""}, '"custom_id" must be a non-empty string'),
        ({"body": "text"}, '"body" must be an object, got a string'),
    ],
)
def test_a_batch_line_for_another_endpoint_is_refused_naming_it(line: dict[str, Any], problem: str) -> None:
    base = {"custom_id": "c", "method": "POST", "url": "/v1/chat/completions", "body": {"messages": USER}}
    with pytest.raises(InputError) as info:
        normalize_row(SRC, {**base, **line})
    assert info.value.source == SRC and problem in info.value.problem


def test_a_tool_use_conversation_is_a_valid_prompt() -> None:
    messages = [
        {"role": "user", "content": "weather?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
    ]
    row = normalize_row(SRC, {"messages": messages, "tools": [TOOL]})
    assert "content" not in row.messages[1] and row.messages[1]["tool_calls"][0]["id"] == "c1"


@pytest.mark.parametrize(
    ("request_", "restarts"),
    [
        ({"stop": ["\n"]}, False),
        ({"temperature": 0.5, "chat_template_kwargs": {"enable_thinking": False}}, False),
        ({"response_format": {"type": "text"}}, False),
        ({"response_format": {"type": "json_object"}}, True),
        ({"regex": "a+"}, True),
        ({"ebnf": "root ::= 'a'"}, True),
        ({"tools": [TOOL]}, True),
        ({"tools": [TOOL], "tool_choice": "none"}, False),
        ({"logprobs": True}, True),
        ({"return_token_ids": True}, True),
        ({"stop_regex": "x+"}, True),
    ],
)
def test_which_requests_a_crashed_job_may_continue(request_: dict[str, Any], restarts: bool) -> None:
    assert (restart_reason(request_) is not None) == restarts


def test_enqueue_stops_at_a_bad_option_naming_file_line_and_option_and_keeps_every_row_before(
    tmp_path: Path, redis_url: str
) -> None:
    env = {"TOKENMILL_REDIS_URL": redis_url}
    rows = [
        {"prompt": "a", "stop": ["\n\n"]},
        {"prompt": "b", "response_format": {"type": "json_object"}},
        {"prompt": "c", "regex": "(unclosed"},
        {"prompt": "d", "tools": [TOOL], "tool_choice": "required"},
    ]
    path = write_jsonl(tmp_path / "P.jsonl", rows)

    res = cli("enqueue", str(path), "--run", "r", env=env, check=False)

    assert res.returncode == 2, res.stderr
    assert f"{path}:3: \"regex\": '(unclosed' does not compile" in res.stderr
    assert "2 new" in res.stdout
    # --skip-invalid takes every good row; the same file again adds nothing (options are the identity)
    res = cli("enqueue", str(path), "--run", "r", "--skip-invalid", env=env)
    assert "1 new" in res.stdout and "1 invalid" in res.stdout and "2 already queued" in res.stdout
    assert f"{path}:3" in res.stderr
    again = cli("enqueue", str(path), "--run", "r", "--skip-invalid", env=env)
    assert "0 new" in again.stdout and "3 already queued" in again.stdout
    # a run-wide option makes the same prompts new jobs
    other = cli("enqueue", str(path), "--run", "r", "--skip-invalid", "--param", "top_k=5", env=env)
    assert "3 new" in other.stdout, other.stdout


def test_a_bad_run_param_stops_enqueue_before_any_row_naming_it(tmp_path: Path, redis_url: str) -> None:
    path = write_jsonl(tmp_path / "P.jsonl", [{"prompt": "a"}])
    res = cli("enqueue", str(path), "--run", "r", "--param", "stream=true",
              env={"TOKENMILL_REDIS_URL": redis_url}, check=False)  # fmt: skip
    assert res.returncode == 2
    assert 'tokenmill: error: --param stream: "stream" cannot be set' in res.stderr
