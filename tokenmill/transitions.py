"""The ledger's protocol: each transition's script, KEYS and ARGV, and how to read its reply.

Each transition (enqueue, wait, claim, start, heartbeat, commit, fail, release, reap, promote,
feed, cancel, retry, pause, unpause, seal_reserve, seal, unseal, and a time series' point) is one
Lua script in ``tokenmill/lua/`` whose header states its pre- and post-conditions. Every
transition after a claim carries the claim's fencing token, so a worker whose lease was taken over
cannot write. Counters per partition and state move inside the same script, so status is
O(partitions).

No Redis here: a function of this module returns a :class:`Call` (the script, its KEYS and ARGV,
and its reply's decoder), and one of the two executors runs it: :class:`tokenmill.ledger.Executor`
(a :class:`~tokenmill.ledger.Ledger` is one) on redis-py (producer, CLI, upkeep, sealer),
:class:`tokenmill.ledger_async.AsyncLedger` on the worker's event loop. The job hash's fields are
named once, in :class:`JobField`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cache, partial
from importlib import resources
from typing import Any, Generic, NamedTuple, TypeVar

import orjson

from tokenmill import keys, outputs
from tokenmill.jobspec import JobSpec
from tokenmill.lengths import ended_field, prompt_fields, reached_field
from tokenmill.messages import task_message, task_messages
from tokenmill.quality import RATE_NAMES, SIGNALS
from tokenmill.replies import pairs, text

R = TypeVar("R")
SCRIPT_NAMES = tuple(
    "enqueue seal_reserve seal unseal claim heartbeat commit fail release reap promote feed admit "
    "unadmit window_state wait cancel retry start finish series pause unpause qref_sample".split()
)
# Every script opens with prelude.lua (clamped reads of ARGV and stored values). Scripts made of
# others: each part's body becomes a local function of the same name, taking its own KEYS and ARGV
# (one round trip doing what the parts do, by the parts' own code).
COMPOSED = {"start": ("admit", "claim"), "finish": ("commit", "unadmit")}


def _read(name: str) -> str:
    return resources.files("tokenmill").joinpath(f"lua/{name}.lua").read_text()


def _quality_tables() -> str:
    """The quality flags in bit order and the rate each rule may name (tokenmill.quality), as Lua."""
    rates = ", ".join(f"{rate} = '{flag}'" for rate, flag in RATE_NAMES.items())
    return f"local QUALITY_FLAGS = {{{', '.join(map(repr, SIGNALS))}}}\nlocal QUALITY_RATES = {{{rates}}}\n"


@cache
def script_source(name: str) -> str:
    """The Lua source of the named script of ``tokenmill/lua/``."""
    parts = [f"local function {p}(KEYS, ARGV)\n{_read(p)}\nend\n" for p in COMPOSED.get(name, ())]
    return _read("prelude") + _quality_tables() + "".join(parts) + _read(name)


class JobField:
    """The job hash's fields (``tokenmill/lua/`` writes them; tests/test_transitions.py checks
    that every field a script names is one of these)."""

    STATE = "state"
    PARTITION = "partition"
    QUEUE = "queue"
    SPEC = "spec"
    HASH = "hash"  # the spec's digest
    SOURCE = "source"
    SEQ = "seq"
    TOKEN = "token"  # the fencing token of the latest claim
    ATTEMPTS = "attempts"
    RETRIES = "retries"
    WORKER = "worker"
    LEASE = "lease"
    CLAIMED_MS = "claimed_ms"
    CANCEL = "cancel"  # now | after: `cancel` marked the running job
    CANCELLED_MS = "cancelled_ms"
    CKPT_CONTENT = "ckpt_content"
    CKPT_REASONING = "ckpt_reasoning"
    CKPT_TOKENS = "ckpt_tokens"
    CKPT_PROMPT = "ckpt_prompt"
    RESULT = "result"
    TRUNCATED = "truncated"
    DONE_MS = "done_ms"
    SHARD = "shard"  # the sealed shard holding the result
    ERROR_CLASS = "error_class"
    ERROR = "error"
    LAST_ERROR_CLASS = "last_error_class"
    LAST_ERROR = "last_error"
    REAPS = "reaps"
    REAPED_MS = "reaped_ms"
    REPAIRED = "repaired"


F = JobField
JOB_FIELDS = frozenset(v for n, v in vars(JobField).items() if n.isupper())


class Call(NamedTuple, Generic[R]):
    """One transition for an executor to run: ``script`` with ``keys`` and ``args`` (no script:
    ``args`` is a plain read command), its reply read by ``decode``."""

    script: str
    keys: list[str]
    args: list[Any]
    decode: Callable[[Any], R]


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
    # admission's (slots key, used key, member), renewed with the lease
    slot: tuple[str, str, str] | None = None


class AdmitRequest(NamedTuple):
    """What ``admit.lua`` needs to take a slot on one server (built by workers.admission.limiter)."""

    keys: tuple[str, str]  # the server's slots zset and used hash
    args: list[Any]  # admit.lua's ARGV; the first is the slot's member id


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


class Peek(NamedTuple):
    """What a worker reads of a delivered job before it waits for admission."""

    state: str
    spec: dict[str, Any]
    queue: str
    attempts: int  # > 0: an earlier attempt was cut (a dead worker, a server crash, a retry)


class Picked(NamedTuple):
    """A job an operator command acts on, with what its message needs."""

    job_id: str
    partition: str
    queue: str


ALIVE = 1  # heartbeat replies: the lease is renewed
CANCEL_NOW = 2  # renewed, but `cancel --now` asks the worker to stop the stream


class Beat(NamedTuple):
    """One stream's heartbeat: renew its lease; with a checkpoint, also save its partial text."""

    claim: Claim
    checkpoint: Checkpoint | None
    new_tokens: int  # generated since the last heartbeat, for the throughput counter
    slot: SlotUpdate | None = None


