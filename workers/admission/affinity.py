"""Prefix affinity: which of several servers a job is sent to, and when.

SGLang keeps the prompts it has prefilled in a radix cache, so a prompt whose leading tokens
another request already prefilled on the *same* server costs only its new tokens. Spread over
servers least-full first, the N samples of one prompt (``enqueue --samples N``) or the turns of
one conversation are prefilled once per server instead of once per run; and copies of a prompt
that reach one server together, in one prefill batch, are each prefilled in full (SGLang's
``fcfs`` scheduling does not hold a copy back for the other to be cached:
``#new-seq: 5, #new-token: 4096, #cached-token: 0`` in bench/servers.py). So each job has a
*prefix key*, and three rules use it:

1. **The first job of a key leads** (:data:`Prefills`). Its siblings in this process (jobs of
   the same key delivered while it has no first token yet) wait before they ask for a slot, up
   to ``server_prefill_wait_s`` (default 10 s), until its first token: by then its prompt is in
   its server's cache (SGLang sends the first chunk after the prefill). A job that ends without
   a token lets them go too.
2. **Siblings go home** (:class:`Homes`): to the server this process last admitted a job of
   their key on, within the last minute, where the prefix is cached; and the sibling admitted
   there holds only its own tokens of KV for admission (the prefix's pages are shared). When
   the home's window or budget refuses, the sibling spills only to a server emptier than the
   home by more than :data:`BALANCE_SLACK` of a budget; otherwise it waits for its home, and
   steps back in this process's line so that the jobs behind it may go elsewhere
   (:meth:`workers.admission.waitline.Turn.step_back`). A server where a sibling is *cold* (admitted,
   on its way to its first token, the prefix not cached there yet) is left out, its home too:
   two copies in one prefill batch both prefill it. ``server_affinity_wait_s`` (default 0)
   makes a sibling wait that long for its home alone, spilling nowhere.
3. **A key without a home goes to its preferred server** by rendezvous (highest-random-weight)
   hashing, the server with the highest ``blake2b(key, server name)``, unless that one is fuller
   than the least full by more than the slack: then least full first (bounded-load rendezvous;
   pure rendezvous put 10 of a run's first 12 keys on one server while the other idled).
   Rendezvous needs no shared state: every worker on every host ranks a key the same way while
   loads are even, distinct keys spread evenly, and a server that joins or leaves moves only
   the keys it wins or held (~1/n of them), not a reshuffle.

The key (:func:`prefix`) is a hash of the leading messages up to and including the first
user message, plus the options a chat template renders before them (``tools``) or that give the
cache a namespace of its own (``lora_path``). Rows share a key when they share that much:

- the samples of one prompt (their requests differ only in ``seed``);
- the turns of one conversation enqueued as rows (each row is the history so far: the same
  system message and first user message);
- rows that repeat a long block as earlier turns before their own question (few-shot examples
  as user/assistant pairs, a shared conversation history).

A leading system message of :data:`LONG_SYSTEM_BYTES` or more (a long instruction or few-shot
block, then each row's own question) is a key alone: its rows share a server, and the block is
prefilled about once per server, not once per row of a first batch. Only while admission is on
(``long_system``): it is the window and budget that make the spill, and without them every row
of such a block would go to one server; with admission off such rows spread by their question.
Message content may be a string or a list of parts; it is hashed as given (canonical JSON, a
message's keys sorted as :func:`tokenmill.jobspec.canonical` sorts them).

The key is computed at dispatch from the stored spec (once per delivery), not stored at enqueue:
it is cheap (``python -m timeit`` on this 2-core machine: 2.4 µs for a prompt of a system
message and a 300-character question, 29 µs with a 20,000-character system message; ranking two
servers, 3.5 µs), specs enqueued before affinity existed dispatch with it, and the choice of key
can change without a re-enqueue. ``server_affinity`` (``TOKENMILL_SERVER_AFFINITY=0``) turns it
all off: least full first, as before; ``server_prefill_wait_s=0`` turns off rule 1 and the
skipping of cold servers in rule 2 (both wait for a sibling's first token).

Leaders and homes are this process's: siblings delivered to another worker process go by rule 3
(the same server while loads are even) without waiting.
"""

from __future__ import annotations

import asyncio
import hashlib
import random
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import orjson

from tokenmill.tokens import estimate_prompt_tokens

KEYED_OPTIONS = ("lora_path", "tools")  # options in the key, in this order
# a leading system message this long (JSON bytes, ~500 tokens) is a key of its own
LONG_SYSTEM_BYTES = 2048
# a key without a home goes to its preferred server unless that one is fuller than the least full
# by more than this (a fraction of a budget): then least full first (bounded-load rendezvous)
BALANCE_SLACK = 0.1
HOME_TTL_S = 60.0  # how long a sibling's server is remembered (its prefix likely still cached)
HOMES_MAX = 4096  # keys remembered per process (siblings are delivered close together)


