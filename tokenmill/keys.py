"""Every Redis key tokenmill uses, built here and nowhere else.

Per-run keys live under ``tm:{run}:``; keys shared by every run (servers, admission, locks) live
under ``tm:_:``. Celery's broker lists are named by kombu (the queue name itself); they are
built here too so that nothing else spells them.

Hash fields that combine two names (``state|partition`` in the counts hash) use
:data:`FIELD_SEP`; run and partition names are validated so that neither can contain it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from tokenmill.errors import ConfigError

PREFIX = "tm"
FIELD_SEP = "|"
STATES = ("queued", "running", "done", "failed")
# Terminal like done and failed, but reported only once a run has any (status --json's contract).
CANCELLED = "cancelled"
QUEUES = ("short", "long")

_RUN_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,99}$")
_PARTITION_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9._ -]{0,199}$")


def check_run(run: str) -> str:
    """Return ``run`` if it is a safe run name, else raise :class:`ConfigError` naming it."""
    if not _RUN_RE.match(run or ""):
        raise ConfigError(
            f"--run {run!r} is not a valid run name: use 1-100 letters, digits, '.', '_' or '-', "
            "starting with a letter or digit"
        )
    return run


def check_partition(partition: str) -> str:
    """Return ``partition`` if it is a safe partition name (it names an export file)."""
    if not _PARTITION_RE.match(partition or "") or partition.strip() != partition:
        raise ConfigError(
            f"partition {partition!r} is not a valid name: use letters, digits, '.', '_', '-' or "
            "spaces (no '/', no '|'), starting with a letter, digit or '_'"
        )
    return partition


def count_field(state: str, partition: str) -> str:
    """The field of the run's counts hash for ``state`` in ``partition`` (Lua builds the same)."""
    return f"{state}{FIELD_SEP}{partition}"


def split_count_field(field: str) -> tuple[str, str]:
    state, _, partition = field.partition(FIELD_SEP)
    return state, partition


def broker_queue(queue: str) -> str:
    """The Redis list kombu's Redis transport uses for ``queue`` (default priority)."""
    return queue


def broker_unacked() -> str:
    """The hash where kombu's Redis transport keeps delivered, not yet acked messages (its
    default ``unacked_key``, which tokenmill does not change)."""
    return "unacked"


def runs() -> str:
    """Set of every run name that was ever enqueued."""
    return f"{PREFIX}:_:runs"


def servers() -> str:
    """Set of server names published by server managers."""
    return f"{PREFIX}:_:servers"


def server(name: str) -> str:
    """Hash: one server's published state, capacity and live figures."""
    return f"{PREFIX}:_:server:{name}"


def server_events(name: str) -> str:
    """List: the server manager's recorded actions for ``name`` (restarts, OOM steps), newest first."""
    return f"{PREFIX}:_:server:{name}:events"


def server_stop(name: str) -> str:
    """String: a pending stop request for ``name`` (JSON), polled and deleted by its supervisor."""
    return f"{PREFIX}:_:server:{name}:stop"


def admission(server_name: str) -> str:
    """Sorted set: admission slots held on a server, member = slot id, score = expiry (ms)."""
    return f"{PREFIX}:_:admit:{server_name}"


def admission_used(server_name: str) -> str:
    """Hash: tokens admitted on a server in total and per queue, and the last decision's figures."""
    return f"{PREFIX}:_:admit:{server_name}:used"


def admission_watch(server_name: str) -> str:
    """Lock: the one worker that reads a server's load and steers its admission window."""
    return f"{PREFIX}:_:admit:{server_name}:watch"


def server_idle(server: str) -> str:
    """String: since when (epoch ms) a worker read ``server`` (its root URL without credentials)
    holding no request, over the quiet span, while streams to it were silent: every stream to it
    silent since before then is lost (``workers/lost.py``). Expires after a minute."""
    return f"{PREFIX}:_:idle:{server}"


def server_series(name: str) -> str:
    """Stream: ``name``'s load over time (running, queued, KV use, retractions, window), one point
    a step, written by the worker holding its load watch (:mod:`tokenmill.history`)."""
    return f"{PREFIX}:_:server:{name}:series"


def server_states(name: str) -> str:
    """Stream: ``name``'s state and restarts, a point at each change, written by its manager."""
    return f"{PREFIX}:_:server:{name}:states"


def series_servers() -> str:
    """Set: the names of every server with a series (the dashboard's list of servers)."""
    return f"{PREFIX}:_:series:servers"