# -- the producer's ----------------------------------------------------------------------------


def enqueue(k: keys.RunKeys, partition: str, jobs: Sequence[JobSpec], max_depth: int) -> Call[list[str]]:
    """Create-if-absent and publish ``jobs`` (all of ``partition``): one outcome per job, ``new``,
    ``backlog``, the state the ledger already held, or ``conflict:<source>``."""
    script_keys = [keys.runs(), k.partitions(), k.counts(), k.jobs(partition), keys.broker_queue("short")]
    script_keys += [keys.broker_queue("long"), k.backlog("short"), k.backlog("long"), k.stats()]
    args: list[Any] = [k.run, partition, max_depth]
    messages = task_messages(k.run, partition, [(job.job_id, job.queue) for job in jobs])
    job_key = k.job
    for job, message in zip(jobs, messages, strict=True):
        script_keys.append(job_key(job.job_id))
        args += (job.job_id, job.digest, job.source, job.queue, job.to_json(), message)
    return Call("enqueue", script_keys, args, _texts)


def _texts(reply: Sequence[Any]) -> list[str]:
    return [text(x) for x in reply]


# -- the worker's ------------------------------------------------------------------------------

PEEK_FIELDS = (F.STATE, F.SPEC, F.QUEUE, F.ATTEMPTS)


def peek(k: keys.RunKeys, job_id: str) -> Call[Peek | None]:
    """A job's state, spec, queue and attempts so far, without claiming it; None when it does
    not exist."""
    return Call("", [], ["HMGET", k.job(job_id), *PEEK_FIELDS], peeked)


def peeked(fields: Sequence[Any]) -> Peek | None:
    """A :class:`Peek` from the job hash's :data:`PEEK_FIELDS`; None when the job does not exist."""
    state, spec, queue, attempts = fields
    if state is None or spec is None:
        return None
    return Peek(text(state), orjson.loads(spec), text(queue or b"short"), int(attempts or 0))


def completion_histogram(k: keys.RunKeys) -> Call[dict[int, int]]:
    """The run's committed jobs per completion-length bin (the outputs hash's ``c<bin>`` fields):
    what :meth:`tokenmill.quality.LengthBounds.from_histogram` reads."""
    return Call("", [], ["HGETALL", k.outputs()], _histogram)


def _histogram(reply: Any) -> dict[int, int]:
    fields = ((text(f), v) for f, v in pairs(reply))
    return {int(f[1:]): int(v) for f, v in fields if f[:1] == outputs.COMPLETION and f[1:].isdigit()}


