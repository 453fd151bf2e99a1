"""Row normalization: good rows become requests, bad rows raise an error naming row and problem."""

from __future__ import annotations

from decimal import Decimal
from typing import Any

import pytest

from producer.rows import Row, normalize_row
from tokenmill.errors import InputError
from tokenmill.tokens import estimate_prompt_tokens

SRC = "data/part.jsonl:12"
USER = {"role": "user", "content": "hi"}


def problem_of(data: dict[str, Any]) -> str:
    with pytest.raises(InputError) as info:
        normalize_row(SRC, data)
    assert info.value.source == SRC
    assert str(info.value) == f"{SRC}: {info.value.problem}"
    return info.value.problem


# --- good rows -----------------------------------------------------------------------------------


def test_a_prompt_becomes_one_user_message() -> None:
    assert normalize_row(SRC, {"prompt": "Write a haiku ✍"}) == Row(
        messages=[{"role": "user", "content": "Write a haiku ✍"}]
    )


def test_messages_keep_their_extra_keys_and_every_option_is_read() -> None:
    messages = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "hi", "name": "ann"},
        {"role": "assistant", "content": "hello", "reasoning_content": "greet back"},
        {"role": "tool", "content": "42", "tool_call_id": "c1"},
        {"role": "user", "content": "thanks"},
    ]
    data = {
        "messages": messages,
        "id": "row-1",
        "max_tokens": 256,
        "metadata": {"source": "web"},
        "temperature": 0.7,
        "top_p": 1,
        "seed": 3,
    }

    row = normalize_row(SRC, data)

    assert row == Row(
        messages=messages,
        record_id="row-1",
        max_tokens=256,
        metadata={"source": "web"},
        options={"temperature": 0.7, "top_p": 1.0, "seed": 3},
    )
    assert row.messages is not messages


def test_an_integer_id_becomes_a_string() -> None:
    assert normalize_row(SRC, {"prompt": "p", "id": 17}).record_id == "17"


def test_unknown_top_level_fields_are_kept_in_metadata_under_their_own_names() -> None:
    row = normalize_row(SRC, {"prompt": "p", "metadata": {"a": 1}, "lang": "fr", "score": 0.5})

    assert row.metadata == {"a": 1, "lang": "fr", "score": 0.5}


def test_nulls_count_as_absent_as_parquet_and_arrow_fill_them_in() -> None:
    data = {
        "prompt": None,
        "messages": [{"role": "user", "content": "hi", "name": None, "tool_calls": None}],
        "id": None,
        "max_tokens": None,
        "metadata": None,
        "temperature": None,
        "top_p": None,
        "seed": None,
        "extra": None,
    }

    assert normalize_row(SRC, data) == Row(messages=[USER])


def test_text_parts_content_is_kept_as_a_list() -> None:
    parts = [{"type": "text", "text": "look"}, {"type": "text", "text": "again", "x": None}]

    row = normalize_row(SRC, {"messages": [{"role": "user", "content": parts}]})

    assert row.messages == [
        {"role": "user", "content": [{"type": "text", "text": "look"}, {"type": "text", "text": "again"}]}
    ]


# --- messages or prompt --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("data", "expected"),
    [
        ({"messages": [USER], "prompt": "p"}, 'has both "messages" and "prompt"; give only one'),
        (
            {"text": "hello", "id": 1},
            'expected "messages" (a list of chat messages) or "prompt" (a string); '
            "the row has neither (its fields: 'id', 'text')",
        ),
        ({}, "the row has neither (its fields: none)"),
        ({"messages": "hi"}, '"messages" must be a list of messages, got a string'),
        ({"messages": {"role": "user"}}, '"messages" must be a list of messages, got an object'),
        ({"messages": []}, '"messages" is an empty list'),
        ({"prompt": ""}, '"prompt" is empty'),
        ({"prompt": "  \n "}, '"prompt" is empty'),
        ({"prompt": ["a"]}, '"prompt" must be a string, got a list'),
    ],
)
def test_a_row_needs_exactly_one_of_messages_or_prompt(data: dict[str, Any], expected: str) -> None:
    assert expected in problem_of(data)


