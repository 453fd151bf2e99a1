"""The reference scorer: sampled jobs of a run scored on the run's reference server by teacher
forcing (:mod:`tokenmill.quality_drift` owns the figures and their meaning).

At commit (:meth:`Scorer.after_commit`, called by ``workers/job_path.py``), a job of a run that
names a reference is sampled with the run's ``sample`` probability, and always while its
partition has fewer than ``min`` sampled jobs; a sampled job's entry (its request and output,
JSON) goes to the run's to-do list (``qref_sample.lua``). A run without a reference costs a
dict lookup: the runs' references are read by the scorer's thread every ``REFRESH_S``.

The scorer's thread, in every worker, takes a run's lock (one scorer a run at a time, so its
reference sees one request at a time: never the run's own servers or their admission slots,
and never the worker's event loop), takes the oldest entry and scores it with three requests
to the reference (SGLang 0.5.23):

1. its own output: ``POST /v1/chat/completions``, the job's messages and options, not streamed,
   with ``return_token_ids`` (``entrypoints/openai/protocol.py:963``): the choice's
   ``prompt_token_ids`` are the prompt as the reference's chat template renders it
   (``serving_chat.py:2976-2982``, ``protocol.py:1318-1319``) and ``response_token_ids`` its output;
2. when the job kept no token ids, both outputs' text as token ids: ``POST /v1/tokenize`` with
   ``prompt`` a list of strings and ``add_special_tokens: false``
   (``serving_tokenize.py:63-72``, ``protocol.py:1744-1762``); the text is the reasoning, the
   think-end tag and the content, as the model wrote it (tool calls are not rebuilt: a job
   whose outputs have no text is skipped);
3. ``POST /generate`` with ``input_ids`` ``[prompt + produced, prompt + own]``,
   ``return_logprob: true``, ``logprob_start_len: len(prompt) - 1`` and ``max_new_tokens: 0``
   (``managers/io_struct.py:185-237``; 0 is valid, ``sampling/sampling_params.py:285-288``):
   each answer's ``meta_info.input_token_logprobs`` holds ``[logprob, token_id, null]`` for
   every input token from ``logprob_start_len`` on, the first one's logprob ``null``
   (``managers/scheduler_components/logprob_result_processor.py:37-50``,
   ``managers/tokenizer_manager.py:2850-2868``): the rest are the output's tokens, each
   scored given everything before it. Prompt log-probabilities are the model's own
   distribution (``layers/logprob_processor.py``, no temperature), as are the logprobs SGLang
   reports while generating greedily (``layers/sampler.py:192-222``).

The job's difference (own mean - produced mean) is added to the partition's sums, and the run's
``drift`` rules are judged on the new mean; a rule that trips pauses the run
(:func:`tokenmill.transitions.pause`). A reference that cannot be reached, answers 5xx or not
within ``quality_reference_timeout_s`` (one deadline for a job's three requests: a host that
vanished accepts connections and never answers) leaves the entry at the head of the line and
its error in ``qref``; the scorer tries that run again after ``BACKOFF_S``. A request the
reference refuses (4xx) counts the job ``skipped``.
"""

from __future__ import annotations

import contextlib
import logging
import random
import threading
import time
import urllib.error
import urllib.request
from typing import TYPE_CHECKING, Any

import orjson
import redis

from tokenmill import errors, keys
from tokenmill import quality_drift as qd
from tokenmill import transitions as t
from tokenmill.ledger import Ledger
from tokenmill.options import PER_TOKEN, SGLEXT_OUTPUT_IDS
from tokenmill.quality import DRIFT, parse_rule
from tokenmill.settings import Settings
from tokenmill.url_secrets import redact_url
from workers import taxonomy

if TYPE_CHECKING:
    from tokenmill.ledger_async import AsyncLedger
    from workers.attempt import Attempted, Commit

log = logging.getLogger("tokenmill.reference")
REFRESH_S = 2.0  # how often the runs' references are read
PERIOD_S = 0.5  # how often an idle scorer looks for work
BACKOFF_S = 10.0  # before a run whose reference failed is tried again
TODO_CAP = 10_000  # sampled entries kept waiting a run (the newest)
LOCK_SLACK_S = 30.0  # a run's scoring lock outlives the scoring's deadline by this


def mean_logprob(answer: dict[str, Any], expected: list[int]) -> float:
    """The mean logprob of ``expected`` (the output's ids) in a ``/generate`` answer whose
    ``input_token_logprobs`` start one token before them."""
    rows = answer["meta_info"]["input_token_logprobs"][1:]
    ids = [row[1] for row in rows]
    if ids != expected:
        raise errors.IncompleteOutputError(f"the reference scored tokens {ids[:8]}..., not {expected[:8]}...")
    return sum(float(row[0]) for row in rows) / len(rows)


