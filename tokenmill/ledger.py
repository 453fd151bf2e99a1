"""The ledger: the single source of truth for work, as named atomic transitions.

Each transition (enqueue, claim, heartbeat/checkpoint, commit, release, fail, reap, promote,
feed) is one Lua script in ``tokenmill/lua/`` whose header states its pre- and
post-conditions. Every transition after a claim carries the claim's fencing token, so a worker
whose lease was taken over cannot write. Counters per partition and state move inside the same
script, so status is O(partitions).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from importlib import resources
from typing import Any, NamedTuple

import orjson
import redis
import redis.asyncio as aioredis

from tokenmill import keys, outputs
from tokenmill.bulk import EnqueueStream
from tokenmill.counts import run_counts
from tokenmill.jobspec import JobSpec
from tokenmill.lengths import ended_field, prompt_fields, reached_field
from tokenmill.messages import task_message

SCRIPT_NAMES = (
    "enqueue",
    "seal_reserve",
    "seal",
    "unseal",
    "claim",
    "heartbeat",
    "commit",
    "fail",
    "release",
    "reap",
    "promote",
    "feed",
    "admit",
    "unadmit",
    "adapt",
    "wait",
    "cancel",
    "retry",
    "start",
    "finish",
    "series",
)
# Every script opens with prelude.lua (clamped reads of ARGV and stored values). Scripts made of
# others: each part's body becomes a local function of the same name, taking its own KEYS and ARGV
# (one round trip doing what the parts do, by the parts' own code).
COMPOSED = {"start": ("admit", "claim"), "finish": ("commit", "unadmit")}


def _read(name: str) -> str:
    return resources.files("tokenmill").joinpath(f"lua/{name}.lua").read_text()


def _compose(name: str) -> str:
    parts = [f"local function {p}(KEYS, ARGV)\n{_read(p)}\nend\n" for p in COMPOSED.get(name, ())]
    return _read("prelude") + "".join(parts) + _read(name)


_SOURCES = {n: _compose(n) for n in SCRIPT_NAMES}


def script_source(name: str) -> str:
    """The Lua source of the named script of ``tokenmill/lua/``."""
    return _SOURCES[name]


def register(client: redis.Redis | aioredis.Redis, name: str) -> Any:
    """The named Lua script of ``tokenmill/lua/`` registered on ``client``."""
    return client.register_script(_SOURCES[name])


def _s(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


@dataclass(slots=True)
class Checkpoint:
    """A partial generation: what a retried job continues from."""

    content: str = ""
    reasoning: str = ""
    tokens: int = 0
    prompt_tokens: int = 0  # the original prompt's size (a continuation's prompt also holds the partial)

    def __bool__(self) -> bool:
        return bool(self.content or self.reasoning)


@dataclass(slots=True)
class Claim:
    """A worker's hold on one attempt of a job."""

    run: str
    job_id: str
    token: str
    attempt: int
    spec: dict[str, Any]
    checkpoint: Checkpoint
    partition: str
    queue: str
    retries: int
    slot: tuple[str, str, str] | None = (
        None  # admission (slots key, used key, member), renewed with the lease
    )


class AdmitRequest(NamedTuple):
    """What ``admit.lua`` needs to take a slot on one server (built by workers.admission.limiter)."""

    keys: tuple[str, str]  # the server's slots zset and used hash
    args: list[Any]  # admit.lua's ARGV; the first is the slot's member id

    def slot_ref(self) -> tuple[str, str, str]:
        """(slots key, used key, member): what a claim carries to renew and release the slot."""
        return self.keys[0], self.keys[1], str(self.args[0])


@dataclass(frozen=True, slots=True)
class Full:
    """``start.lua``'s answer when the server had no room (nothing was claimed)."""

    paced_s: float = 0.0  # > 0: admission paces starts, and the next is due in this many seconds


class SlotUpdate(NamedTuple):
    """At a heartbeat: the tokens the admission slot holds now, and the length bins reached."""

    tokens: int
    reached: tuple[int, ...] = ()


class LengthReport(NamedTuple):
    """At a commit: the length bins reached since the last heartbeat, the bin it ended in, and
    (estimated, held in the server's KV) prompt tokens, when both are known (the prompt offset's
    sample: :mod:`tokenmill.lengths`)."""

    reached: tuple[int, ...]
    ended: int
    prompt: tuple[int, int] | None = None