@pytest.mark.parametrize(
    ("messages", "expected"),
    [
        ([USER, "hi"], "messages[1] must be an object, got a string"),
        ([{"content": "x"}], 'messages[0] has no "role"'),
        (
            [USER, {"role": "bot", "content": "x"}],
            "messages[1] has unknown role 'bot'; expected one of system, developer, user, assistant, tool",
        ),
        ([{"role": "user"}], 'messages[0] (user) has no "content"'),
        ([{"role": "user", "content": None}], 'messages[0] (user) has no "content"'),
        ([USER, {"role": "assistant", "content": ""}], "messages[1] (assistant) has empty content"),
        ([{"role": "system", "content": " \t\n"}], "messages[0] (system) has empty content"),
        (
            [{"role": "user", "content": 5}],
            "messages[0] (user) content must be a string or a list of text parts, got a number",
        ),
        (
            [{"role": "user", "content": []}],
            "messages[0] (user) has empty content (an empty list of parts)",
        ),
        (
            [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "u"}}]}],
            "messages[0] (user) content[0] has type 'image_url'; only text parts are accepted",
        ),
        (
            [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": ""}]}],
            "messages[0] (user) content[1] has empty text",
        ),
        (
            [{"role": "user", "content": ["plain"]}],
            "messages[0] (user) content[0] must be an object, got a string",
        ),
        (
            [{"role": "user", "content": "x", "blob": b"\x00"}],
            "messages cannot be stored as JSON: Type is not JSON serializable: bytes",
        ),
    ],
)
def test_each_message_is_checked_and_named_by_index(messages: list[Any], expected: str) -> None:
    assert problem_of({"messages": messages}) == expected


# --- scalar fields -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "shown"),
    [(0, "0"), (-5, "-5"), (True, "True"), (12.0, "12.0"), ("100", "'100'"), ([1], "[1]")],
)
def test_max_tokens_must_be_a_positive_integer(value: Any, shown: str) -> None:
    assert problem_of({"prompt": "p", "max_tokens": value}) == (
        f'"max_tokens" must be a positive integer, got {shown}'
    )


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("", '"id" is an empty string'),
        ("   ", '"id" is an empty string'),
        (1.5, '"id" must be a string or an integer, got 1.5'),
        (False, '"id" must be a string or an integer, got False'),
        ({"a": 1}, "\"id\" must be a string or an integer, got {'a': 1}"),
    ],
)
def test_id_must_be_a_non_empty_string_or_an_integer(value: Any, expected: str) -> None:
    assert problem_of({"prompt": "p", "id": value}) == expected


@pytest.mark.parametrize(
    ("field", "value", "expected"),
    [
        ("temperature", -0.1, '"temperature" must be a number >= 0, got -0.1'),
        ("temperature", "hot", "\"temperature\" must be a number >= 0, got 'hot'"),
        ("temperature", float("nan"), '"temperature" must be a number >= 0, got nan'),
        ("top_p", 0, '"top_p" must be a number in (0, 1], got 0'),
        ("top_p", 1.5, '"top_p" must be a number in (0, 1], got 1.5'),
        ("top_p", True, '"top_p" must be a number in (0, 1], got True'),
        ("seed", 1.0, '"seed" must be a 64-bit integer, got 1.0'),
        ("seed", "7", "\"seed\" must be a 64-bit integer, got '7'"),
    ],
)
def test_sampling_overrides_are_checked(field: str, value: Any, expected: str) -> None:
    assert problem_of({"prompt": "p", field: value}) == expected


def test_a_long_bad_value_is_shown_cut_short() -> None:
    problem = problem_of({"prompt": "p", "max_tokens": "9" * 500})

    assert problem.startswith('"max_tokens" must be a positive integer, got \'9999')
    assert problem.endswith("...")
    assert len(problem) < 120


# --- metadata ------------------------------------------------------------------------------------


@pytest.mark.parametrize(("value", "kind"), [([1, 2], "a list"), ("x", "a string"), (3, "a number")])
def test_metadata_must_be_an_object(value: Any, kind: str) -> None:
    assert problem_of({"prompt": "p", "metadata": value}) == f'"metadata" must be an object, got {kind}'


def test_an_unknown_field_that_collides_with_a_metadata_key_is_refused() -> None:
    assert problem_of({"prompt": "p", "metadata": {"lang": "en"}, "lang": "fr"}) == (
        "field 'lang' is both a top-level field and a key of \"metadata\"; rename one"
    )


def test_metadata_that_cannot_be_stored_as_json_is_refused_by_row() -> None:
    assert problem_of({"prompt": "p", "price": Decimal("1.5")}) == (
        "metadata cannot be stored as JSON: Type is not JSON serializable: decimal.Decimal"
    )


# --- token estimate ------------------------------------------------------------------------------


def test_estimate_is_utf8_bytes_over_four_rounded_up_plus_four_per_message() -> None:
    messages = [
        {"role": "system", "content": "abcde"},  # 5 bytes
        {"role": "user", "content": "é☃"},  # 2 + 3 bytes
        {"role": "user", "content": [{"type": "text", "text": "abc"}, {"type": "text", "text": "d"}]},
    ]

    assert estimate_prompt_tokens(messages) == 4 + 4 * 3  # ceil(14 / 4) + 12


def test_estimate_is_deterministic_and_grows_with_the_prompt() -> None:
    short = normalize_row(SRC, {"prompt": "x" * 400}).messages
    long = normalize_row(SRC, {"prompt": "x" * 40_000}).messages

    assert estimate_prompt_tokens(short) == estimate_prompt_tokens(short) == 104
    assert estimate_prompt_tokens(long) == 10_004