def output_text(message: dict[str, Any], think_end_tag: str) -> str:
    """An output as the model wrote it: its reasoning, the think-end tag, its content."""
    reasoning, content = message.get("reasoning_content") or "", message.get("content") or ""
    return reasoning + think_end_tag + content if reasoning and content else reasoning or content


class ReferenceServer:
    """A reference server's endpoints (blocking: called from the scorer's thread)."""

    def __init__(self, url: str, api_key: str | None, timeout_s: float = 600.0) -> None:
        self.url, self.timeout_s = url.rstrip("/"), timeout_s
        self.deadline = time.monotonic() + timeout_s  # of every request made through this object
        self.headers = {"Content-Type": "application/json"}
        if api_key:
            self.headers["Authorization"] = f"Bearer {api_key}"

    def post(self, path: str, body: dict[str, Any]) -> Any:
        req = urllib.request.Request(self.url + path, orjson.dumps(body), self.headers, method="POST")
        try:
            if (left := self.deadline - time.monotonic()) <= 0:
                raise TimeoutError(f"the reference's {self.timeout_s:g} s deadline passed before {path}")
            with urllib.request.urlopen(req, timeout=left) as resp:
                return orjson.loads(resp.read())
        except urllib.error.HTTPError as exc:
            raise taxonomy.from_answer(exc.code, exc.read()) from None
        except (OSError, orjson.JSONDecodeError) as exc:
            raise taxonomy.from_exception(exc) from None

    def teacher_force(self, prompt: list[int], outputs: list[list[int]]) -> list[float]:
        """The mean logprob the reference gives each of ``outputs`` after ``prompt``."""
        body = {
            "input_ids": [prompt + ids for ids in outputs],
            "return_logprob": True,
            "logprob_start_len": [len(prompt) - 1] * len(outputs),
            "sampling_params": {"max_new_tokens": 0},
        }
        answers = self.post("/generate", body)
        return [mean_logprob(a, ids) for a, ids in zip(answers, outputs, strict=True)]

    def score(self, request: dict[str, Any], produced: dict[str, Any], think_end_tag: str) -> float | None:
        """Score a job's ``produced`` output (its result) for its ``request``: the reference's mean
        per-token logprob of its own output less that of the produced one; None when either output
        has no tokens to score."""
        body = {k: v for k, v in request.items() if k not in PER_TOKEN}
        body.update(stream=False, return_token_ids=True)
        choice = self.post("/v1/chat/completions", body)["choices"][0]
        prompt: list[int] = choice["prompt_token_ids"]
        if produced.get("output_token_ids") is not None:
            outputs = [produced["output_token_ids"], choice["response_token_ids"]]
        else:
            texts = [output_text(produced, think_end_tag), output_text(choice["message"], think_end_tag)]
            outputs = self.post("/v1/tokenize", {"prompt": texts, "add_special_tokens": False})["tokens"]
        if not prompt or not all(outputs):
            return None
        theirs, own = self.teacher_force(prompt, outputs)
        return own - theirs


def entry(done: Attempted, commit: Commit, model: str) -> bytes:
    """What the scorer needs of a committed job (its result may be sealed away before then)."""
    result = commit.result
    kept = {k: result.get(k) for k in ("content", "reasoning_content", "output_token_ids")}
    if result.get("continued_tokens"):
        kept["output_token_ids"] = None  # a continuation's ids cover only its own tokens
    request = {"model": model, **done.claim.spec["request"]}
    request.pop(SGLEXT_OUTPUT_IDS, None)
    return orjson.dumps(
        {"partition": done.claim.partition, "job": done.claim.job_id, "request": request, "result": kept}
    )


def _reference(raw: Any) -> qd.Reference | None:
    """The reference of a run's ``qref`` hash (a mapping, or HGETALL's flat reply)."""
    if isinstance(raw, list):
        raw = dict(zip(raw[::2], raw[1::2], strict=True))
    try:
        return qd.Reference.of(qd.decode(raw))
    except (errors.ConfigError, ValueError) as exc:
        log.warning("a run's reference is not usable: %s", exc)
        return None


