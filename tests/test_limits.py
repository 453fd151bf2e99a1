"""Bounds at the door: no row or run option, however absurd, crashes enqueue or reaches a server
past what SGLang and the model allow; each is refused naming its row (file:line) and option."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import orjson
import pytest
import redis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from producer.enqueue import Routing
from producer.limits import DEFAULT, INT32_MAX, INT64_MAX, for_servers, regex_depth, too_deep
from producer.options import run_options
from producer.rows import normalize_row
from producer.status import run_status
from tests.pipeline import cli, write_jsonl
from tokenmill import servers
from tokenmill.errors import ConfigError, InputError
from tokenmill.options import OPTIONS
from tokenmill.settings import Settings

SRC = "data/part.jsonl:7"
SERVER_URL = "http://127.0.0.1:39999"  # published below, never called
# small bounds, so that generated values cross them in a few examples
SMALL = dataclasses.replace(
    DEFAULT, row_bytes=20_000, prompt_bytes=2_000, schema_bytes=2_000, regex_chars=200, max_tokens=4095
)
ABSURD_INTS = (2**64 - 1, 2**64, 2**63, 2**63 - 1, 2**31, 10**12, -(2**63) - 1, -1, 0, 10**40)


def nest(value: Any, levels: int) -> Any:
    for _ in range(levels):
        value = {"a": value}
    return value


def spec_of(data: dict[str, Any], limits: Any = DEFAULT, params: dict[str, Any] | None = None) -> Any:
    """The job a row becomes, through the path every reader's rows take."""
    routing = Routing("m", short_max_tokens=1000, long_max_tokens=2000, params=params or {}, limits=limits)
    return routing.spec(normalize_row(SRC, data, limits), "P", SRC)


@pytest.mark.parametrize(
    ("fields", "problem"),
    [
        ({"max_tokens": 2**64 - 1}, '"max_tokens" 18446744073709551615 is above 1048576 (TOKENMILL_INPUT'),
        ({"max_tokens": 10**12}, '"max_tokens" 1000000000000 is above 1048576'),
        ({"top_k": 2**64 - 1}, '"top_k" must be -1 (off) or an integer in [1, 2147483647]'),
        ({"stop_token_ids": [2**64 - 1]}, '"stop_token_ids" must be a list of token ids (integers in [0'),
        ({"min_tokens": 2**63 - 1, "max_tokens": 2**63 - 1}, '"max_tokens" 9223372036854775807 is above'),
        ({"min_tokens": 2**63 - 1}, '"min_tokens" must be an integer in [0, 2147483647]'),
        ({"min_tokens": 100, "max_tokens": 10}, '"min_tokens" (100) is above max_tokens (10)'),
        ({"logit_bias": {"18446744073709551615": 1}}, '"logit_bias": keys must be token ids'),
        ({"logit_bias": {"9" * 5000: 1}}, '"logit_bias": keys must be token ids'),
        ({"logit_bias": {"²": 1}}, '"logit_bias": keys must be token ids'),
        ({"seed": 2**63}, '"seed" must be a 64-bit integer'),
        ({"chat_template_kwargs": {"x": 2**64}}, '"chat_template_kwargs" cannot be stored as JSON'),
    ],
)  # fmt: skip
def test_the_issues_absurd_numbers_are_refused_naming_the_row_and_the_option(
    fields: dict[str, Any], problem: str
) -> None:
    # Given a row with a number SGLang or admission cannot take, When it is enqueued
    with pytest.raises(InputError) as info:
        spec_of({"prompt": "hello", **fields})
    # Then it is refused, naming the row and the option
    assert info.value.source == SRC and problem in info.value.problem


