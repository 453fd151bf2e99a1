"""The per-job quality flags and stop rules (tokenmill/quality.py): pure, on real texts."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path
from typing import Any

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from tokenmill import quality as q
from tokenmill.errors import ConfigError
from tokenmill.lengths import bin_of, edge

ROOT = Path(__file__).resolve().parent.parent
DOCS = sorted([ROOT / "README.md", *(ROOT / "docs").glob("*.md")])
STDLIB = [Path(json.__file__).parent / name for name in ("decoder.py", "encoder.py")] + [
    Path(textwrap.__file__)
]
PROSE = (ROOT / "docs" / "architecture.md").read_text()[:3000]


def reference_share(text: str) -> float:
    """loop_share by its definition, character by character."""
    n, best = len(text), 0
    for p in range(1, n // q.LOOP_COPIES + 1):
        covered = p
        while covered < n and text[n - covered - 1] == text[n - covered - 1 + p]:
            covered += 1
        if covered >= q.LOOP_COPIES * p:
            best = max(best, covered)
    return best / n if best >= q.LOOP_MIN_CHARS else 0.0


# degenerate outputs as models write them when they loop until max_tokens cuts them
LOOPS = {
    "apology": PROSE + "I'm sorry, but I can't assist with that request. " * 60,
    "table row": PROSE[:1500]
    + "\n\n| date | open | close |\n|---|---|---|\n"
    + "| 2023-01-01 | 0.00 | 0.00 |\n" * 40
    + "| 2023-01",
    "newlines": PROSE + "\n" * 2000,
    "spaces in JSON": '{"answer": "' + PROSE[:800] + '"' + " " * 1500,
    "code line": "def f(x):\n" + "    x = x + 1\n" * 300,
    "cjk": PROSE[:2000] + "这是一个非常重要的问题。" * 150,
}


@pytest.mark.parametrize("name", sorted(LOOPS))
def test_a_looping_output_crosses_the_threshold(name: str) -> None:
    text = LOOPS[name]
    share = q.loop_share(text)
    assert share >= q.REPETITION_SHARE, (name, share)
    assert share == pytest.approx(reference_share(text))
    assert q.flags({"content": text, "finish_reason": "length"}, {}, None) & q.REPETITION


def line_ends(text: str) -> list[str]:
    """Every prefix of ``text`` that ends a line, past the first 200 characters: each an output
    the model could have ended there."""
    return [text[: i + 1] for i, ch in enumerate(text) if ch == "\n" and i >= 200] + [text]


@pytest.mark.parametrize("path", DOCS + STDLIB, ids=lambda p: p.name.replace("-", "_"))
def test_prose_code_lists_and_tables_do_not(path: Path) -> None:
    # the repository's docs (prose, bullet lists, markdown tables, code blocks) and Python's own
    # sources, cut at every line
    outputs = line_ends(path.read_text())
    worst = max(outputs, key=q.loop_share)
    assert q.loop_share(worst) < 0.1, worst[-300:]
    assert not q.flags({"content": worst, "finish_reason": "stop"}, {}, None) & q.REPETITION


def test_short_runs_are_no_loop() -> None:
    assert q.loop_share("Wait...") == 0.0
    assert q.loop_share("Ha ha ha ha ha ha ha!!!!!!!!") == 0.0
    assert q.loop_share("Title\n" + "=" * 40) == 0.0  # under 48 characters
    assert q.loop_share("") == 0.0


@settings(max_examples=300, deadline=None)
@example(prefix="", block="ab" * 40 + "c" + "ab" * 100, copies=4, cut=0)  # a loop inside the block
@given(
    prefix=st.text("abc ", max_size=60),
    block=st.text("abc ", min_size=1, max_size=40),
    copies=st.integers(1, 12),
    cut=st.integers(0, 40),
)
def test_loop_share_is_its_definition(prefix: str, block: str, copies: int, cut: int) -> None:
    # a small alphabet makes blocks with inner repeats, and prefixes that continue the loop
    text = prefix + (block * copies)[: max(0, len(block) * copies - cut)]
    assert q.loop_share(text) == pytest.approx(reference_share(text))


@settings(max_examples=200, deadline=None)
@given(st.text(max_size=400))
def test_loop_share_is_a_share(text: str) -> None:
    assert 0.0 <= q.loop_share(text) <= 1.0


SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
    "required": ["name"],
}
JSON_SCHEMA = {"response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMA}}}
TOOLS = {
    "tools": [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "parameters": {
                    "type": "object",
                    "properties": {"city": {"type": "string"}},
                    "required": ["city"],
                },
            },
        },
        {"type": "function", "function": {"name": "now"}},
    ]
}


def result(content: str | None = "An answer.", **kw: Any) -> dict[str, Any]:
    return {"content": content, "finish_reason": "stop", "usage": {"completion_tokens": 10}, **kw}


def call(name: str, arguments: str) -> dict[str, Any]:
    return {"id": "c", "type": "function", "function": {"name": name, "arguments": arguments}}


def test_finish_and_empty_flags() -> None:
    assert q.flags(result(), {}, None) == 0
    assert q.flags(result(finish_reason="length"), {}, None) == q.LENGTH
    assert q.flags(result(" \n "), {}, None) == q.EMPTY
    assert q.flags(result("", reasoning_content="Let me think. " * 3), {}, None) == q.EMPTY
    assert q.flags(result(None, tool_calls=[call("now", "{}")]), TOOLS, None) == 0


@pytest.mark.parametrize(
    ("request_", "content", "bad"),
    [
        (JSON_SCHEMA, '{"name": "Ann", "age": 3}', False),
        (JSON_SCHEMA, '{"age": 3}', True),  # a required property missing
        (JSON_SCHEMA, '{"name": "Ann", "age": "3"}', True),
        (JSON_SCHEMA, '{"name": "Ann"', True),  # cut: not JSON
        (JSON_SCHEMA, '{"name": "Ann", "age": 123456789012345678901234567890}', False),
        ({"response_format": {"type": "json_object"}}, '{"a": 1e400}', False),  # beyond orjson
        (JSON_SCHEMA, '{"name": "Ann", "age": NaN}', True),
        ({"response_format": {"type": "json_schema", "schema": SCHEMA}}, '{"age": 1}', True),  # SGLang's form
        ({"response_format": {"type": "json_object"}}, '{"a": [1]}', False),
        ({"response_format": {"type": "json_object"}}, "[1, 2]", True),
        ({"response_format": {"type": "text"}}, "anything", False),
        ({"regex": r"\d{3}-\d{4}"}, "555-1234", False),
        ({"regex": r"\d{3}-\d{4}"}, "555-1234\n", True),
        ({"ebnf": 'root ::= "yes"'}, "no", False),  # not judged
    ],
)
def test_structured_outputs(request_: dict[str, Any], content: str, bad: bool) -> None:
    assert q.flags(result(content), request_, None) == (q.INVALID_STRUCTURED if bad else 0)


@pytest.mark.parametrize(
    ("calls", "bad"),
    [
        ([call("get_weather", '{"city": "Oslo"}'), call("now", "{}")], False),
        ([call("get_wether", '{"city": "Oslo"}')], True),  # no such tool
        ([call("get_weather", '{"city": "Oslo"')], True),  # not JSON
        ([call("get_weather", '{"town": "Oslo"}')], True),  # fails the tool's parameters
        ([call("get_weather", '{"city": 7}')], True),
    ],
)
def test_tool_calls(calls: list[dict[str, Any]], bad: bool) -> None:
    assert q.flags(result("", tool_calls=calls, finish_reason="tool_calls"), TOOLS, None) == (
        q.TOOL_CALL_ERRORS if bad else 0
    )


def test_validators_are_compiled_once_per_schema() -> None:
    q._validator.cache_clear()
    reordered = {"required": ["name"], "properties": SCHEMA["properties"], "type": "object"}
    for schema in (SCHEMA, reordered, SCHEMA):
        request = {"response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": schema}}}
        q.flags(result('{"name": "x"}'), request, None)
    info = q._validator.cache_info()
    assert (info.misses, info.hits) == (1, 2)
    assert info.maxsize == q.SCHEMAS_CACHED


def test_length_bounds_from_a_histogram() -> None:
    assert q.LengthBounds.from_histogram({bin_of(100): 199}) is None
    counts = {bin_of(5): 1, bin_of(100): 196, bin_of(300): 1, bin_of(2000): 2}
    bounds = q.LengthBounds.from_histogram(counts)
    assert bounds == q.LengthBounds(edge(bin_of(100)), edge(bin_of(300) + 1))
    usage = {"completion_tokens": 5}
    assert q.flags(result(usage=usage), {}, bounds) == q.LENGTH_DRIFT
    assert q.flags(result(usage={"completion_tokens": 100}), {}, bounds) == 0
    assert q.flags(result(usage={"completion_tokens": 2000}), {}, bounds) == q.LENGTH_DRIFT
    assert q.flags(result(usage=usage), {}, None) == 0
    assert [bounds.outside(n) for n in (bounds.lo - 1, bounds.lo, bounds.hi - 1, bounds.hi)] == [
        True,
        False,
        False,
        True,
    ]


@settings(max_examples=200, deadline=None)
@given(st.dictionaries(st.integers(0, 120), st.integers(1, 400), min_size=1))
def test_length_bounds_leave_out_at_most_one_percent_each_side(counts: dict[int, int]) -> None:
    bounds = q.LengthBounds.from_histogram(counts)
    total = sum(counts.values())
    if total < q.MIN_HISTOGRAM_JOBS:
        assert bounds is None
        return
    assert bounds is not None
    below = sum(n for b, n in counts.items() if edge(b + 1) <= bounds.lo)
    above = sum(n for b, n in counts.items() if edge(b) >= bounds.hi)
    assert below < 0.01 * total and above <= 0.01 * total


@pytest.mark.parametrize(
    ("expr", "rule"),
    [
        ("repetition>0.05@200", q.Rule("repetition", ">", 0.05, 200)),
        ("length_share>0.3", q.Rule("length_share", ">", 0.3, q.DEFAULT_MIN_JOBS)),
        (" drift < -0.5 @ 10 ", q.Rule("drift", "<", -0.5, 10)),
        ("empty_share>1e-2@1", q.Rule("empty_share", ">", 0.01, 1)),
    ],
)
def test_parse_rule(expr: str, rule: q.Rule) -> None:
    assert q.parse_rule(expr) == rule
    assert q.parse_rule(str(rule)) == rule


@pytest.mark.parametrize(
    ("expr", "says"),
    [
        ("repetiton>0.05", "unknown signal 'repetiton'; known: length_share, empty_share, repetition"),
        ("repetition=0.05", "write NAME>VALUE or NAME<VALUE"),
        ("repetition", "write NAME>VALUE or NAME<VALUE"),
        ("repetition>lots", "the value 'lots' is not a number"),
        ("repetition>nan", "the value 'nan' is not a number"),
        ("repetition>", "the value '' is not a number"),
        ("repetition>0.05@0", "positive whole number, got '0'"),
        ("repetition>0.05@-3", "positive whole number, got '-3'"),
        ("repetition>0.05@2.5", "positive whole number, got '2.5'"),
        ("repetition>0.05@", "positive whole number, got ''"),
    ],
)
def test_bad_rules_are_named(expr: str, says: str) -> None:
    with pytest.raises(ConfigError) as info:
        q.parse_rule(expr)
    assert f"quality rule {expr!r}" in str(info.value) and says in str(info.value)


def test_rule_trips() -> None:
    rule = q.parse_rule("repetition>0.05@200")
    assert not rule.trips(0.9, 199)
    assert rule.trips(0.051, 200)
    assert not rule.trips(0.05, 500)
    assert not rule.trips(None, 500)
    assert q.parse_rule("drift<0.2@5").trips(0.1, 5)
    assert set(q.RATE_NAMES.values()) == set(q.SIGNALS) and q.RULE_NAMES[-1] == "drift"
