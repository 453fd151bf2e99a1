"""Tool calls: the text the model writes for them, and how SGLang 0.5.23 reads it back.

With ``--tool-call-parser`` (the sim knows the Qwen 2.5 / Hermes format: ``qwen25``, ``qwen``,
``hermes``), a call is written as ``<tool_call>\\n{"name":"NAME", "arguments":{...}}\\n</tool_call>``
(the ``begin`` of SGLang's structural tag for that parser), several separated by ``\\n``, and
the response carries them as ``tool_calls`` (``finish_reason: "tool_calls"``). Without a
parser, SGLang parses nothing: ``required`` or a named function constrains the output to a
JSON array ``[{"name": ..., "parameters": {...}}]`` that stays in ``content``.

Streaming follows SGLang's parser: a call's first delta carries ``id``, ``type``, ``index`` and
``function.name`` with empty ``arguments``; later deltas carry ``index`` and pieces of
``arguments`` only. The pieces join to the non-streamed ``arguments`` (``json.dumps`` of the
parsed value, ``ensure_ascii=False``), which is what SGLang sends both ways.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from server_mgr.sim import schemagen
from server_mgr.sim.options import Options, rng_for

BOT = "<tool_call>\n"
EOT = "\n</tool_call>"


@dataclass(frozen=True, slots=True)
class Call:
    name: str
    arguments: str  # as SGLang sends it: json.dumps of the parsed arguments


def planned_calls(opts: Options, key: bytes) -> list[tuple[str, Any]]:
    """(name, arguments) of the calls this request makes: the named function, or one or two of
    the tools (one without ``parallel_tool_calls``), with arguments drawn from their schemas."""
    rng = rng_for(key, "tools", [t["function"]["name"] for t in opts.tools])
    by_name = {t["function"]["name"]: t["function"] for t in opts.tools}
    if opts.tool_choice == "named" and opts.tool_name is not None and opts.tool_name in by_name:
        names = [opts.tool_name]
    else:
        count = 1 if not opts.parallel_tool_calls else rng.choice((1, 1, 2))
        names = [rng.choice(list(by_name)) for _ in range(count)]
    calls = []
    for name in names:
        params = by_name[name].get("parameters")
        args = schemagen.generate(params, rng) if isinstance(params, dict) and params else {}
        calls.append((name, args))
    return calls


def render(calls: list[tuple[str, Any]], parser: str | None) -> str:
    """The text the model writes for ``calls``."""
    if parser is None:
        return json.dumps([{"name": n, "parameters": a} for n, a in calls], ensure_ascii=False)
    return "\n".join(
        BOT + '{"name":"' + n + '", "arguments":' + json.dumps(a, ensure_ascii=False) + "}" + EOT
        for n, a in calls
    )


def parse(text: str) -> tuple[str, list[Call]]:
    """(normal text, calls) of a finished output, as SGLang reads it with the Qwen 2.5 parser:
    the text before the first call, stripped; every ``<tool_call>`` block that parses, and a
    last block cut by ``max_tokens`` once its arguments are a whole JSON value (measured: cut
    after ``"arguments":Infinity`` it was a call, cut inside an object it was dropped)."""
    idx = text.find(BOT)
    if idx == -1:
        return text, []
    calls = []
    blocks = text[idx:].split(BOT)[1:]
    for i, block in enumerate(blocks):
        closed = EOT in block
        if closed:
            try:
                obj = json.loads(block[: block.index(EOT)].strip())
            except json.JSONDecodeError:
                continue
            if isinstance(obj, dict) and isinstance(obj.get("name"), str):
                args = obj.get("arguments", obj.get("parameters", {}))
                calls.append(Call(obj["name"], json.dumps(args, ensure_ascii=False)))
        elif i == len(blocks) - 1:
            cut = _cut_call(block)
            if cut is not None:
                calls.append(cut)
    return text[:idx].strip(), calls


def _cut_call(block: str) -> Call | None:
    """The call of a block cut before its end, when its name and arguments are whole."""
    name_m = re.match(r'\s*\{"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"(?:arguments|parameters)"\s*:', block)
    if not name_m:
        return None
    try:
        value, _ = json.JSONDecoder().raw_decode(block[name_m.end() :].lstrip())
    except json.JSONDecodeError:
        return None
    return Call(json.loads(f'"{name_m[1]}"'), json.dumps(value, ensure_ascii=False))


def call_id() -> str:
    """SGLang's id for a call (a fresh uuid each response, as there)."""
    return f"call_{uuid.uuid4().hex[:24]}"