@pytest.mark.parametrize(
    ("field", "value", "problem"),
    [
        ("chat_template_kwargs", nest(1, 300), '"chat_template_kwargs" nests deeper than 64 levels'),
        ("metadata", nest(1, 10_000), '"metadata" nests deeper than 64 levels'),  # as Parquet/Python give it
        ("messages", [{"role": "user", "content": "hi", "x": nest(1, 100)}], '"messages" nests deeper'),
        ("response_format", {"type": "json_schema", "json_schema": {"name": "s", "schema": nest({}, 100)}},
         '"response_format" nests deeper than 64 levels'),
        ("regex", "(" * 600 + "a" + ")" * 600, '"regex" has a pattern of 600 nested groups, above 32'),
        ("stop_regex", ["a", "b" * 70_000], '"stop_regex" has a pattern of 70000 characters, above 65536'),
        ("tools", [{"type": "function", "function": {"name": "f", "description": "d" * 2000}}] * 80,
         '"tools" is 16'),
        ("prompt", "é" * 2_100_000, "the prompt is 4200030 bytes as JSON, above 4194304"),
    ],
)  # fmt: skip
def test_deep_or_huge_values_are_refused_before_anything_recursive_sees_them(
    field: str, value: Any, problem: str
) -> None:
    # Given a row with a value nested or sized past the bounds (deeper than orjson, jsonschema,
    # re.compile or Python's own stack go), When it is enqueued
    row = {field: value} if field in ("messages", "prompt") else {"prompt": "hello", field: value}
    with pytest.raises(InputError) as info:
        spec_of(row)
    # Then it is refused naming the row and the field, not a RecursionError or a traceback
    assert info.value.source == SRC and problem in info.value.problem, info.value.problem


def test_a_job_past_the_row_bytes_bound_is_refused() -> None:
    # Given a row whose stop strings make its job bigger than the row bound
    row = {"prompt": "hello", "stop": ["x" * 1000] * 30}
    # When it is enqueued with a 20,000-byte bound, Then it is refused naming its size and the bound
    with pytest.raises(InputError, match=r"the job is 3\d{4} bytes as JSON .*above 20000"):
        spec_of(row, SMALL)


def test_the_depth_walk_and_the_regex_scan_never_overflow_the_stack() -> None:
    # 100,000 levels: a walk down to the bottom on Python's stack would overflow it
    deep: Any = []
    for _ in range(100_000):
        deep = [deep]
    assert too_deep(deep, 64) and not too_deep(nest(1, 63), 63) and too_deep(nest(1, 64), 63)
    assert regex_depth(r"(a(b)c)\(\(([(((])") == 2
    assert regex_depth("(" * 100_000) == 100_000


def test_max_tokens_stays_below_the_context_length_a_managed_server_publishes(rclient: redis.Redis) -> None:
    # Given a server manager that published a server with a 4,096-token context
    servers.publish(rclient, servers.ServerRecord("gpu0", SERVER_URL, servers.READY, context_length=4096))
    settings = Settings(server_url=SERVER_URL)
    # When the bounds of a run sending to it are read (as admission reads the records)
    limits = for_servers(rclient, settings)
    # Then max_tokens may be at most 4,095 (SGLang refuses input + max_tokens > context)
    assert limits.max_tokens == 4095
    spec_of({"prompt": "hi", "max_tokens": 4095}, limits)
    with pytest.raises(
        InputError, match=r"\"max_tokens\" 4096 is above 4095 \(server gpu0's context length is 4096\)"
    ):
        spec_of({"prompt": "hi", "max_tokens": 4096}, limits)
    # and a server the run does not send to does not bound it
    assert for_servers(rclient, Settings(server_url="http://127.0.0.1:1")).max_tokens == 1 << 20


def test_a_bound_below_one_is_refused_at_start_naming_its_variable() -> None:
    # Given TOKENMILL_INPUT_MAX_DEPTH=0 (every row would be refused), When settings load, Then
    with pytest.raises(ConfigError, match="TOKENMILL_INPUT_MAX_DEPTH must be at least 1, got 0"):
        Settings.load({"TOKENMILL_INPUT_MAX_DEPTH": "0"})


# --- every row, however generated, is enqueued within bounds or refused naming its row ----------