@dataclass(frozen=True, slots=True)
class JobError:
    error_class: str
    message: str


class Ledger:
    """Transitions of one run's jobs, on a synchronous Redis client."""

    def __init__(self, client: redis.Redis, run: str) -> None:
        self.r = client
        self.run = run
        self.k = keys.RunKeys(run)
        self._scripts = {n: client.register_script(src) for n, src in _SOURCES.items()}
        self._enqueue_loaded = False

    # -- producer side ----------------------------------------------------------------------

    def enqueue_batch(self, partition: str, jobs: Sequence[JobSpec], max_depth: int) -> list[str]:
        """Create-if-absent and publish ``jobs`` (all of ``partition``); one outcome per job."""
        with self.enqueue_stream() as stream:
            stream.send(partition, jobs, max_depth)
            return stream.read()[1]

    @contextmanager
    def enqueue_stream(self) -> Iterator[EnqueueStream]:
        """An :class:`~tokenmill.bulk.EnqueueStream` on a connection of its own for a bulk
        enqueue; the connection goes back to the pool once every reply is read (closed if not)."""
        script = self._scripts["enqueue"]
        if not self._enqueue_loaded:
            self.r.script_load(script.script)
            self._enqueue_loaded = True
        pool = self.r.connection_pool
        conn = pool.get_connection()
        stream = EnqueueStream(self.r, conn, script, self.k)
        try:
            yield stream
        finally:
            if len(stream):  # replies left unread would be read as the next command's
                conn.disconnect()
            pool.release(conn)

    # -- worker side ------------------------------------------------------------------------

    def claim(self, job_id: str, worker: str, lease_ttl_s: float) -> Claim | str:
        """A :class:`Claim`, or why not: ``missing``, ``done``, ``failed``, ``cancelled`` or
        ``busy``."""
        res = self._scripts["claim"](*claim_call(self.k, job_id, worker, lease_ttl_s))
        return claimed(self.run, job_id, res)

    def start(
        self,
        job_id: str,
        worker: str,
        lease_ttl_s: float,
        admit: AdmitRequest,
        spec: dict[str, Any] | None = None,
    ) -> Claim | Full | str:
        """Admission and claim in one round trip (``start.lua``): a :class:`Claim` holding the
        admitted slot, :class:`Full` (no room: nothing claimed), or why the job cannot be claimed (as
        :meth:`claim`; nothing admitted). The job's waiting lease is dropped with the claim.
        ``spec``, when the caller already read it (it never changes), is not parsed again."""
        res = self._scripts["start"](*start_call(self.k, job_id, worker, lease_ttl_s, admit))
        return started(self.run, job_id, res, admit, spec)

    def heartbeat(
        self, claim: Claim, lease_ttl_s: float, checkpoint: Checkpoint | None = None, new_tokens: int = 0
    ) -> bool:
        """Renew the lease (and checkpoint); False when the claim is stale."""
        return bool(
            self._scripts["heartbeat"](*heartbeat_args(self.k, claim, lease_ttl_s, checkpoint, new_tokens))
        )

    def commit(
        self,
        claim: Claim,
        result: dict[str, Any],
        new_tokens: int,
        lengths: LengthReport | None = None,
        release_slot: bool = False,
    ) -> str:
        """Record the result: ``ok``, ``done`` (already) or ``stale``. With ``lengths``, the run's
        length curve learns how long the completion was. With ``release_slot`` and a claim that
        holds an admission slot, the slot is given back in the same round trip (``finish.lua``),
        whatever the verdict."""
        name, script_keys, args = commit_call(self.k, claim, result, new_tokens, lengths, release_slot)
        return _s(self._scripts[name](script_keys, args))

    def fail(self, claim: Claim, error: JobError) -> str:
        """End the job ``failed``: ``ok``, ``done``/``failed`` (already) or ``stale``."""
        k = self.k
        return _s(
            self._scripts["fail"](
                [k.job(claim.job_id), k.counts(), k.leases(), k.failures(), k.failure_last(), k.stats()],
                [claim.job_id, claim.token, error.error_class, error.message],
            )
        )

    def release(
        self,
        claim: Claim,
        error: JobError,
        *,
        delay_s: float,
        burn: bool,
        max_attempts: int,
        checkpoint: Checkpoint | None = None,
    ) -> str:
        """Back to ``queued`` (now or after ``delay_s``), keeping the checkpoint; ``cancelled``
        instead for a job ``cancel`` marked."""
        k = self.k
        ck = checkpoint
        return _s(
            self._scripts["release"](
                [
                    k.job(claim.job_id),
                    k.counts(),
                    k.leases(),
                    k.delayed(),
                    keys.broker_queue(claim.queue),
                    k.failures(),
                    k.failure_last(),
                    k.stats(),
                ],
                [
                    claim.job_id,
                    claim.token,
                    error.error_class,
                    error.message,
                    int(delay_s * 1000),
                    task_message(self.run, claim.partition, claim.job_id, claim.queue),
                    1 if burn else 0,
                    max_attempts,
                    1 if ck else 0,
                    ck.content if ck else "",
                    ck.reasoning if ck else "",
                    ck.tokens if ck else 0,
                    ck.prompt_tokens if ck else 0,
                ],
            )
        )

    # -- the upkeep (reaper, delayed retries, backlog feeder) ---------------------------------

    def reap_expired(self, limit: int = 500) -> list[str]:
        """Requeue jobs whose lease expired; returns their ids."""
        k = self.k
        now_ms = _redis_now_ms(self.r)
        ids = [_s(x) for x in self.r.zrangebyscore(k.leases(), "-inf", now_ms, 0, limit)]
        reaped = []
        for job_id in ids:
            part, queue = (_s(x) if x else "" for x in self.r.hmget(k.job(job_id), "partition", "queue"))
            queue = queue or "short"
            msg = task_message(self.run, part, job_id, queue)
            if (
                self._scripts["reap"](
                    [k.job(job_id), k.counts(), k.leases(), keys.broker_queue(queue)], [job_id, msg]
                )
                == 1
            ):
                reaped.append(job_id)
        return reaped

    def promote_due(self, limit: int = 500) -> int:
        """Publish delayed retries whose time has come."""
        k = self.k
        now_ms = _redis_now_ms(self.r)
        ids = [_s(x) for x in self.r.zrangebyscore(k.delayed(), "-inf", now_ms, 0, limit)]
        published = 0
        for job_id in ids:
            part, queue = (_s(x) if x else "" for x in self.r.hmget(k.job(job_id), "partition", "queue"))
            queue = queue or "short"
            msg = task_message(self.run, part, job_id, queue)
            published += int(
                self._scripts["promote"](
                    [k.job(job_id), k.delayed(), keys.broker_queue(queue)], [job_id, msg]
                )
            )
        return published

    def feed_backlog(self, queue: str, max_depth: int, batch: int = 1000) -> int:
        """Top the broker list of ``queue`` up to ``max_depth`` from the backlog; ids of jobs no
        longer queued (cancelled) leave it without a message."""
        k = self.k
        fed = 0
        while True:
            room = max_depth - self.r.llen(keys.broker_queue(queue))
            if room <= 0:
                return fed
            ids = [_s(x) for x in self.r.lrange(k.backlog(queue), 0, min(room, batch) - 1)]
            if not ids:
                return fed
            parts = self.r.pipeline(transaction=False)
            for job_id in ids:
                parts.hmget(k.job(job_id), "state", "partition")
            msgs = [
                task_message(self.run, _s(p or b""), j, queue) if state == b"queued" else ""
                for j, (state, p) in zip(ids, parts.execute(), strict=True)
            ]
            n = int(self._scripts["feed"]([k.backlog(queue), keys.broker_queue(queue)], ids + msgs))
            if n > 0:
                fed += n

    # -- reading ----------------------------------------------------------------------------

    def counts(self) -> dict[str, dict[str, int]]:
        """``{partition: {state: n}}`` for every partition (:func:`tokenmill.counts.run_counts`)."""
        return run_counts(self.r, self.run)

    def iter_jobs(
        self, partition: str, fields: Sequence[str], batch: int = 500
    ) -> Iterator[tuple[str, list[bytes | None]]]:
        """``(job_id, [field values])`` for each job of ``partition``, in enqueue order."""
        key = self.k.jobs(partition)
        start = 0
        while True:
            ids = [_s(x) for x in self.r.lrange(key, start, start + batch - 1)]
            if not ids:
                return
            pipe = self.r.pipeline(transaction=False)
            for job_id in ids:
                pipe.hmget(self.k.job(job_id), list(fields))
            yield from zip(ids, pipe.execute(), strict=True)
            start += batch

    def peek(self, job_id: str) -> Peek | None:
        """A job's state, spec, queue and attempts so far, without claiming it; None when it does
        not exist."""
        return peeked(self.r.hmget(self.k.job(job_id), *PEEK_FIELDS))

    def hold_waiting(self, job_id: str, lease_ttl_s: float, hold: bool = True) -> None:
        """Renew (or drop) the waiting lease of a delivered, not yet claimed job."""
        self._scripts["wait"](*wait_call(self.k, job_id, lease_ttl_s, hold))

    def requeue_abandoned(self, limit: int = 500) -> int:
        """Republish delivered jobs whose worker died while they waited (lease expired, still queued)."""
        now_ms = _redis_now_ms(self.r)
        ids = [_s(x) for x in self.r.zrangebyscore(self.k.waiting(), "-inf", now_ms, 0, limit)]
        if not ids:
            return 0
        self.r.zrem(self.k.waiting(), *ids)
        return self.republish(ids, front=True).published

    def job(self, job_id: str) -> dict[str, str]:
        return {_s(a): _s(b) for a, b in self.r.hgetall(self.k.job(job_id)).items()}

    def republish(
        self, job_ids: Iterable[str], front: bool = False, max_depth: int | None = None
    ) -> Republished:
        """Publish a message for each of ``job_ids`` that is ``queued`` (duplicates are harmless);
        with ``front``, at the consuming end of the queue (it runs next). With ``max_depth``, a job
        whose queue already holds that many messages goes on the backlog instead (the feeder
        publishes it as the queue drains)."""
        published = backlogged = 0
        ids = list(job_ids)
        for start in range(0, len(ids), 1000):
            chunk = ids[start : start + 1000]
            read = self.r.pipeline(transaction=False)
            for q in keys.QUEUES:
                read.llen(keys.broker_queue(q))
            for job_id in chunk:
                read.hmget(self.k.job(job_id), "state", "partition", "queue")
            replies = read.execute()
            depths, fields = replies[: len(keys.QUEUES)], replies[len(keys.QUEUES) :]
            room = {
                q: len(chunk) if max_depth is None else max_depth - int(depth)
                for q, depth in zip(keys.QUEUES, depths, strict=True)
            }
            write = self.r.pipeline(transaction=False)
            for job_id, (state, part, queue) in zip(chunk, fields, strict=True):
                if state != b"queued" or not queue:
                    continue
                q = _s(queue)
                if room[q] > 0:
                    push = write.rpush if front else write.lpush
                    push(keys.broker_queue(q), task_message(self.run, _s(part or b""), job_id, q))
                    room[q] -= 1
                    published += 1
                else:
                    write.rpush(self.k.backlog(q), job_id)
                    backlogged += 1
            write.execute()
        return Republished(published, backlogged)

    def parked(self) -> set[str]:
        """Queued jobs that wait without a message by design: delayed retries and the backlogs."""
        pipe = self.r.pipeline(transaction=False)
        pipe.zrange(self.k.delayed(), 0, -1)
        for q in keys.QUEUES:
            pipe.lrange(self.k.backlog(q), 0, -1)
        return {_s(x) for ids in pipe.execute() for x in ids}