def wait(k: keys.RunKeys, job_id: str, lease_ttl_s: float, hold: bool = True) -> Call[None]:
    """``wait.lua``: take or renew (or, not ``hold``, drop) a delivered job's waiting lease."""
    return Call("wait", [k.waiting()], [job_id, 1 if hold else 0, int(lease_ttl_s * 1000)], lambda _: None)


def claim(k: keys.RunKeys, job_id: str, worker: str, lease_ttl_s: float) -> Call[Claim | str]:
    """A :class:`Claim`, or why not: ``missing``, ``done``, ``failed``, ``cancelled``, ``busy``
    or ``paused`` (the run is paused: the job stays queued)."""
    script_keys = [k.job(job_id), k.counts(), k.leases(), k.delayed(), k.paused()]
    return Call(
        "claim", script_keys, [job_id, worker, int(lease_ttl_s * 1000)], partial(claimed, k.run, job_id)
    )


def start(
    k: keys.RunKeys,
    job_id: str,
    worker: str,
    lease_ttl_s: float,
    admit: AdmitRequest,
    spec: dict[str, Any] | None = None,
) -> Call[Claim | Full | str]:
    """Admission and claim in one round trip (``start.lua``: claim.lua's KEYS and ARGV, the
    waiting zset, then admit.lua's): a :class:`Claim` holding the admitted slot, :class:`Full` (no
    room: nothing claimed), or why the job cannot be claimed (as :func:`claim`; nothing
    admitted). The job's waiting lease is dropped with the claim. ``spec``, when the caller
    already read it (it never changes), is not parsed again."""
    c = claim(k, job_id, worker, lease_ttl_s)
    decode = partial(started, k.run, job_id, admit=admit, spec=spec)
    script_keys = [*c.keys[:4], k.waiting(), *admit.keys, k.paused()]
    return Call("start", script_keys, [*c.args, *admit.args], decode)


def claimed(run: str, job_id: str, res: list[Any], spec: dict[str, Any] | None = None) -> Claim | str:
    """A claim script's reply: the :class:`Claim`, or why not (``spec``: already read, not parsed)."""
    if text(res[0]) != "ok":
        return text(res[0])
    return Claim(
        run=run,
        job_id=job_id,
        token=text(res[1]),
        attempt=int(res[2]),
        spec=spec if spec is not None else orjson.loads(res[3]),
        checkpoint=Checkpoint(text(res[4]), text(res[5]), int(res[6]), int(res[10])),
        partition=text(res[7]),
        queue=text(res[8]),
        retries=int(res[9]),
    )


def started(
    run: str, job_id: str, res: list[Any], admit: AdmitRequest, spec: dict[str, Any] | None
) -> Claim | Full | str:
    """``start.lua``'s reply: a claim holding the admitted slot, :class:`Full`, or why not."""
    if text(res[0]) == "full":
        return Full(int(res[1]) / 1000)
    got = claimed(run, job_id, res, spec)
    if isinstance(got, Claim):
        got.slot = (admit.keys[0], admit.keys[1], str(admit.args[0]))
    return got


def heartbeat(beat: Beat, lease_ttl_s: float) -> Call[int]:
    """Renew the lease of ``beat``'s claim (with a checkpoint, also save the partial text):
    :data:`ALIVE`, :data:`CANCEL_NOW` or 0 (the claim is stale)."""
    claim, slot = beat.claim, beat.slot
    # a checkpoint's tokens are kept without text too (a stream of tool calls)
    ck = beat.checkpoint if beat.checkpoint is not None else Checkpoint()
    k = keys.RunKeys(claim.run)
    script_keys = [k.job(claim.job_id), k.leases(), k.throughput()]
    args: list[Any] = [claim.job_id, claim.token, int(lease_ttl_s * 1000), int(beat.checkpoint is not None)]
    args += [ck.content, ck.reasoning, ck.tokens, beat.new_tokens, ck.prompt_tokens]
    if claim.slot is not None:
        script_keys += [claim.slot[0], claim.slot[1], k.lengths()]
        args += [claim.slot[2], slot.tokens if slot is not None else ""]
        if slot is not None:
            args += map(reached_field, slot.reached)
    return Call("heartbeat", script_keys, args, int)


class Judged(NamedTuple):
    """At a commit: the job's quality flags (a mask over :data:`tokenmill.quality.SIGNALS`) and
    how many judged jobs the partition's window keeps."""

    mask: int
    window_jobs: int


