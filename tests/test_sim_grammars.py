"""The sim's grammar outputs: every JSON value validates against its schema, every regex output
matches, every EBNF output parses, and a bad grammar is refused with SGLang's wording."""

from __future__ import annotations

import json
import random
import re

import jsonschema
import pytest

from server_mgr.sim import ebnf, schemagen, tokens, toolcalls
from server_mgr.sim.options import Constraint, grammar_error

SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]},
    {
        "type": "object",
        "properties": {
            "name": {"type": "string", "minLength": 3, "maxLength": 8},
            "age": {"type": "integer", "minimum": 18, "exclusiveMaximum": 30},
            "score": {"type": "number", "exclusiveMinimum": 0, "maximum": 1},
            "step": {"type": "integer", "multipleOf": 5, "minimum": 7, "maximum": 40},
            "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "minItems": 1, "uniqueItems": True},
            "kind": {"const": "person"},
            "when": {"type": "string", "format": "date-time"},
            "code": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{3}$"},
            "maybe": {"type": ["null", "boolean"]},
            "pick": {"anyOf": [{"type": "integer"}, {"type": "string", "maxLength": 3}]},
            "pair": {
                "type": "array",
                "prefixItems": [{"type": "string"}, {"type": "integer"}],
                "minItems": 2,
            },
            "ref": {"$ref": "#/$defs/point"},
        },
        "required": ["name", "age", "score", "step", "tags", "kind", "code", "ref", "pair"],
        "additionalProperties": False,
        "$defs": {
            "point": {
                "type": "object",
                "properties": {"x": {"type": "number"}, "y": {"type": "number", "maximum": -5}},
                "required": ["x", "y"],
            }
        },
    },
    {
        "type": "array",
        "items": {"type": "object", "properties": {"v": {"type": "integer"}}, "required": ["v"]},
    },
    {"type": "object"},
]


@pytest.mark.parametrize("schema", SCHEMAS)
def test_every_generated_json_value_validates_against_its_schema(schema: dict) -> None:
    values = [schemagen.generate(schema, random.Random(seed)) for seed in range(40)]

    for value in values:
        jsonschema.validate(value, schema)
    assert schemagen.generate(schema, random.Random(7)) == schemagen.generate(schema, random.Random(7))


def test_optional_properties_appear_in_some_values_and_not_in_others() -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string"}}}
    keys = {tuple(sorted(schemagen.generate(schema, random.Random(s)))) for s in range(30)}

    assert len(keys) > 1, keys


GRAMMARS = [
    'root ::= "Answer: " ("yes" | "no") "."',
    'root ::= item ("," item){2,3}\nitem ::= [a-c]+ [0-9]? # comment\n',
    'root ::= "{" ws "\\"k\\"" ws ":" ws num ws "}"\nnum ::= "-"? [1-9] [0-9]*\nws ::= [ \\t]*',
]


@pytest.mark.parametrize("grammar", GRAMMARS)
def test_an_ebnf_output_is_a_sentence_of_its_grammar(grammar: str) -> None:
    as_regex = {
        GRAMMARS[0]: r"Answer: (yes|no)\.",
        GRAMMARS[1]: r"[a-c]+[0-9]?(,[a-c]+[0-9]?){2,3}",
        GRAMMARS[2]: r'\{[ \t]*"k"[ \t]*:[ \t]*-?[1-9][0-9]*[ \t]*\}',
    }[grammar]
    outputs = {ebnf.generate(grammar, random.Random(seed)) for seed in range(30)}

    assert all(re.fullmatch(as_regex, out) for out in outputs), outputs
    assert len(outputs) > 1


@pytest.mark.parametrize(
    ("kind", "spec"),
    [
        ("regex", "(unclosed"),
        ("ebnf", 'root ::= ( "a" '),
        ("ebnf", 'start ::= "a"'),
        ("ebnf", "root ::= missing"),
        ("json_schema", {"type": "frobnicate"}),
    ],
)
def test_a_grammar_that_does_not_compile_is_refused_naming_its_kind(kind: str, spec: object) -> None:
    message = grammar_error(Constraint(kind, spec))

    name = "json" if kind == "json_schema" else kind  # SGLang's name for it
    assert message is not None and message.startswith(f"Failed to compile {name} grammar: "), message


def test_a_grammar_that_compiles_is_accepted() -> None:
    assert grammar_error(Constraint("regex", "[a-z]+")) is None
    assert grammar_error(Constraint("ebnf", GRAMMARS[1])) is None
    assert grammar_error(Constraint("json_schema", SCHEMAS[1])) is None


def test_token_pieces_join_back_to_the_text_and_keep_vocabulary_words_whole() -> None:
    text = ' the cache {"name": "Zoë", "n": [1, 2]}\n  é 日本'
    pieces = tokens.pieces(text)

    assert "".join(pieces) == text
    assert " the" in pieces and " cache" in pieces
    assert len(pieces) > 10
    ids = tokens.ids(pieces)
    assert all(0 <= i < tokens.VOCAB_SIZE and i != tokens.EOS_TOKEN_ID for i in ids)


CALLS_TEXT = (
    '<tool_call>\n{"name":"get_weather", "arguments":{"city": "Zoë \\"x\\"", "unit": "c"}}\n</tool_call>\n'
    '<tool_call>\n{"name":"add", "arguments":{"a": 1, "b": 22}}\n</tool_call>'
)


@pytest.mark.parametrize("step", [1, 2, 3, 7, len(CALLS_TEXT)])
def test_streamed_tool_call_deltas_join_to_the_parsed_calls_however_the_text_is_cut(step: int) -> None:
    streamer = toolcalls.CallStreamer()
    deltas: list[dict] = []
    normal = ""
    for end in range(step, len(CALLS_TEXT) + step, step):
        text, new = streamer.feed(CALLS_TEXT[:end], final=end >= len(CALLS_TEXT))
        normal += text
        deltas += new
    _, calls = toolcalls.parse(CALLS_TEXT)

    assert normal == ""
    firsts = [d for d in deltas if d["id"]]
    assert [d["function"]["name"] for d in firsts] == ["get_weather", "add"]
    assert all(d["function"]["arguments"] == "" for d in firsts)
    joined = ["".join(d["function"]["arguments"] for d in deltas if d["index"] == i) for i in (0, 1)]
    assert joined == [c.arguments for c in calls]
    assert json.loads(joined[0]) == {"city": 'Zoë "x"', "unit": "c"}


def test_text_before_a_tool_call_is_streamed_as_content_and_a_marker_is_held_back() -> None:
    streamer = toolcalls.CallStreamer()

    first, _ = streamer.feed("Let me check. <tool_c", final=False)
    call = '<tool_call>\n{"name":"add", "arguments":{"a": 1}}'
    rest, deltas = streamer.feed("Let me check. " + call, final=False)

    assert first == "Let me check. " and rest == "" and deltas[0]["function"]["name"] == "add"
    assert toolcalls.parse("Let me check. " + CALLS_TEXT)[0] == "Let me check."