class Peek(NamedTuple):
    """What a worker reads of a delivered job before it waits for admission."""

    state: str
    spec: dict[str, Any]
    queue: str
    attempts: int  # > 0: an earlier attempt was cut (a dead worker, a server crash, a retry)


class Republished(NamedTuple):
    """What :meth:`Ledger.republish` did: messages published, job ids put on the backlog."""

    published: int
    backlogged: int


PEEK_FIELDS = ("state", "spec", "queue", "attempts")


def peeked(fields: Sequence[Any]) -> Peek | None:
    """A :class:`Peek` from the job hash's :data:`PEEK_FIELDS`; None when the job does not exist."""
    state, spec, queue, attempts = fields
    if state is None or spec is None:
        return None
    return Peek(_s(state), orjson.loads(spec), _s(queue or b"short"), int(attempts or 0))


def wait_call(k: keys.RunKeys, job_id: str, lease_ttl_s: float, hold: bool) -> tuple[list[str], list[Any]]:
    """``wait.lua``'s KEYS and ARGV: take or renew (or, not ``hold``, drop) a waiting lease."""
    return [k.waiting()], [job_id, 1 if hold else 0, int(lease_ttl_s * 1000)]


def claim_call(k: keys.RunKeys, job_id: str, worker: str, lease_ttl_s: float) -> tuple[list[str], list[Any]]:
    """``claim.lua``'s KEYS and ARGV."""
    return [k.job(job_id), k.counts(), k.leases(), k.delayed()], [job_id, worker, int(lease_ttl_s * 1000)]