def response_calls(calls: list[Call]) -> list[dict[str, Any]]:
    """``message.tool_calls`` of a non-streamed response."""
    return [
        {
            "id": call_id(),
            "index": i,
            "type": "function",
            "function": {"name": c.name, "arguments": c.arguments},
        }
        for i, c in enumerate(calls)
    ]


@dataclass(slots=True)
class CallStreamer:
    """Turns the growing output text into SGLang's streamed tool-call deltas."""

    normal_sent: int = 0  # chars of normal text (before the first call) already sent
    names_sent: int = 0
    args_sent: list[int] = field(default_factory=list)

    def feed(self, text: str, final: bool) -> tuple[str, list[dict[str, Any]]]:
        """(normal text delta, tool-call deltas) for the output text so far."""
        idx = text.find(BOT)
        normal_end = len(text) if idx == -1 else idx
        if idx == -1 and not final:
            # hold back what may be the start of a call marker
            normal_end = _safe_end(text)
        normal = text[:normal_end]
        if idx != -1 or final:
            normal = normal.rstrip() if idx != -1 else normal
        delta = normal[self.normal_sent :] if self.names_sent == 0 else ""
        self.normal_sent = max(self.normal_sent, len(normal))
        if idx == -1:
            return delta, []
        return delta, self._calls(text[idx:], final)

    def _calls(self, region: str, final: bool) -> list[dict[str, Any]]:
        out = []
        for i, block in enumerate(region.split(BOT)[1:]):
            name_m = re.match(r'\s*\{"name"\s*:\s*"((?:[^"\\]|\\.)*)"', block)
            if not name_m:
                break
            if i == self.names_sent:
                out.append(
                    {
                        "id": call_id(),
                        "index": i,
                        "type": "function",
                        "function": {"name": json.loads(f'"{name_m[1]}"'), "arguments": ""},
                    }
                )
                self.names_sent += 1
                self.args_sent.append(0)
            args = _arguments_so_far(block[name_m.end() :], final or EOT in block)
            if args is not None and len(args) > self.args_sent[i]:
                out.append(
                    {
                        "id": None,
                        "index": i,
                        "type": "function",
                        "function": {"name": None, "arguments": args[self.args_sent[i] :]},
                    }
                )
                self.args_sent[i] = len(args)
        return out


def _safe_end(text: str) -> int:
    """Where the text stops being possibly the start of ``<tool_call>``."""
    for k in range(min(len(BOT), len(text)), 0, -1):
        if BOT.startswith(text[-k:]):
            return len(text) - k
    return len(text)


def _arguments_so_far(rest: str, closed: bool) -> str | None:
    """The arguments text of a call up to what can be streamed: once the call is closed, its
    re-serialised value; before, the written text up to the last complete value."""
    m = re.match(r'\s*,\s*"(?:arguments|parameters)"\s*:\s*', rest)
    if not m:
        return None
    body = rest[m.end() :]
    if closed:
        end = body.rfind("}")
        try:
            return json.dumps(json.loads(body[:end]), ensure_ascii=False)
        except json.JSONDecodeError:
            return None
    # stream up to the last comma or colon outside a string: a settled prefix of the value
    cut, in_str, esc = 0, False, False
    for pos, ch in enumerate(body):
        if esc:
            esc = False
        elif ch == "\\":
            esc = True
        elif ch == '"':
            in_str = not in_str
        elif not in_str and ch in ",:":
            cut = pos
    return body[:cut] if cut else None
