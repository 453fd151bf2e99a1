"""Prefix affinity: which of several servers a job is sent to first.

SGLang keeps the prompts it has prefilled in a radix cache, so a prompt whose leading tokens
another request already prefilled on the *same* server costs only its new tokens. Spread over
servers least-full first, the N samples of one prompt (``enqueue --samples N``) or the turns of
one conversation are prefilled once per server instead of once per run. So each job has a
*prefix key*, and the ready servers are ranked for it by rendezvous (highest-random-weight)
hashing: the server with the highest ``blake2b(key, server name)`` is the job's preferred server
and is tried first; when its window or budget refuses, the others are tried least full first
(the spill), ties in the rendezvous order. Rendezvous needs no shared state: every worker on
every host ranks a key the same way, distinct keys spread evenly, and a server that joins or
leaves moves only the keys it wins or held (~1/n of them), not a reshuffle.

The key (:func:`prefix_key`) is a hash of the leading messages up to and including the first
user message, plus the options a chat template renders before them (``tools``) or that give the
cache a namespace of its own (``lora_path``). Rows share a key when they share that much:

- the samples of one prompt (their requests differ only in ``seed``);
- the turns of one conversation enqueued as rows (each row is the history so far: the same
  system message and first user message);
- rows that repeat a long block as earlier turns before their own question (few-shot examples
  as user/assistant pairs, a shared conversation history). They all prefer one server, which
  takes what it has room for; the rest spill, as sglang-router's cache-aware policy routes to
  the server holding the prefix until the load is out of balance.

Rows that share only a system message (a long instruction or few-shot block, then each row's
own question) get keys of their own and spread: keyed on the system message alone they would
all prefer one server, which only the spill would relieve, and while admission does not limit
(no known capacity, admission off) they would all go there. Spread, the shared block is
prefilled once per server and then hit in each server's cache: n prefills of it per run, not
one per row. Message content may be a string or a list of parts; it is hashed as given
(canonical JSON, a message's keys sorted as :func:`tokenmill.jobspec.canonical` sorts them).

The key is computed at dispatch from the stored spec (once per delivery), not stored at enqueue:
it is cheap (``python -m timeit`` on this 2-core machine: 2.4 µs for a prompt of a system
message and a 300-character question, 29 µs with a 20,000-character system message; ranking two
servers, 3.5 µs), specs enqueued before affinity existed dispatch with it, and the choice of key
can change without a re-enqueue. ``server_affinity`` (``TOKENMILL_SERVER_AFFINITY=0``) turns it
off: least full first, as before.

When every window is full the spill decides: a freed slot goes to the head of the process's
line whatever it prefers, and the samples of a prompt, delivered together, land on every
server. ``server_affinity_wait_s`` (default 0: spill at once) lets a job whose sibling this
process admitted lately wait that long for the sibling's server (:class:`Homes`); a job with
no sibling seen never waits, so rows without shared prefixes pay nothing for it.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Mapping, Sequence
from typing import Any

import orjson

KEYED_OPTIONS = ("lora_path", "tools")  # options in the key, in this order
HOME_TTL_S = 60.0  # how long a sibling's server is remembered (its prefix likely still cached)
HOMES_MAX = 4096  # keys remembered per process (siblings are delivered close together)


def prefix_key(request: Mapping[str, Any]) -> bytes:
    """The job's prefix key: a 16-byte hash of the messages up to and including the first user
    message (all of them when none is a user's) and of ``tools`` and ``lora_path`` when set."""
    messages = request["messages"]
    end = next((i + 1 for i, m in enumerate(messages) if m.get("role") == "user"), len(messages))
    h = hashlib.blake2b(orjson.dumps(messages[:end], option=orjson.OPT_SORT_KEYS), digest_size=16)
    for name in KEYED_OPTIONS:
        value = request.get(name)
        if value is not None:
            h.update(b"\0" + name.encode() + b"\0" + orjson.dumps(value))
    return h.digest()


def weight(key: bytes, server: str) -> int:
    """``server``'s rendezvous weight for ``key`` (stable across processes and hosts)."""
    return int.from_bytes(hashlib.blake2b(key + server.encode(), digest_size=8).digest(), "big")


def ranked(key: bytes, servers: Sequence[str]) -> list[int]:
    """Indices of ``servers`` by rendezvous weight for ``key``, the preferred server first."""
    weights = [weight(key, s) for s in servers]
    return sorted(range(len(servers)), key=lambda i: weights[i], reverse=True)


def dispatch_order(
    key: bytes | None, servers: Sequence[str], fullness: Sequence[float], home: str | None = None
) -> list[int]:
    """The order to try ``servers`` in (indices), given how full each is for admission.

    With a key: the preferred server, then the others least full first (ties by rendezvous
    weight, so that while nothing is admitted anywhere distinct keys still spread); ``home``
    (where a sibling went, :class:`Homes`) before them all. Without a key (affinity off): least
    full first, ties in a random order (with admission off every server is equally empty, and
    the list's order sent every job to the first: bench/servers.py, 28,614 prompt tokens on one
    server, 0 on the other)."""
    if key is None:
        return sorted(range(len(servers)), key=lambda i: (fullness[i], random.random()))
    by_weight = ranked(key, servers)
    rest = sorted(by_weight[1:], key=lambda i: fullness[i])  # stable: ties keep the weight order
    order = [by_weight[0], *rest]
    if home in servers:
        order.sort(key=lambda i: servers[i] != home)  # stable: home first, the rest as they were
    return order


class Homes:
    """Where this process last admitted each prefix key (the key's *home*), for
    ``server_affinity_wait_s``: a job whose sibling was admitted on a server within ``ttl_s``
    waits that long for that server, where its prefix is likely cached, before it spills.

    Why: when every window is full, a freed slot goes to whichever job is at the head of the
    process's line, so the samples of a prompt, delivered together, would take slots on every
    server (two sims, 4 samples of 100 prompts, saturated: 1.35-1.48 servers per prompt). A
    job without a sibling seen never waits. Touched only on the event loop; the oldest keys
    are dropped past ``max_keys``."""

    def __init__(self, ttl_s: float = HOME_TTL_S, max_keys: int = HOMES_MAX) -> None:
        self.ttl_s = ttl_s
        self.max_keys = max_keys
        self._homes: dict[bytes, tuple[str, float]] = {}

    def get(self, key: bytes, now: float) -> str | None:
        """The server a sibling of ``key`` was admitted on within ``ttl_s``, or None."""
        home = self._homes.get(key)
        return home[0] if home is not None and now - home[1] < self.ttl_s else None

    def put(self, key: bytes, server: str, now: float) -> None:
        """A job of ``key`` was admitted on ``server`` at ``now``."""
        self._homes.pop(key, None)  # re-inserted last: the dict's order is the age order
        self._homes[key] = (server, now)
        while len(self._homes) > self.max_keys:
            del self._homes[next(iter(self._homes))]


class JobAffinity:
    """One job's say in where it goes while it waits for admission: its prefix key, and the
    server a sibling went to (its home), which it waits for up to ``wait_s`` from the first time
    it is asked with that home known."""

    __slots__ = ("homes", "key", "until", "wait_s")

    def __init__(self, key: bytes | None, homes: Homes, wait_s: float) -> None:
        self.key = key
        self.homes = homes
        self.wait_s = wait_s
        self.until: float | None = None

    def home(self, now: float) -> tuple[str | None, bool]:
        """The server to try first (None: the key's rendezvous order), and whether to try it
        alone (the job is still within its wait for it)."""
        if self.key is None or self.wait_s <= 0:
            return None, False
        home = self.homes.get(self.key, now)
        if home is None:
            return None, False
        if self.until is None:
            self.until = now + self.wait_s
        return home, now < self.until

    def admitted(self, server: str, now: float) -> None:
        """The job was admitted on ``server``: its siblings' home from now."""
        if self.key is not None and self.wait_s > 0:
            self.homes.put(self.key, server, now)