def start_call(
    k: keys.RunKeys, job_id: str, worker: str, lease_ttl_s: float, admit: AdmitRequest
) -> tuple[list[str], list[Any]]:
    """``start.lua``'s KEYS and ARGV: claim.lua's, the waiting zset, then admit.lua's."""
    script_keys, args = claim_call(k, job_id, worker, lease_ttl_s)
    return [*script_keys, k.waiting(), *admit.keys], [*args, *admit.args]


def claimed(run: str, job_id: str, res: list[Any], spec: dict[str, Any] | None = None) -> Claim | str:
    """A claim script's reply: the :class:`Claim`, or why not (``spec``: already read, not parsed)."""
    if _s(res[0]) != "ok":
        return _s(res[0])
    return Claim(
        run=run,
        job_id=job_id,
        token=_s(res[1]),
        attempt=int(res[2]),
        spec=spec if spec is not None else orjson.loads(res[3]),
        checkpoint=Checkpoint(_s(res[4]), _s(res[5]), int(res[6]), int(res[10])),
        partition=_s(res[7]),
        queue=_s(res[8]),
        retries=int(res[9]),
    )


def started(
    run: str, job_id: str, res: list[Any], admit: AdmitRequest, spec: dict[str, Any] | None
) -> Claim | Full | str:
    """``start.lua``'s reply: a claim holding the admitted slot, :class:`Full`, or why not."""
    if _s(res[0]) == "full":
        return Full(int(res[1]) / 1000)
    claim = claimed(run, job_id, res, spec)
    if isinstance(claim, Claim):
        claim.slot = admit.slot_ref()
    return claim


