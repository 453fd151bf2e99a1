"""The ledger's protocol (tokenmill/transitions.py) without Redis: the job hash's fields are named
once, and every field a Lua script reads or writes on the job hash is one of them."""

from __future__ import annotations

import re

from tests.procs import ROOT
from tokenmill import keys
from tokenmill import transitions as t

# the expression that names the job's hash in each script that touches it
JOB_KEY = {
    "KEYS[1]": ("claim", "commit", "fail", "heartbeat", "promote", "reap", "release", "start"),
    "job": ("cancel", "enqueue", "retry"),
    "KEYS[i]": ("seal", "unseal"),
}
# the scripts whose hash commands are on other hashes (a manifest, a server's, the pause): no job's
TOUCH_NO_JOB = (
    "admit feed finish pause qref_sample seal_reserve series unadmit unpause wait window_state".split()
)
HASH_CALL = re.compile(r"redis\.p?call\('(H[A-Z]+)',\s*|\bbump\(()")


def _arguments(src: str, start: int) -> list[str]:
    """The comma-separated arguments of the call whose ``(`` ends just before ``start``."""
    depth, args, cur = 0, [], ""
    for ch in src[start:]:
        if ch in "({":
            depth += 1
        elif ch in ")}":
            if depth == 0:
                return [*args, cur.strip()]
            depth -= 1
        if ch == "," and depth == 0:
            args, cur = [*args, cur.strip()], ""
        else:
            cur += ch
    raise AssertionError("unbalanced call")


def job_fields_in_scripts() -> dict[str, set[str]]:
    """Each literal field name a script reads or writes on the job hash (HGET, HMGET, HSET's
    fields, HDEL, the prelude's ``bump``), with the scripts that name it."""
    found: dict[str, set[str]] = {}
    for job_key, names in JOB_KEY.items():
        for name in names:
            src = re.sub(r"--[^\n]*", "", (ROOT / "tokenmill" / "lua" / f"{name}.lua").read_text())
            for m in HASH_CALL.finditer(src):
                command, args = m.group(1) or "BUMP", _arguments(src, m.end())
                if args[0] != job_key:
                    continue
                fields = (
                    args[1::2]
                    if command in ("HSET", "HSETNX")
                    else args[1:2]
                    if command == "BUMP"
                    else args[1:]
                )
                for field in fields:
                    if re.fullmatch(r"'[^']*'", field):
                        found.setdefault(field.strip("'"), set()).add(name)
    return found


def test_every_job_field_a_script_names_is_a_constant_of_the_protocol() -> None:
    found = job_fields_in_scripts()
    assert len(found) >= 25, f"the scan found too few fields to be reading the scripts: {sorted(found)}"
    unnamed = {field: sorted(scripts) for field, scripts in found.items() if field not in t.JOB_FIELDS}
    assert unnamed == {}, "job hash fields the scripts use that tokenmill.transitions.JobField lacks"
    assert set(found) == t.JOB_FIELDS, "a JobField constant that no script uses"


def test_every_script_is_read_for_job_fields_or_named_as_touching_none() -> None:
    scanned = {name for names in JOB_KEY.values() for name in names}
    assert scanned | set(TOUCH_NO_JOB) == set(t.SCRIPT_NAMES), "a script neither scanned nor named"
    assert not scanned & set(TOUCH_NO_JOB)


def test_text_reads_bytes_strings_and_numbers() -> None:
    assert [t.text(b"ok"), t.text("ok"), t.text(3)] == ["ok", "ok", "3"]


def test_a_call_is_data_its_decoder_reads_the_reply() -> None:
    k = keys.RunKeys("r")
    peek = t.peek(k, "j")
    assert (peek.script, peek.args) == ("", ["HMGET", k.job("j"), *t.PEEK_FIELDS])
    assert peek.decode([b"queued", b'{"request": {}}', None, b"2"]) == t.Peek(
        "queued", {"request": {}}, "short", 2
    )
    assert peek.decode([None, None, None, None]) is None
    wait = t.wait(k, "j", 1.5, hold=False)
    assert (wait.script, wait.keys, wait.args) == ("wait", [k.waiting()], ["j", 0, 1500])