# sizes and depths on both sides of each bound (SMALL's, and orjson's 254 levels), and small ones
SIZES = st.integers(0, 30) | st.sampled_from([199, 200, 201, 1999, 2000, 2001, 20_001, 70_000])
DEPTHS = st.integers(0, 8) | st.sampled_from([31, 32, 33, 62, 63, 64, 65, 120, 254, 255, 2000])
GROUPS = DEPTHS.map(lambda n: "(" * n + "a" + ")" * n)
SCALARS = (
    st.none()
    | st.booleans()
    | st.integers()
    | st.sampled_from(ABSURD_INTS)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=20)
    | SIZES.map(lambda n: "é" * n)
    | GROUPS
)
JSON = st.recursive(
    SCALARS,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=5), inner, max_size=4),
)
VALUES = JSON | st.tuples(JSON, DEPTHS).map(lambda t: nest(*t))
INTS = st.sampled_from(ABSURD_INTS) | st.integers() | st.integers(-2, 5000)
NUMBERS = ("top_k", "min_tokens", "seed", "top_logprobs", "max_tokens", "n", "stop_token_ids", "logit_bias")
FLOATS = st.floats(-3, 3) | st.floats()
REGEXES = st.text(alphabet="ab()[]\\|*", max_size=40) | GROUPS | SIZES.map(lambda n: "a" * n)
SCHEMAS = st.tuples(st.just({"type": "object"}), DEPTHS).map(
    lambda t: (
        nest(t[0], t[1]) if t[1] % 2 else {"type": "object", "properties": nest({"type": "string"}, t[1])}
    )
)
FUNCTIONS = st.fixed_dictionaries(
    {"name": st.sampled_from(["f", "g", "h"]), "parameters": SCHEMAS, "description": st.text(max_size=3000)}
)
TOOLS = st.lists(st.fixed_dictionaries({"type": st.just("function"), "function": FUNCTIONS}), max_size=3)
# per option: values near what it takes, absurd ones, and (less often) anything at all
NEAR: dict[str, Any] = {
    **dict.fromkeys(NUMBERS[:6], INTS),
    **dict.fromkeys(("temperature", "top_p", "min_p", "frequency_penalty", "presence_penalty"), FLOATS),
    **dict.fromkeys(("logprobs", "ignore_eos", "return_token_ids"), st.booleans()),
    "stop_token_ids": st.lists(INTS, max_size=3),
    "logit_bias": st.dictionaries(INTS.map(str) | st.text(max_size=3), FLOATS, max_size=3),
    "regex": REGEXES,
    "stop_regex": REGEXES | st.lists(REGEXES, max_size=3),
    "stop": st.text(max_size=5) | st.lists(st.text(max_size=3000), max_size=8),
    "response_format": st.builds(
        lambda s: {"type": "json_schema", "json_schema": {"name": "s", "schema": s}}, SCHEMAS
    ),
    "tools": TOOLS,
    "tool_choice": st.sampled_from(["auto", "none", "required"]),
    "chat_template_kwargs": VALUES,
}
FIELDS = [*sorted(OPTIONS), "max_tokens", "max_completion_tokens", "n", "id", "metadata", "lang", "stream"]
PROMPTS = st.text(min_size=1, max_size=30) | SIZES.map(lambda n: "p" * (n + 1))
MESSAGES = st.lists(
    st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant"]), "content": PROMPTS}),
    min_size=1,
    max_size=3,
)  # (other messages: VALUES as a row's field, and the nesting test)
# a prompt or messages, and a few fields each with a value near what it takes, absurd, or anything
FEW_FIELDS = st.lists(
    st.sampled_from(sorted(NEAR)) | st.sampled_from(FIELDS), max_size=3, unique=True
).flatmap(
    lambda names: st.fixed_dictionaries(
        {n: st.one_of(NEAR[n], NEAR[n], NEAR[n], VALUES) if n in NEAR else VALUES for n in names}
    )
)
ROWS = st.builds(
    lambda base, fields: {**base, **fields},
    st.fixed_dictionaries({"prompt": PROMPTS}) | st.fixed_dictionaries({"messages": MESSAGES}),
    FEW_FIELDS,
)