class Scorer(threading.Thread):
    """The worker process's reference scorer (see the module's docstring)."""

    def __init__(self, client: redis.Redis, settings: Settings) -> None:
        super().__init__(name="tokenmill-reference", daemon=True)
        self.r, self.settings = client, settings
        self.references: dict[str, qd.Reference | None] = {}  # run -> its reference, every REFRESH_S
        self.sampled: dict[tuple[str, str], int] = {}  # (run, partition) -> sampled, as last seen
        self.resting: dict[str, float] = {}  # run -> when its failed reference is tried again
        self.refreshed = 0.0

    # -- on the event loop, after a commit: a dict lookup unless the run names a reference -----

    async def after_commit(self, led: AsyncLedger, done: Attempted, commit: Commit) -> None:
        run = done.claim.run
        k = keys.RunKeys(run)
        if run not in self.references:  # a run begun since the last refresh: read once
            with contextlib.suppress(redis.RedisError):
                self.references[run] = await led.call(
                    t.Call("", [], ["HGETALL", k.quality_reference()], _reference)
                )
        ref = self.references.get(run)
        if ref is None:
            return
        at = (run, done.claim.partition)
        drawn = random.random() < ref.sample
        if not drawn and self.sampled.get(at, 0) >= ref.minimum:
            return
        call = t.reference_sample(
            k,
            qd.field(at[1], qd.SAMPLED),
            entry(done, commit, self.settings.model),
            drawn,
            ref.minimum,
            TODO_CAP,
        )
        try:
            self.sampled[at] = await led.call(call)
        except redis.RedisError as exc:
            log.warning("run %s: job %s not sampled for the reference: %s", *at, exc)

    # -- the thread ---------------------------------------------------------------------------

    def run(self) -> None:
        while True:
            busy = False
            try:
                if time.monotonic() - self.refreshed > REFRESH_S:
                    self.refresh()
                for run, ref in list(self.references.items()):
                    if ref is not None:
                        busy |= self.score_run(run, ref)
            except redis.RedisError as exc:
                log.warning("reference scoring paused: %s", exc)
            except Exception:
                log.exception("reference scoring failed")
            time.sleep(0 if busy else PERIOD_S)

    def refresh(self) -> None:
        """The runs' references (and what each process has sampled, for the least per partition)."""
        runs = sorted(map(qd.text, self.r.smembers(keys.runs())))
        pipe = self.r.pipeline(transaction=False)
        for run in runs:
            pipe.hgetall(keys.RunKeys(run).quality_reference())
        references: dict[str, qd.Reference | None] = {}
        for run, raw in zip(runs, pipe.execute(), strict=True):
            fields = qd.decode(raw)
            references[run] = ref = _reference(fields)
            if ref is not None:
                for partition, f in qd.per_partition(fields).items():
                    self.sampled[(run, partition)] = int(f.get(qd.SAMPLED) or 0)
        self.references, self.refreshed = references, time.monotonic()

    def score_run(self, run: str, ref: qd.Reference) -> bool:
        """Score the run's oldest sampled job if this process holds its lock; whether it did."""
        k = keys.RunKeys(run)
        if self.resting.get(run, 0) > time.monotonic() or not self.r.llen(k.reference_todo()):
            return False
        timeout_s = self.settings.quality_reference_timeout_s
        lock = self.r.lock(k.reference_lock(), timeout=timeout_s + LOCK_SLACK_S, blocking=False)
        if not lock.acquire(blocking=False):
            return False
        try:
            head = self.r.lindex(k.reference_todo(), -1)
            if head is None:
                return False
            raw = qd.text(head)
            job = orjson.loads(raw)
            partition = job["partition"]
            try:
                scored = ReferenceServer(ref.url, self.settings.api_key, timeout_s).score(
                    job["request"], job["result"], self.settings.think_end_tag
                )
            except errors.TerminalError as exc:
                log.warning("run %s: job %s not scored on the reference: %s", run, job["job"], exc.message)
                scored = None
            except errors.GenerationError as exc:
                self.resting[run] = time.monotonic() + BACKOFF_S
                self.r.hset(
                    k.quality_reference(),
                    mapping={qd.ERROR: exc.message, qd.ERROR_MS: int(time.time() * 1000)},
                )
                log.warning("run %s: reference %s unavailable: %s", run, redact_url(ref.url), exc.message)
                return False
            self.record(k, partition, raw, scored)
            return True
        finally:
            lock.release()

    def record(self, k: keys.RunKeys, partition: str, raw: str, scored: float | None) -> None:
        """Take the entry off the to-do list, add its figures, judge the run's ``drift`` rules."""
        pipe = self.r.pipeline(transaction=True)
        pipe.lrem(k.reference_todo(), -1, raw)
        pipe.hdel(k.quality_reference(), qd.ERROR, qd.ERROR_MS)
        q = k.quality_reference()
        if scored is None:
            pipe.hincrby(q, qd.field(partition, qd.SKIPPED), 1)
            pipe.execute()
            return
        pipe.hincrby(q, qd.field(partition, qd.N), 1)
        pipe.hincrbyfloat(q, qd.field(partition, qd.SUM), scored)
        pipe.hincrbyfloat(q, qd.field(partition, qd.SUMSQ), scored * scored)
        pipe.hgetall(k.quality_rules())
        *_, n, total, squares, rules = pipe.execute()
        drift = qd.Drift(int(n), float(total), float(squares))
        for expr in qd.decode(rules):
            rule = parse_rule(expr)
            if rule.name == DRIFT and rule.trips(drift.mean, drift.n):
                reason = (
                    f"quality rule {expr} tripped on partition {partition}: "
                    f"{drift.mean:.3f} over {drift.n} jobs"
                )
                if Ledger(self.r, k.run).call(t.pause(k, reason, "rule")):
                    log.warning("run %s paused: %s", k.run, reason)