class Prefix(NamedTuple):
    """A job's prefix key and the estimated prompt tokens of the messages it hashes (what its
    siblings find cached on the server it ran on)."""

    key: bytes
    tokens: int


def prefix(request: Mapping[str, Any], long_system: bool = True) -> Prefix:
    """The job's prefix key: a 16-byte hash of the messages up to and including the first user
    message (all of them when none is a user's) and of ``tools`` and ``lora_path`` when set;
    with ``long_system``, of a leading system message alone when it is long
    (:data:`LONG_SYSTEM_BYTES`)."""
    messages = request["messages"]
    end = next((i + 1 for i, m in enumerate(messages) if m.get("role") == "user"), len(messages))
    if long_system and end > 1 and messages[0].get("role") == "system":
        if len(orjson.dumps(messages[0], option=orjson.OPT_SORT_KEYS)) >= LONG_SYSTEM_BYTES:
            end = 1
    h = hashlib.blake2b(orjson.dumps(messages[:end], option=orjson.OPT_SORT_KEYS), digest_size=16)
    for name in KEYED_OPTIONS:
        value = request.get(name)
        if value is not None:
            h.update(b"\0" + name.encode() + b"\0" + orjson.dumps(value))
    return Prefix(h.digest(), estimate_prompt_tokens(messages[:end]))


def ranked(key: bytes, servers: Sequence[str]) -> list[int]:
    """Indices of ``servers`` by rendezvous weight for ``key``, the preferred server first; a
    server's weight is a hash of the key and its name (stable across processes and hosts),
    compared as bytes (as big-endian integers)."""
    weights = [hashlib.blake2b(key + s.encode(), digest_size=8).digest() for s in servers]
    return sorted(range(len(servers)), key=lambda i: weights[i], reverse=True)


def dispatch_order(
    key: bytes | None,
    servers: Sequence[str],
    fullness: Sequence[float],
    home: str | None = None,
    cold: Collection[str] = (),
) -> list[int]:
    """The servers to try, in order (indices), given how full each is for admission.

    Without a key (affinity off): all, least full first, ties in a random order (with admission
    off every server is equally empty, and the list's order sent every job to the first:
    bench/servers.py, 28,614 prompt tokens on one server, 0 on the other).

    With a ``home`` (where a sibling went, :class:`Homes`): the home, then only the servers
    emptier than it by more than :data:`BALANCE_SLACK`, least full first. A sibling refused at
    its home waits for it rather than prefill its prefix again on a server about as busy; it
    spills where that buys balance.

    Otherwise: the key's preferred server, then the others least full first (ties by rendezvous
    weight, so that while nothing is admitted anywhere distinct keys still spread); least full
    first when the preferred one is fuller than the least full by more than the slack.

    Servers in ``cold`` (a sibling is on its way to its first token there, the prefix not yet
    cached) are left out, the home too: the job waits for the token."""
    if key is None:
        return sorted(range(len(servers)), key=lambda i: (fullness[i], random.random()))
    by_weight = [i for i in ranked(key, servers) if servers[i] not in cold]
    if home in servers:
        at = servers.index(home)
        rest = [i for i in by_weight if i != at and fullness[i] < fullness[at] - BALANCE_SLACK]
        first = [at] if at in by_weight else []
        return [*first, *sorted(rest, key=lambda i: fullness[i])]
    if not by_weight:
        return []
    rest = sorted(by_weight[1:], key=lambda i: fullness[i])  # stable: ties keep the weight order
    order = [by_weight[0], *rest]
    if rest and fullness[order[0]] > fullness[rest[0]] + BALANCE_SLACK:
        order.sort(key=lambda i: fullness[i])  # the preferred server is much the fuller: balance
    return order


@dataclass(slots=True)
class _Home:
    server: str  # where a job of the key was admitted last
    at: float
    warm: dict[str, float] = field(default_factory=dict)  # server -> when a job's first token came
    cold: dict[str, int] = field(default_factory=dict)  # server -> jobs on their way to a first token


