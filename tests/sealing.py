"""Helpers for the sealing tests: a run of done jobs, the CLI's export as bytes, and checks that
an export holds every distinct prompt exactly once."""

from __future__ import annotations

import signal
from pathlib import Path
from typing import Any

import orjson
import redis

from producer.export import export_row
from tests.finishing import finish_jobs
from tests.pipeline import cli, mixed_rows, write_jsonl
from tokenmill import keys
from tokenmill.ledger import Ledger

MEAN = 40
MAX_TOKENS = 60


def sealing_env(redis_url: str, store: str | Path, **settings: Any) -> dict[str, str]:
    env = {"TOKENMILL_REDIS_URL": redis_url, "TOKENMILL_RESULTS_URL": str(store)}
    env.update({f"TOKENMILL_{k.upper()}": str(v) for k, v in settings.items()})
    return env


def enqueue_run(
    where: Path, env: dict[str, str], run: str, sizes: dict[str, int], **flags: str
) -> list[Path]:
    """Enqueue ``sizes`` rows per partition (mixed rows, unicode, some routed to the long queue)."""
    files = [write_jsonl(where / f"{part}.jsonl", mixed_rows(part, n)) for part, n in sizes.items()]
    extra = [x for k, v in flags.items() for x in (f"--{k.replace('_', '-')}", v)]
    cli("enqueue", *map(str, files), "--run", run, "--short-max-tokens", str(MAX_TOKENS),
        "--long-max-tokens", str(MAX_TOKENS), "--long-prompt-tokens", "300", *extra, env=env)  # fmt: skip
    return files


def done_run(
    where: Path, client: redis.Redis, env: dict[str, str], run: str, sizes: dict[str, int], **flags: str
) -> int:
    """A run whose every job is done (committed through the ledger with the sim's output)."""
    enqueue_run(where, env, run, sizes, **flags)
    return finish_jobs(client, run, mean_output_tokens=MEAN)


def export(env: dict[str, str], run: str, out: Path, *more: str) -> dict[str, bytes]:
    """``tokenmill export --include-truncated``: each file's bytes by name."""
    cli("export", "--run", run, "--out", str(out), "--include-truncated", *more, env=env)
    return {p.name: p.read_bytes() for p in sorted(out.iterdir()) if not p.name.startswith(".")}


def seal(env: dict[str, str], *more: str, check: bool = True) -> str:
    res = cli("seal", "--once", *more, env=env, check=check)
    return res.stdout + res.stderr


def crash_sealer(env: dict[str, str], step: str, *more: str) -> str:
    """``tokenmill seal --once --crash-at STEP``: a sealer that SIGKILLs itself at that step (or
    finds nothing to seal); then its seal lock is let go, as its TTL would after at most 30 s.
    Returns what it printed, and ``killed`` when it died there."""
    res = cli("seal", "--once", *more, "--crash-at", step, env=env, check=False, timeout=120)
    redis.Redis.from_url(env["TOKENMILL_REDIS_URL"]).delete(keys.seal_lock())
    return "killed" if res.returncode == -signal.SIGKILL else res.stdout + res.stderr


def sealed_count(client: redis.Redis, run: str) -> int:
    """Jobs of ``run`` sealed so far (the sealed counts hash, summed over partitions)."""
    return sum(int(v) for v in client.hvals(keys.RunKeys(run).sealed()))


def export_as_before_sealing(client: redis.Redis, run: str) -> dict[str, bytes]:
    """The export as tokenmill wrote it before sealing existed (its ``export_run`` up to commit
    71e4cb9, with ``--include-truncated``): per partition, each done job in enqueue order, its
    export row as one JSON line. Read from Redis, so only meaningful before anything is sealed."""
    ledger = Ledger(client, run)
    out: dict[str, bytes] = {}
    for partition in sorted(ledger.counts()):
        lines = []
        for job_id, (state, spec, result) in ledger.iter_jobs(partition, ("state", "spec", "result")):
            if state != b"done" or result is None or spec is None:
                continue
            row = export_row(job_id, partition, orjson.loads(spec), orjson.loads(result))
            lines.append(orjson.dumps(row) + b"\n")
        out[f"{partition}.jsonl"] = b"".join(lines)
    return out


def prompts_once(files: dict[str, bytes]) -> dict[str, int]:
    """How many rows each distinct prompt (input messages) has, over every exported file."""
    seen: dict[str, int] = {}
    for data in files.values():
        for line in data.splitlines():
            key = orjson.dumps(orjson.loads(line)["messages"][:-1]).decode()
            seen[key] = seen.get(key, 0) + 1
    return seen


def job_states(client: redis.Redis, run: str) -> dict[str, int]:
    """How many jobs of ``run`` are in each state (read from the job hashes)."""
    k = keys.RunKeys(run)
    out: dict[str, int] = {}
    for part in client.smembers(k.partitions()):
        for job_id in client.lrange(k.jobs(part.decode()), 0, -1):
            state = (client.hget(k.job(job_id.decode()), "state") or b"?").decode()
            out[state] = out.get(state, 0) + 1
    return out


def run_key_bytes(client: redis.Redis, run: str) -> int:
    """MEMORY USAGE summed over every key of ``run`` (the broker's lists are not the run's)."""
    keys_ = client.scan_iter(match=f"tm:{run}:*", count=1000)
    return sum(int(client.memory_usage(key, samples=0) or 0) for key in keys_)