def commit_call(
    k: keys.RunKeys,
    claim: Claim,
    result: dict[str, Any],
    new_tokens: int,
    lengths: LengthReport | None,
    release_slot: bool,
) -> tuple[str, list[str], list[Any]]:
    """The commit's script (``finish`` when it also gives the slot back, else ``commit``), its
    KEYS and ARGV."""
    usage = result.get("usage") or {}
    script_keys = [
        k.job(claim.job_id),
        k.counts(),
        k.leases(),
        k.stats(),
        k.throughput(),
        k.unsealed(claim.partition),
        k.outputs(),
        k.recent(claim.partition),
    ]
    args: list[Any] = [
        claim.job_id,
        claim.token,
        orjson.dumps(result),
        int(usage.get("completion_tokens") or 0),
        int(usage.get("prompt_tokens") or 0),
        int(result.get("continued_tokens") or 0),
        new_tokens,
        1 if result.get("finish_reason") == "length" else 0,
        int(result.get("discarded_tokens") or 0),
        *outputs.commit_fields(result),
        outputs.RECENT_KEPT,
    ]
    if lengths is not None:
        script_keys.append(k.lengths())
        raised = [ended_field(lengths.ended), *map(reached_field, lengths.reached)]
        pairs = [(field, 1) for field in raised] + (prompt_fields(*lengths.prompt) if lengths.prompt else [])
        args += [x for pair in pairs for x in pair]
    if release_slot and claim.slot is not None:
        slots_key, used_key, member = claim.slot
        generated = int(usage.get("completion_tokens") or 0) - int(result.get("continued_tokens") or 0)
        return "finish", [*script_keys, slots_key, used_key], [*args, member, max(0, generated)]
    return "commit", script_keys, args