class Homes:
    """Where this process last admitted each prefix key (the key's *home*), and on which servers
    its prefix is *warm* (a job of it had its first token there within ``ttl_s``: the prefix is
    in that server's cache) or *cold* (jobs of it are on their way to a first token there, on a
    server where it was not warm: a sibling is not sent there, rule 2).

    Touched only on the event loop; the oldest keys are dropped past ``max_keys``."""

    def __init__(self, ttl_s: float = HOME_TTL_S, max_keys: int = HOMES_MAX) -> None:
        self.ttl_s = ttl_s
        self.max_keys = max_keys
        self._homes: dict[bytes, _Home] = {}

    def get(self, key: bytes, now: float) -> str | None:
        """The server a sibling of ``key`` was admitted on within ``ttl_s``, or None."""
        home = self._homes.get(key)
        return home.server if home is not None and now - home.at < self.ttl_s else None

    def cold(self, key: bytes) -> list[str]:
        """The servers where jobs of ``key`` are on their way to a first token, not warm."""
        home = self._homes.get(key)
        return [s for s, n in home.cold.items() if n > 0] if home is not None else []

    def put(self, key: bytes, server: str, now: float) -> bool:
        """A job of ``key`` was admitted on ``server`` at ``now``. Returns whether the key was
        not warm there (the job is cold there until :meth:`ended`)."""
        home = self._homes.pop(key, None) or _Home(server, now)  # re-inserted last: the age order
        home.server, home.at = server, now
        self._homes[key] = home
        while len(self._homes) > self.max_keys:
            del self._homes[next(iter(self._homes))]
        warm_at = home.warm.get(server)
        if warm_at is not None and now - warm_at < self.ttl_s:
            return False
        home.cold[server] = home.cold.get(server, 0) + 1
        return True

    def ended(self, key: bytes, server: str, now: float | None) -> None:
        """A cold job of ``key`` on ``server`` had its first token at ``now`` (None: it ended
        without one)."""
        home = self._homes.get(key)
        if home is None:
            return
        n = home.cold.get(server, 0) - 1
        if n > 0:
            home.cold[server] = n
        else:
            home.cold.pop(server, None)
        if now is not None:
            home.warm[server] = now


# The prefix keys whose first job in this process is on its way to its first token (the key's
# leader), each with the event the leader sets at that token or its end, which its siblings wait
# on (rule 1 of the module's docstring). Touched only on the event loop.
Prefills = dict[bytes, asyncio.Event]


@dataclass(slots=True, eq=False)
class JobAffinity:
    """One job's say in where it goes: its prefix key; the sibling it waits for before it asks
    for a slot (the key's leader in this process, whose prompt is not cached yet), or its
    leading; and the server a sibling went to (its home), which it tries first, and waits for up
    to ``wait_s`` from the first time it is asked with that home known."""

    key: bytes | None
    homes: Homes
    wait_s: float
    prefills: Prefills | None = None
    shared: int = 0  # the prefix's tokens, cached at home: not held again there
    until: float | None = field(default=None, init=False)
    # its last ask left servers out (its home's siblings, cold ones)
    for_home: bool = field(default=False, init=False)
    _lead: asyncio.Event | None = field(default=None, init=False)
    _cold_on: str | None = field(default=None, init=False)  # where it was admitted, cold (no token yet)

    @classmethod
    def of(cls, prefix: Prefix | None, homes: Homes, wait_s: float, prefills: Prefills | None) -> JobAffinity:
        """A job's affinity by its :func:`prefix` (None: no affinity)."""
        if prefix is None:
            return cls(None, homes, wait_s)
        return cls(prefix.key, homes, wait_s, prefills, prefix.tokens)

    def sibling_prefill(self, now: float) -> asyncio.Event | None:
        """The event to wait on before asking for a slot: a sibling's that leads (its prompt
        is being prefilled); None when there is none to wait for. A job whose key has no home
        (no sibling admitted lately) and no leader leads: :meth:`prefilled` lets its siblings go."""
        if self.key is None or self.prefills is None:
            return None
        event = self.prefills.get(self.key)
        if event is None and self.homes.get(self.key, now) is None:
            self._lead = self.prefills[self.key] = asyncio.Event()  # it leads from now
        return event

    def first_token(self) -> None:
        """This job's first token came: its prefix is cached on its server."""
        self._done(asyncio.get_running_loop().time())

    def ended(self) -> None:
        """This job ended (with or without a first token)."""
        self._done(None)

    def _done(self, now: float | None) -> None:
        if self.key is None:
            return
        if self._cold_on is not None:
            self.homes.ended(self.key, self._cold_on, now)
            self._cold_on = None
        if self._lead is not None and self.prefills is not None:  # the siblings waiting for it go
            self._lead.set()
            if self.prefills.get(self.key) is self._lead:
                del self.prefills[self.key]
            self._lead = None

    def home(self, now: float) -> tuple[str | None, bool]:
        """The server to try first (None: the key's rendezvous order), and whether to try it
        alone (the job is still within its wait for it)."""
        if self.key is None:
            return None, False
        home = self.homes.get(self.key, now)
        if home is None or self.wait_s <= 0:
            return home, False
        if self.until is None:
            self.until = now + self.wait_s
        return home, now < self.until

    def admitted(self, server: str, now: float) -> None:
        """The job was admitted on ``server``: its siblings' home from now, and cold there
        until its first token unless the key was warm there."""
        if self.key is not None and self.homes.put(self.key, server, now) and self.prefills is not None:
            self._cold_on = server

    def cold(self) -> list[str]:
        """The servers its siblings are cold on (none without the prefill rule)."""
        return self.homes.cold(self.key) if self.key is not None and self.prefills is not None else []