def upkeep_lock() -> str:
    """Lock held by the one worker that runs the upkeep at a time (the key keeps its first name,
    ``pump``, so that workers of either version share it)."""
    return f"{PREFIX}:_:lock:pump"


def seal_lock() -> str:
    """Lock held by the one sealer at a time (a worker's seal thread or ``tokenmill seal``)."""
    return f"{PREFIX}:_:lock:seal"


def worker_control() -> str:
    """Hash of flags every worker reads (e.g. a paused reason), written by the server manager."""
    return f"{PREFIX}:_:control"


def dead_letters() -> str:
    """List: poison messages taken off the broker queues (JSON records), newest first, capped."""
    return f"{PREFIX}:_:dead"


def dead_letters_count() -> str:
    """String: how many poison messages were ever taken off the broker queues (the list is capped)."""
    return f"{PREFIX}:_:dead:count"


def worker_queues() -> str:
    """Hash of each running worker's queues (its Celery name -> a JSON list), written by the
    worker when it is ready, so the server manager can resume a worker it paused unseen."""
    return f"{PREFIX}:_:worker-queues"


def api_file(file_id: str) -> str:
    """Hash: one file of ``tokenmill api`` (OpenAI's File object's fields; its bytes are in the
    result store)."""
    return f"{PREFIX}:_:api:file:{file_id}"


def api_files() -> str:
    """Sorted set: every file of ``tokenmill api``, id → creation order (ms)."""
    return f"{PREFIX}:_:api:files"


def api_batch(batch_id: str) -> str:
    """Hash: one batch of ``tokenmill api`` (OpenAI's Batch object's fields; its run is the
    batch id)."""
    return f"{PREFIX}:_:api:batch:{batch_id}"


def api_batches() -> str:
    """Sorted set: every batch of ``tokenmill api``, id → creation order (ms)."""
    return f"{PREFIX}:_:api:batches"


def api_active() -> str:
    """Set: the batches not yet in a final state, which an API process advances."""
    return f"{PREFIX}:_:api:active"


def api_batch_lock(batch_id: str) -> str:
    """Lock: the one API process advancing a batch (validation, enqueue, finalization)."""
    return f"{PREFIX}:_:api:batch:{batch_id}:lock"