def commit(
    k: keys.RunKeys,
    claim: Claim,
    result: dict[str, Any],
    new_tokens: int,
    lengths: LengthReport | None = None,
    judged: Judged | None = None,
) -> Call[str]:
    """Record the result: ``ok``, ``done`` (already) or ``stale``. With ``lengths``, the run's
    length curve learns how long the completion was. A claim that holds an admission slot gives
    it back in the same round trip (``finish.lua``), whatever the verdict. With ``judged``, the
    run's quality counts and its partition's window take the job's flags, and the run's stop rules
    are applied (a trip pauses the run)."""
    usage = result.get("usage") or {}
    p = claim.partition
    script_keys = [k.job(claim.job_id), k.counts(), k.leases(), k.stats(), k.throughput()]
    script_keys += [k.unsealed(p), k.outputs(), k.recent(p), k.quality(), k.quality_window(p)]
    script_keys += [k.quality_window_counts(), k.quality_rules(), k.paused()]
    completion, continued = int(usage.get("completion_tokens") or 0), int(result.get("continued_tokens") or 0)
    args: list[Any] = [claim.job_id, claim.token, orjson.dumps(result), completion]
    args += [int(usage.get("prompt_tokens") or 0), continued, new_tokens]
    args += [1 if result.get("finish_reason") == "length" else 0, int(result.get("discarded_tokens") or 0)]
    args += [*outputs.commit_fields(result), outputs.RECENT_KEPT]
    if judged is None:
        args += ["", 0, 0]
    else:
        worst = [k.quality_worst(flag) for i, flag in enumerate(SIGNALS) if judged.mask >> i & 1]
        script_keys += worst
        args += [judged.mask, judged.window_jobs, len(worst)]
    if lengths is not None:
        script_keys.append(k.lengths())
        raised = [ended_field(lengths.ended), *map(reached_field, lengths.reached)]
        pairs = [(field, 1) for field in raised] + (prompt_fields(*lengths.prompt) if lengths.prompt else [])
        args += [x for pair in pairs for x in pair]
    if claim.slot is not None:
        slots_key, used_key, member = claim.slot
        return Call(
            "finish",
            [*script_keys, slots_key, used_key],
            [*args, member, max(0, completion - continued)],
            text,
        )
    return Call("commit", script_keys, args, text)


def pause(k: keys.RunKeys, reason: str, by: str) -> Call[bool]:
    """Pause the run (``by``: ``rule`` or ``person``): nothing more is claimed, running jobs
    finish. True when it was paused now, False when it already was (that pause is kept)."""
    return Call("pause", [k.paused()], [reason, by], lambda reply: reply == 1)


def paused(k: keys.RunKeys) -> Call[tuple[str, str] | None]:
    """The run's pause, ``(reason, at_ms)``, or None when it is not paused."""
    return Call("", [], ["HMGET", k.paused(), "reason", "at_ms"], _pause)


def _pause(reply: Sequence[Any]) -> tuple[str, str] | None:
    reason, at_ms = reply
    return None if at_ms is None else (text(reason or b""), text(at_ms))


def unpause(k: keys.RunKeys, partitions: Sequence[str]) -> Call[str]:
    """Lift the run's pause and clear its quality windows (``partitions``: the run's), so its
    rules judge only jobs committed from now on: the reason of the pause lifted, '' if none."""
    script_keys = [k.paused(), k.quality_window_counts(), *map(k.quality_window, partitions)]
    return Call("unpause", script_keys, [], text)


def reference_sample(
    k: keys.RunKeys, sampled_field: str, entry: bytes, drawn: bool, least: int, cap: int
) -> Call[int]:
    """Hand a committed job's scoring ``entry`` to the reference scorer if it is ``drawn`` or its
    partition has fewer than ``least`` sampled jobs (``sampled_field`` counts them): the count
    after (:mod:`tokenmill.quality_drift`)."""
    args = [sampled_field, entry, 1 if drawn else 0, least, cap]
    return Call("qref_sample", [k.quality_reference(), k.reference_todo()], args, int)


def fail(k: keys.RunKeys, claim: Claim, error: JobError) -> Call[str]:
    """End the job ``failed``: ``ok``, ``done``/``failed`` (already) or ``stale``."""
    script_keys = [k.job(claim.job_id), k.counts(), k.leases(), k.failures(), k.failure_last(), k.stats()]
    return Call("fail", script_keys, [claim.job_id, claim.token, error.error_class, error.message], text)