FEW_SECONDS = settings(
    max_examples=200,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


def assert_within_bounds(request: dict[str, Any], request_json: bytes) -> None:
    assert 1 <= request["max_tokens"] <= SMALL.max_tokens
    assert request.get("min_tokens", 0) <= request["max_tokens"]
    assert request.get("top_k", 1) == -1 or 1 <= request.get("top_k", 1) <= INT32_MAX
    assert all(0 <= t <= INT64_MAX for t in request.get("stop_token_ids", []))
    assert -(2**63) <= request.get("seed", 0) <= INT64_MAX and 0 <= request.get("top_logprobs", 0) <= 20
    assert all(0 <= int(k) <= INT64_MAX for k in request.get("logit_bias", {}))
    assert not too_deep(request, SMALL.depth) and len(request_json) <= SMALL.row_bytes
    assert len(orjson.dumps(request["messages"])) <= SMALL.prompt_bytes
    for name in ("response_format", "tools"):
        assert len(orjson.dumps(request.get(name))) <= SMALL.schema_bytes
    regexes = [request.get("regex", ""), *[request.get("stop_regex", [])]]
    for pattern in [p for r in regexes for p in ([r] if isinstance(r, str) else r)]:
        assert len(pattern) <= SMALL.regex_chars and regex_depth(pattern) <= SMALL.regex_depth


def taken_or_refused(row: dict[str, Any], params: dict[str, Any] | None = None) -> None:
    """``row`` with run-wide ``params`` becomes a job within every bound, or an InputError names
    the row or the option (``params['x']``); anything else (a traceback) fails the test."""
    try:
        spec = spec_of(row, SMALL, run_options(params, {}, SMALL))
    except InputError as exc:
        assert (exc.source == SRC or exc.source.startswith("params[")) and exc.problem, exc
        return
    assert_within_bounds(spec.request, spec.request_json)


@FEW_SECONDS
@given(ROWS)
def test_every_generated_row_is_enqueued_within_bounds_or_refused_naming_its_row(row: dict[str, Any]) -> None:
    # Given any row (absurd ints, deep nesting, huge strings, wrong types, unicode), When it is
    # made a job, Then it is one within every bound, or an InputError naming its row: nothing else
    taken_or_refused(row)


@FEW_SECONDS
@given(FEW_FIELDS)
def test_every_generated_run_option_is_taken_within_bounds_or_refused_naming_it(
    params: dict[str, Any],
) -> None:
    # Given any run-wide options, When a plain row is made a job with them, Then the same holds
    taken_or_refused({"prompt": "p"}, params)


@FEW_SECONDS
@given(st.sampled_from(NUMBERS), INTS, st.booleans())
def test_any_integer_of_a_numeric_option_is_taken_within_bounds_or_refused(
    name: str, value: int, run: bool
) -> None:
    # Given any integer for a numeric option (a token id, for stop_token_ids and logit_bias), a
    # row's own or run-wide, Then the same holds
    value = {"stop_token_ids": [value], "logit_bias": {str(value): 1}}.get(name, value)
    taken_or_refused({"prompt": "p"}, {name: value}) if run else taken_or_refused(
        {"prompt": "p", name: value}
    )


SIZED = {  # a value of about n characters for each option with a size bound
    "regex": lambda n: "(" * (n // 2) + ")" * (n // 2) or "a",  # and n/2 groups deep
    "stop_regex": lambda n: ["a", "b" * n],
    "response_format": lambda n: {
        "type": "json_schema",
        "json_schema": {"name": "s", "schema": {"title": "t" * n}},
    },
    "tools": lambda n: [{"type": "function", "function": {"name": "f", "description": "d" * n}}],
    "stop": lambda n: ["s" * n] * 10,  # the job's bytes
}


@FEW_SECONDS
@given(st.sampled_from([*SIZED, "prompt"]), SIZES, st.booleans())
def test_any_size_of_a_bounded_value_is_taken_within_bounds_or_refused(name: str, n: int, run: bool) -> None:
    # Given a prompt, regex, schema or stop list of about any size, a row's own or run-wide, Then
    # the same holds
    if name == "prompt":
        return taken_or_refused({"prompt": "p" * (n + 1)})
    value = SIZED[name](n)
    taken_or_refused({"prompt": "p"}, {name: value}) if run else taken_or_refused(
        {"prompt": "p", name: value}
    )


@FEW_SECONDS
@given(st.sampled_from([*FIELDS, "messages"]), DEPTHS, st.booleans())
def test_any_field_nested_at_any_depth_is_taken_within_bounds_or_refused(
    name: str, levels: int, run: bool
) -> None:
    # Given any field nested any number of levels deep, a row's own or run-wide, Then the same holds
    value = (
        [{"role": "user", "content": "p", "x": nest({}, levels)}] if name == "messages" else nest({}, levels)
    )
    base = {} if name == "messages" else {"prompt": "p"}
    taken_or_refused(base, {name: value}) if run else taken_or_refused({**base, name: value})


# --- end to end ----------------------------------------------------------------------------------


def test_enqueue_skip_invalid_counts_each_row_past_a_bound_and_enqueues_the_good_ones(
    tmp_path: Path, redis_url: str, rclient: redis.Redis
) -> None:
    # Given a server with a 4,096-token context and a file mixing good rows with the issue's bad ones
    servers.publish(rclient, servers.ServerRecord("gpu0", SERVER_URL, servers.READY, context_length=4096))
    bad = [
        {"prompt": "hello", "max_tokens": 2**64 - 1},
        {"prompt": "hello", "max_tokens": 4096},
        {"prompt": "hello", "top_k": 2**64 - 1},
        {"prompt": "hello", "stop_token_ids": [2**64 - 1]},
        {"prompt": "hello", "chat_template_kwargs": nest(1, 250)},
        {"prompt": "hello", "regex": "(" * 600 + "a" + ")" * 600},
        {"prompt": "x" * 5000},
    ]
    good = [{"prompt": f"good {i}", "max_tokens": 4095 - i} for i in range(3)]
    path = write_jsonl(tmp_path / "P.jsonl", [good[0], *bad, good[1], good[2]])
    with path.open("ab") as f:  # a line past orjson's own depth limit (1,024)
        f.write(b'{"prompt": "hi", "thinking": ' + b"[" * 2000 + b"]" * 2000 + b"}\n")
    env = {"TOKENMILL_REDIS_URL": redis_url, "TOKENMILL_SERVER_URL": SERVER_URL}
    env["TOKENMILL_INPUT_MAX_PROMPT_BYTES"] = "4000"

    # When it is enqueued with --skip-invalid
    flags = ["--short-max-tokens", "512", "--long-max-tokens", "1024"]
    res = cli("enqueue", str(path), "--run", "r", "--skip-invalid", *flags, env=env)

    # Then the good rows are enqueued and every bad one is counted, each named by file:line
    assert "3 new" in res.stdout and "8 invalid" in res.stdout, res.stdout
    assert run_status(rclient, "r")["totals"]["queued"] == 3
    assert "Traceback" not in res.stderr
    for line in range(2, 9):
        assert f"skipped: {path}:{line}: " in res.stderr, res.stderr
    assert f'{path}:3: "max_tokens" 4096 is above 4095 (server gpu0\'s context length is 4096)' in res.stderr
    assert f"{path}:11: invalid JSON: depth limit exceeded" in res.stderr
    # and a run-wide max_tokens past the context stops the run before any row, naming the flag
    res = cli(
        "enqueue", str(path), "--run", "r2", *flags[:2], "--long-max-tokens", "8192", env=env, check=False
    )
    assert res.returncode == 2 and "--long-max-tokens: max_tokens 8192 is above 4095" in res.stderr