@dataclass(frozen=True, slots=True)
class RunKeys:
    """The keys of one run."""

    run: str

    def __post_init__(self) -> None:
        check_run(self.run)

    @property
    def prefix(self) -> str:
        return f"{PREFIX}:{self.run}"

    def job(self, job_id: str) -> str:
        """Hash: one job's spec, state, claim, checkpoint and result."""
        return f"{self.prefix}:job:{job_id}"

    def jobs(self, partition: str) -> str:
        """List: the ids of a partition's jobs in enqueue order (export reads it)."""
        return f"{self.prefix}:jobs:{partition}"

    def partitions(self) -> str:
        """Set: the run's partition names."""
        return f"{self.prefix}:partitions"

    def counts(self) -> str:
        """Hash: ``state|partition`` → number of jobs, updated inside every transition."""
        return f"{self.prefix}:counts"

    def leases(self) -> str:
        """Sorted set: running job id → lease expiry (ms, Redis clock)."""
        return f"{self.prefix}:leases"

    def waiting(self) -> str:
        """Sorted set: delivered job id waiting for a server or admission → lease expiry (ms)."""
        return f"{self.prefix}:waiting"

    def delayed(self) -> str:
        """Sorted set: queued job id → when its retry may be published (ms, Redis clock)."""
        return f"{self.prefix}:delayed"

    def backlog(self, queue: str) -> str:
        """List: queued job ids not yet published to ``queue`` (bounded broker depth)."""
        return f"{self.prefix}:backlog:{queue}"

    def failures(self) -> str:
        """Hash: failure class → number of jobs now ``failed`` with it (``retry`` takes them out)."""
        return f"{self.prefix}:failures"

    def retried(self) -> str:
        """Hash: failure class → failed jobs that ``retry`` sent back (with :meth:`failures`, every
        job that ever ended failed)."""
        return f"{self.prefix}:retried"

    def failure_last(self) -> str:
        """Hash: failure class → the latest message seen for it."""
        return f"{self.prefix}:failure_last"

    def stats(self) -> str:
        """Hash: run totals (``completion_tokens``, ``prompt_tokens``, ``continued``, ...) and
        times (``first_enqueue_ms``, ``last_activity_ms``, Redis clock)."""
        return f"{self.prefix}:stats"

    def lengths(self) -> str:
        """Hash: completion-length bin → requests that reached it (``r<bin>``) and ended in it
        (``e<bin>``); admission's survival curve (:mod:`tokenmill.lengths`)."""
        return f"{self.prefix}:lengths"

    def throughput(self) -> str:
        """Hash: unix second → completion tokens committed in that second (trimmed)."""
        return f"{self.prefix}:tput"

    def outputs(self) -> str:
        """Hash: what the committed outputs look like: ``finish:<reason>``, and completion and
        reasoning tokens per length bin (``c<bin>``, ``r<bin>``; :mod:`tokenmill.outputs`)."""
        return f"{self.prefix}:outputs"

    def recent(self, partition: str) -> str:
        """List: the ids of a partition's latest committed jobs, newest first (bounded)."""
        return f"{self.prefix}:recent:{partition}"

    def quality_worst(self, flag: str) -> str:
        """List: the latest jobs judged with ``flag`` set (a :data:`tokenmill.quality.SIGNALS`
        name), ``partition|job_id``, newest first (the newest 20; written by commit.lua)."""
        return f"{self.prefix}:qworst:{flag}"

    def quality(self) -> str:
        """Hash: the run's quality counts since it began, ``<partition>|judged`` and
        ``<partition>|<flag>`` (:data:`tokenmill.quality.SIGNALS`), counted by the commit."""
        return f"{self.prefix}:quality"

    def quality_window(self, partition: str) -> str:
        """List: the quality masks of a partition's latest judged jobs, newest first (at most
        ``quality_window_jobs``; cleared by ``resume``)."""
        return f"{self.prefix}:qwin:{partition}"

    def quality_window_counts(self) -> str:
        """Hash: ``<partition>|n`` (jobs judged since the run began or its last resume) and
        ``<partition>|<flag>`` (the flag's count in the partition's window)."""
        return f"{self.prefix}:qwinc"

    def quality_rules(self) -> str:
        """Hash: the run's stop rules, expression → ``op value min_jobs name``."""
        return f"{self.prefix}:qrules"

    def quality_reference(self) -> str:
        """Hash: the run's reference (``url``, ``sample``, ``min``, its latest ``error``) and per
        partition the reference scorer's sums (``n``, sum, sum of squares of the per-job score
        difference; :mod:`tokenmill.quality_drift`)."""
        return f"{self.prefix}:qref"

    def reference_todo(self) -> str:
        """List: the sampled jobs waiting for the reference scorer (JSON: partition, job id,
        request, output), newest first (capped)."""
        return f"{self.prefix}:qref:todo"

    def reference_lock(self) -> str:
        """Lock: the one worker scoring the run's sampled jobs on its reference at a time."""
        return f"{self.prefix}:qref:lock"

    def paused(self) -> str:
        """Hash: present while the run is paused: ``reason``, ``at_ms``, ``by`` (rule | person)."""
        return f"{self.prefix}:paused"

    def series(self) -> str:
        """Stream: the run's counters over time, one point a step while it moves, written by the
        upkeep (:mod:`tokenmill.history`)."""
        return f"{self.prefix}:series"

    # -- sealing: done results move into shards of the result store (producer/sealing.py) ------

    def unsealed(self, partition: str) -> str:
        """Sorted set: done job id not yet sealed → its enqueue sequence."""
        return f"{self.prefix}:unsealed:{partition}"

    def seal_since(self) -> str:
        """Hash: partition → when (ms) its oldest unsealed result started waiting for a shard."""
        return f"{self.prefix}:seal_since"

    def shard(self, shard_id: str) -> str:
        """Hash: one shard's manifest (partition, state, job ids while it is being sealed)."""
        return f"{self.prefix}:shard:{shard_id}"

    def shards(self, partition: str) -> str:
        """Set: the sealed shards of a partition (export reads exactly these)."""
        return f"{self.prefix}:shards:{partition}"

    def seals_pending(self) -> str:
        """Set: shards whose manifest is recorded but whose jobs are not all sealed yet."""
        return f"{self.prefix}:seals_pending"

    def sealed(self) -> str:
        """Hash: partition → sealed jobs (they also count as ``done`` in the counts hash)."""
        return f"{self.prefix}:sealed"

    def results_store(self) -> str:
        """String: the result store URL the run's shards are written to (set by the first seal)."""
        return f"{self.prefix}:results"