def release(
    k: keys.RunKeys,
    claim: Claim,
    error: JobError,
    *,
    delay_s: float,
    burn: bool,
    max_attempts: int,
    checkpoint: Checkpoint | None = None,
) -> Call[str]:
    """Back to ``queued`` (now or after ``delay_s``), keeping the checkpoint; ``cancelled``
    instead for a job ``cancel`` marked."""
    ck = checkpoint if checkpoint else Checkpoint()  # one without text is not written
    script_keys = [k.job(claim.job_id), k.counts(), k.leases(), k.delayed(), keys.broker_queue(claim.queue)]
    script_keys += [k.failures(), k.failure_last(), k.stats()]
    args = [claim.job_id, claim.token, error.error_class, error.message, int(delay_s * 1000)]
    args += [task_message(k.run, claim.partition, claim.job_id, claim.queue), 1 if burn else 0, max_attempts]
    args += [1 if ck else 0, ck.content, ck.reasoning, ck.tokens, ck.prompt_tokens]
    return Call("release", script_keys, args, text)


# -- admission's (workers/admission/limiter.py builds the ARGV) -------------------------------


def unadmit(server: str, member: str) -> Call[int]:
    """``unadmit.lua``: give a slot back; 1 when it was held."""
    return Call("unadmit", [keys.admission(server), keys.admission_used(server)], [member], int)


class WindowState(NamedTuple):
    """What admission's window rule reads of a server (``window_state.lua``)."""

    now_ms: int  # Redis's clock
    stored: dict[str, bytes | None]  # the fields asked for
    slots: list[tuple[bytes, bytes]]  # each slot's (start ms, projected peak)


def window_state(server: str, fields: Sequence[str]) -> Call[WindowState]:
    """``window_state.lua``: ``fields`` of ``server``'s used hash and its slots, at one moment."""

    def decode(reply: list[Any]) -> WindowState:
        return WindowState(int(reply[0]), dict(zip(fields, reply[1], strict=True)), list(pairs(reply[2])))

    return Call("window_state", [keys.admission_used(server), keys.admission(server)], list(fields), decode)


def set_window(server: str, fields: dict[str, float]) -> Call[int]:
    """Store what admission's window rule decided in ``server``'s used hash (its own fields)."""
    return Call("", [], ["HSET", keys.admission_used(server), *(x for kv in fields.items() for x in kv)], int)


# -- the upkeep's ------------------------------------------------------------------------------


def reap(k: keys.RunKeys, job_id: str, partition: str, queue: str) -> Call[bool]:
    """Requeue a job whose lease expired (True: it was)."""
    msg = task_message(k.run, partition, job_id, queue)
    script_keys = [k.job(job_id), k.counts(), k.leases(), keys.broker_queue(queue)]
    return Call("reap", script_keys, [job_id, msg], lambda reply: reply == 1)


def promote(k: keys.RunKeys, job_id: str, partition: str, queue: str) -> Call[int]:
    """Publish a delayed retry whose time has come (1: published)."""
    msg = task_message(k.run, partition, job_id, queue)
    return Call("promote", [k.job(job_id), k.delayed(), keys.broker_queue(queue)], [job_id, msg], int)


def feed(k: keys.RunKeys, queue: str, ids: list[str], partitions: Sequence[str | None]) -> Call[int]:
    """Publish the backlog's first ``ids`` of ``queue`` (``partitions``: each one's partition, None
    for a job no longer queued, which leaves without a message); how many were published, -1 when
    the backlog's head changed meanwhile."""
    msgs = [
        task_message(k.run, p, j, queue) if p is not None else ""
        for j, p in zip(ids, partitions, strict=True)
    ]
    return Call("feed", [k.backlog(queue), keys.broker_queue(queue)], ids + msgs, int)


# -- the sealer's and repair's (producer/sealing.py, producer/repair.py) ------------------------

StoredSpec = tuple[str, int, str, str, str, bytes]  # (id, seq, queue, hash, source, spec): a spec file's row


