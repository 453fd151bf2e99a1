"""A string of an EBNF grammar in SGLang's (xgrammar's GBNF) notation, drawn from a seeded RNG.

What the sim answers to an ``ebnf`` request: one sentence of the grammar, the same for the same
request. The notation covered is what grammars for structured output use: ``name ::= ...``
rules (``root`` is the start), ``"literals"`` with escapes, ``[character classes]`` with ranges
and ``^``, rule references, ``( ... )`` groups, ``|``, the ``? * +`` and ``{m,n}``
repetitions, and ``#`` comments. A grammar outside it is refused like a grammar xgrammar cannot
compile.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass
from typing import Any

_TOKEN = re.compile(
    r"""\s+|\#[^\n]*
    |(?P<define>::=)
    |(?P<name>[A-Za-z_][A-Za-z0-9_\-.]*)
    |(?P<string>"(?:\\.|[^"\\])*")
    |(?P<cls>\[(?:\\.|[^\]\\])*\])
    |(?P<repeat>\{\s*\d*\s*(?:,\s*\d*\s*)?\})
    |(?P<op>[|()?*+])
    """,
    re.VERBOSE,
)
_ESCAPES = {"n": "\n", "t": "\t", "r": "\r", "\\": "\\", '"': '"', "]": "]", "[": "[", "-": "-", "^": "^"}
MAX_DEPTH = 24
EXTRA_REPEATS = 2  # a `*`, `+` or open `{m,}` adds at most this many beyond its minimum


class GrammarError(ValueError):
    """The grammar does not parse."""


@dataclass(frozen=True, slots=True)
class Node:
    kind: str  # "lit", "cls", "ref", "seq", "alt", "rep"
    value: Any = None
    low: int = 0
    high: int = 0


def _unescape(body: str) -> str:
    out, i = [], 0
    while i < len(body):
        ch = body[i]
        if ch != "\\":
            out.append(ch)
            i += 1
            continue
        nxt = body[i + 1 : i + 2]
        if nxt in ("x", "u", "U"):
            width = {"x": 2, "u": 4, "U": 8}[nxt]
            out.append(chr(int(body[i + 2 : i + 2 + width], 16)))
            i += 2 + width
        else:
            out.append(_ESCAPES.get(nxt, nxt))
            i += 2
    return "".join(out)


def _char_class(body: str) -> tuple[bool, list[tuple[str, str]]]:
    """(negated, ranges) of a ``[...]`` body."""
    negated = body.startswith("^")
    chars = _unescape_class(body[1:] if negated else body)
    ranges, i = [], 0
    while i < len(chars):
        if i + 2 < len(chars) and chars[i + 1] == ("-", False):
            ranges.append((chars[i][0], chars[i + 2][0]))
            i += 3
        else:
            ranges.append((chars[i][0], chars[i][0]))
            i += 1
    return negated, ranges


def _unescape_class(body: str) -> list[tuple[str, bool]]:
    """The characters of a class body, each marked True when it was escaped."""
    out, i = [], 0
    while i < len(body):
        if body[i] == "\\":
            end = i + 2
            if body[i + 1 : i + 2] in ("x", "u", "U"):
                end = i + 2 + {"x": 2, "u": 4, "U": 8}[body[i + 1]]
            out.append((_unescape(body[i:end]), True))
            i = end
        else:
            out.append((body[i], False))
            i += 1
    return out


class _Parser:
    def __init__(self, text: str) -> None:
        self.tokens: list[tuple[str, str]] = []
        pos = 0
        while pos < len(text):
            m = _TOKEN.match(text, pos)
            if not m:
                raise GrammarError(f"unexpected character {text[pos]!r} at position {pos}")
            pos = m.end()
            if m.lastgroup:
                self.tokens.append((m.lastgroup, m.group(m.lastgroup)))
        self.i = 0

    def _column(self) -> int:
        """Roughly where parsing stopped (xgrammar reports line and column; the sim, a column
        past the last token)."""
        return sum(len(text) + 1 for _, text in self.tokens[: self.i]) + 1

    def peek(self, offset: int = 0) -> tuple[str, str] | None:
        j = self.i + offset
        return self.tokens[j] if j < len(self.tokens) else None

    def take(self) -> tuple[str, str]:
        tok = self.peek()
        if tok is None:
            raise GrammarError(f"line 1, column {self._column()}: Expect )")
        self.i += 1
        return tok

    def rules(self) -> dict[str, Node]:
        rules: dict[str, Node] = {}
        while self.peek():
            kind, name = self.take()
            if kind != "name" or self.take()[0] != "define":
                raise GrammarError(f"expected `name ::=` at {name!r}")
            rules[name] = self.alternatives()
        if "root" not in rules:
            raise GrammarError('line 1, column 1: The root rule with name "root" is not found')
        for node in rules.values():
            _check_refs(node, rules)
        return rules

    def _rule_starts(self) -> bool:
        nxt, after = self.peek(), self.peek(1)
        return bool(nxt and nxt[0] == "name" and after and after[0] == "define")

    def alternatives(self) -> Node:
        options = [self.sequence()]
        while (tok := self.peek()) and tok == ("op", "|"):
            self.take()
            options.append(self.sequence())
        return options[0] if len(options) == 1 else Node("alt", options)

    def sequence(self) -> Node:
        items: list[Node] = []
        while (tok := self.peek()) and tok not in (("op", "|"), ("op", ")")) and not self._rule_starts():
            items.append(self.item())
        return Node("seq", items)

    def item(self) -> Node:
        node = self.atom()
        tok = self.peek()
        if tok and tok[0] == "op" and tok[1] in "?*+":
            self.take()
            low, high = {"?": (0, 1), "*": (0, -1), "+": (1, -1)}[tok[1]]
            return Node("rep", node, low, high)
        if tok and tok[0] == "repeat":
            self.take()
            low_s, _, high_s = tok[1].strip("{} ").partition(",")
            low = int(low_s or 0)
            high = low if "," not in tok[1] else int(high_s) if high_s.strip() else -1
            return Node("rep", node, low, high)
        return node

    def atom(self) -> Node:
        kind, text = self.take()
        if kind == "string":
            return Node("lit", _unescape(text[1:-1]))
        if kind == "cls":
            return Node("cls", _char_class(text[1:-1]))
        if kind == "name":
            return Node("ref", text)
        if (kind, text) == ("op", "("):
            inner = self.alternatives()
            if self.take() != ("op", ")"):
                raise GrammarError(f"line 1, column {self._column()}: Expect )")
            return inner
        raise GrammarError(f"unexpected {text!r}")


def _check_refs(node: Node, rules: dict[str, Node]) -> None:
    if node.kind == "ref" and node.value not in rules:
        raise GrammarError(f'line 1, column 1: Rule "{node.value}" is not defined')
    if node.kind in ("seq", "alt"):
        for child in node.value:
            _check_refs(child, rules)
    if node.kind == "rep":
        _check_refs(node.value, rules)


def parse(text: str) -> dict[str, Node]:
    """The rules of ``text``; GrammarError names what does not parse."""
    return _Parser(text).rules()


def generate(text: str, rng: random.Random) -> str:
    """One string of the grammar ``text``, the same for the same RNG state."""
    rules = parse(text)
    out: list[str] = []
    _emit(rules["root"], rules, rng, out, 0)
    return "".join(out)


def _emit(node: Node, rules: dict[str, Node], rng: random.Random, out: list[str], depth: int) -> None:
    deep = depth > MAX_DEPTH  # past it: first alternatives and fewest repeats, so it ends
    if node.kind == "lit":
        out.append(node.value)
    elif node.kind == "cls":
        out.append(_class_char(node.value, rng))
    elif node.kind == "ref":
        _emit(rules[node.value], rules, rng, out, depth + 1)
    elif node.kind == "seq":
        for child in node.value:
            _emit(child, rules, rng, out, depth)
    elif node.kind == "alt":
        _emit(node.value[0] if deep else rng.choice(node.value), rules, rng, out, depth + 1)
    elif node.kind == "rep":
        high = node.low + EXTRA_REPEATS if node.high < 0 else node.high
        for _ in range(node.low if deep else rng.randint(node.low, max(node.low, high))):
            _emit(node.value, rules, rng, out, depth + 1)


def _class_char(spec: tuple[bool, list[tuple[str, str]]], rng: random.Random) -> str:
    negated, ranges = spec
    if not negated:
        low, high = rng.choice(ranges)
        return chr(rng.randint(ord(low), ord(high)))
    for _ in range(100):
        ch = chr(rng.randint(0x20, 0x7E))
        if not any(lo <= ch <= hi for lo, hi in ranges):
            return ch
    return "~"