def heartbeat_args(
    k: keys.RunKeys,
    claim: Claim,
    lease_ttl_s: float,
    checkpoint: Checkpoint | None,
    new_tokens: int,
    slot: SlotUpdate | None = None,
) -> tuple[list[str], list[Any]]:
    ck = checkpoint
    script_keys = [k.job(claim.job_id), k.leases(), k.throughput()]
    args: list[Any] = [
        claim.job_id,
        claim.token,
        int(lease_ttl_s * 1000),
        1 if ck is not None else 0,
        ck.content if ck is not None else "",
        ck.reasoning if ck is not None else "",
        ck.tokens if ck is not None else 0,  # kept without text too (a stream of tool calls)
        new_tokens,
        ck.prompt_tokens if ck is not None else 0,
    ]
    if claim.slot is not None:
        script_keys += [claim.slot[0], claim.slot[1], k.lengths()]
        args += [claim.slot[2], slot.tokens if slot is not None else ""]
        if slot is not None:
            args += map(reached_field, slot.reached)
    return script_keys, args


ALIVE = 1  # heartbeat replies: the lease is renewed
CANCEL_NOW = 2  # renewed, but `cancel --now` asks the worker to stop the stream


class Beat(NamedTuple):
    """One stream's heartbeat: renew its lease; with a checkpoint, also save its partial text."""

    claim: Claim
    checkpoint: Checkpoint | None
    new_tokens: int  # generated since the last heartbeat, for the throughput counter
    slot: SlotUpdate | None = None


class AsyncHeartbeat:
    """The heartbeat/checkpoint transition on an asyncio client (used while streaming)."""

    def __init__(self, client: aioredis.Redis) -> None:
        self.client = client
        self.script = client.register_script(_SOURCES["heartbeat"])

    async def __call__(
        self,
        claim: Claim,
        lease_ttl_s: float,
        checkpoint: Checkpoint | None,
        new_tokens: int,
        slot: SlotUpdate | None = None,
    ) -> int:
        """The heartbeat's reply: :data:`ALIVE`, :data:`CANCEL_NOW` or 0 (the claim is stale)."""
        (reply,) = await self.many([Beat(claim, checkpoint, new_tokens, slot)], lease_ttl_s)
        if isinstance(reply, redis.RedisError):
            raise reply
        return reply

    async def many(self, beats: Sequence[Beat], lease_ttl_s: float) -> list[int | redis.RedisError]:
        """Several streams' heartbeats in one round trip (a pipeline, not a transaction: each
        script is atomic on its own). A reply per beat, as :meth:`__call__`'s, or the error
        that beat's script raised; a lost connection raises for all of them. The scripts go as
        ``EVALSHA`` (a pipeline holding a registered script would first ask ``SCRIPT EXISTS``,
        a second round trip); after a Redis restart emptied the script cache, the script is
        loaded once and the beats that found none are sent again, in one more pipeline."""
        calls = [
            heartbeat_args(
                keys.RunKeys(b.claim.run), b.claim, lease_ttl_s, b.checkpoint, b.new_tokens, b.slot
            )
            for b in beats
        ]
        replies = await self._evalsha(calls)
        missing = [i for i, r in enumerate(replies) if isinstance(r, redis.exceptions.NoScriptError)]
        if missing:
            await self.client.script_load(self.script.script)
            for i, reply in zip(missing, await self._evalsha([calls[i] for i in missing]), strict=True):
                replies[i] = reply
        return [r if isinstance(r, redis.RedisError) else int(r) for r in replies]

    async def _evalsha(self, calls: Sequence[tuple[list[str], list[Any]]]) -> list[Any]:
        async with self.client.pipeline(transaction=False) as pipe:
            for script_keys, args in calls:
                pipe.evalsha(self.script.sha, len(script_keys), *script_keys, *args)
            return await pipe.execute(raise_on_error=False)


def _redis_now_ms(client: redis.Redis) -> int:
    sec, usec = client.time()
    return int(sec) * 1000 + int(usec) // 1000