def seal_reserve(
    k: keys.RunKeys, partition: str, shard_id: str, batch: int, after_ms: int, force: bool, store_url: str
) -> Call[list[str]]:
    """List up to ``batch`` done results of ``partition`` in the new manifest ``shard_id``:
    ``["ok", job ids as JSON]``, ``["wait"]``, ``["empty"]``, or ``["store", url]`` when the run's
    shards are in another store. Sent again with the same id, it answers the same jobs."""
    script_keys = [k.unsealed(partition), k.seal_since(), k.shard(shard_id), k.seals_pending()]
    args = [shard_id, partition, batch, after_ms, int(force), store_url]
    return Call("seal_reserve", [*script_keys, k.results_store()], args, _texts)


def seal(
    k: keys.RunKeys, partition: str, shard_id: str, ids: Sequence[str], finish: bool, rows: int, size: int
) -> Call[int]:
    """The ``done`` jobs of ``ids`` → ``sealed`` in ``shard_id`` (``finish``: the manifest too,
    ``rows`` and ``size`` bytes): how many, -1 when the manifest is no longer being sealed."""
    script_keys = [k.shard(shard_id), k.seals_pending(), k.shards(partition), k.sealed(), *map(k.job, ids)]
    return Call("seal", script_keys, [shard_id, partition, int(finish), rows, size], int)


def unseal(
    k: keys.RunKeys, partition: str, shard_id: str, specs: Sequence[StoredSpec], last: bool
) -> Call[int]:
    """Jobs of the lost ``shard_id`` back to ``queued`` from ``specs`` (its spec file's rows);
    with ``last``, the manifest is ``lost``: how many."""
    args: list[Any] = [shard_id, partition, int(last)]
    for _, seq, queue, digest, source, spec in specs:
        args += [queue, digest, source, spec, seq]
    script_keys = [k.counts(), k.sealed(), k.shard(shard_id), k.shards(partition)]
    return Call("unseal", [*script_keys, *(k.job(s[0]) for s in specs)], args, int)


def series(
    key: str, gap_ms: int, keep_ms: int, skip_same: bool, index: tuple[str, str] | None, point: list[str]
) -> Call[bool]:
    """Add ``point`` (field, encoded value, ...) to the series ``key`` unless its last point is
    younger than ``gap_ms`` (or, ``skip_same``, equal); points older than ``keep_ms`` are
    trimmed; ``index``: (index set, member) to register the series in. True: added."""
    args: list[Any] = [gap_ms, keep_ms, int(skip_same), index[1] if index else "", *point]
    return Call("series", [key, index[0]] if index else [key], args, bool)


# -- the operator's: in batches; each script checks every job's state again --------------------


def cancel(k: keys.RunKeys, job_ids: Sequence[str], now: bool) -> Call[tuple[int, int]]:
    """Queued jobs → ``cancelled``; running ones marked (stopped at their next heartbeat with
    ``now``, else left to finish): (queued jobs cancelled, running jobs marked)."""
    script_keys = [k.counts(), k.delayed(), k.stats(), *map(k.job, job_ids)]
    return Call(
        "cancel", script_keys, ["now" if now else "after", *job_ids], lambda r: (int(r[0]), int(r[1]))
    )


def retry(
    k: keys.RunKeys, jobs: Sequence[Picked], from_state: str, max_depth: int, classes: Sequence[str] = ()
) -> Call[list[tuple[str, str]]]:
    """Jobs in ``from_state`` (``failed``, of ``classes`` if given, or ``cancelled``) back to
    ``queued`` with a fresh retry budget; at most ``max_depth`` messages per broker list. Per job:
    ``("", "")`` (left alone), ``("new", class)`` (published) or ``("backlog", class)``."""
    script_keys = [k.counts(), k.failures(), k.retried(), k.stats()]
    script_keys += [keys.broker_queue(q) for q in keys.QUEUES] + [k.backlog(q) for q in keys.QUEUES]
    args: list[Any] = [from_state, max_depth, "," + ",".join(classes) + "," if classes else ""]
    for job in jobs:
        args += (job.job_id, task_message(k.run, job.partition, job.job_id, job.queue))
    return Call("retry", [*script_keys, *(k.job(j.job_id) for j in jobs)], args, _outcomes)


def _outcomes(reply: Sequence[Any]) -> list[tuple[str, str]]:
    return [(outcome, cls) for outcome, _, cls in (text(raw).partition(":") for raw in reply)]
