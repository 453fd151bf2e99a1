"""Two real SGLang servers: tokenmill's choice of server against SGLang's router (issue 31, item 3).

Two SGLang 0.5.23 servers, one core each, serve a model big enough that prefill shows in wall
time (:data:`MODEL`); the same jobs go through each variant:

- ``least-loaded``: tokenmill (a private Redis, one real ``tokenmill worker`` with its default
  150 threads, ``--worker-threads``: admission decides how many stream) with both servers
  in ``TOKENMILL_SERVER_URL`` and ``TOKENMILL_SERVER_AFFINITY=0``: each job to the least full one;
- ``affinity``: the same with ``TOKENMILL_SERVER_AFFINITY=1`` (a setting that has no effect on a
  tokenmill without it: the two variants are then the same);
- ``cache_aware``, ``round_robin``: no tokenmill; the direct asyncio client of bench/e2e.py sends
  the same requests, ``--concurrency`` (32) at a time, through SGLang's router
  (``sglang_router.launch_router``, from the SGLang venv) with that policy.

Workloads (:func:`workload`): ``shared``, prefixes shared as datasets share them: prompts enqueued
with ``--samples``, rows that open with one of two long few-shot blocks (one a system message,
the other example turns) and end with their own question, and multi-turn conversations (turn k's
messages are turn k-1's, its answer and a new question); ``none``, the same jobs each made unique
at its first word, so that nothing is shared.

A round of a workload holds ``--lock`` (a flock), starts the two servers, warms each up, then
runs every variant on them in turn, the order rotated by round, flushing both servers' prefix
caches (``/flush_cache``) before each; then it stops the servers and lets the lock go. Per
variant: the wall time from the first request (tokenmill: from the enqueue) to the last
completion, and from SGLang's own log lines the prompt tokens it computed (``#new-token``) and
found cached (``#cached-token``) in its prefill batches, split by server, and its retractions.
The table gives the medians of the rounds and each round's figure.

    python bench/servers.py --engine sglang --lock /tmp/tokenmill-heavy.lock   # ~16 min under the lock
    python bench/servers.py --engine sglang --workloads shared --only affinity,cache_aware --rounds 1

Only the real engine has a prefix cache (the sim has none), so ``--engine`` has one choice.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import statistics
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson
import redis
from _common import (
    ROOT,
    Children,
    MachineLoad,
    SglangLog,
    busy_cpu_s,
    exit_on_sigterm,
    heavy,
    http_status,
    machine,
    own_cpu_s,
    setting,
    settings_text,
    start_worker,
    table,
    tree_cpu_s,
    verdict,
    wait_for,
    wait_quiet,
    workdir,
)

from tokenmill import keys
from tokenmill.local_redis import free_port

RUN = "b"
PARTITION = "P"
VARIANTS = ("least-loaded", "affinity", "cache_aware", "round_robin")
WORKLOADS = ("shared", "none")
# The model: the tiny test model's tokenizer and chat template with a bigger Qwen2 network
# (dummy weights): ~13M parameters outside the embedding, so that on one core a 1,500-token
# prefill (0.72 s) costs 2.5x a 32-token answer to a short prompt (0.27-0.31 s), measured
# 2026-12-02; the test model's (hidden 64, 2 layers) prefill is lost in the per-step overheads.
MODEL = {"hidden_size": 512, "num_hidden_layers": 4, "intermediate_size": 1536, "num_attention_heads": 8}
SERVER_CORES = ("0", "1")  # one core per server, as two GPUs; the clients float (they use ~1%)
WORDS = (
    "the a of to in is for on with as by this that be are from or an it at which not can if all "
    "will when has one their more time data value return list object string number function class "
    "method result error file name type default case first each other new used way"
).split()


def words(rng: random.Random, n: int) -> str:
    """``n`` words of plain text (about one token each with the test tokenizer)."""
    return " ".join(rng.choice(WORDS) for _ in range(n))


# --- the workloads --------------------------------------------------------------------------------


@dataclass
class Workload:
    """Rows in files, each file enqueued with its own ``--samples`` (None: one job a row)."""

    name: str
    parts: list[tuple[Path, int | None]] = field(default_factory=list)

    def jobs(self) -> int:
        return sum(sum(1 for _ in path.open()) * (samples or 1) for path, samples in self.parts)


@dataclass(frozen=True)
class Sizes:
    """The shape of the ``shared`` workload (words are about tokens)."""

    sampled: int = 6  # prompts enqueued with --samples
    samples: int = 4
    sampled_words: int = 800
    fewshot_blocks: int = 2
    fewshot_rows: int = 10  # rows per block, each with its own question
    fewshot_words: int = 1200
    question_words: int = 20
    conversations: int = 4
    turns: int = 4
    turn_words: int = 150  # an answer, and a question, each


def shared_rows(sz: Sizes, rng: random.Random) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(rows to enqueue with --samples, the other rows: few-shot and conversation turns, shuffled)."""
    sampled = [
        {"id": f"s{i}", "prompt": f"Task {i}. {words(rng, sz.sampled_words)}"} for i in range(sz.sampled)
    ]
    rest: list[dict[str, Any]] = []
    for b in range(sz.fewshot_blocks):
        block = fewshot_block(b, sz, rng)
        for q in range(sz.fewshot_rows):
            question = f"Question {b}-{q}: {words(rng, sz.question_words)}?"
            rest.append({"id": f"f{b}-{q}", "messages": [*block, {"role": "user", "content": question}]})
    for c in range(sz.conversations):
        messages = [{"role": "user", "content": f"Conversation {c}. {words(rng, sz.turn_words)}"}]
        for t in range(sz.turns):
            rest.append({"id": f"c{c}-{t}", "messages": list(messages)})
            messages += [
                {"role": "assistant", "content": words(rng, sz.turn_words)},
                {"role": "user", "content": words(rng, sz.turn_words)},
            ]
    rng.shuffle(rest)
    return sampled, rest


def fewshot_block(b: int, sz: Sizes, rng: random.Random) -> list[dict[str, str]]:
    """Few-shot block ``b`` as the messages before a row's question: even blocks a system message,
    odd ones example turns (a user message and the assistant's answer), the two ways datasets
    write them."""
    n = sz.fewshot_words
    if b % 2 == 0:
        return [{"role": "system", "content": f"Examples {b}. {words(rng, n)}"}]
    return [
        {"role": "user", "content": f"Examples {b}. {words(rng, n // 2)}"},
        {"role": "assistant", "content": words(rng, n - n // 2)},
    ]


def unshared(rows: list[dict[str, Any]], samples: int) -> list[dict[str, Any]]:
    """Each row ``samples`` times, every copy made unique at its first word: the same prompt
    sizes with no prefix shared."""
    out = []
    for row in rows:
        for k in range(samples):
            tag = f"{row['id']}.{k}"
            if "prompt" in row:
                out.append({"id": tag, "prompt": f"{tag} {row['prompt']}"})
            else:
                first, *others = row["messages"]
                first = {**first, "content": f"{tag} {first['content']}"}
                out.append({"id": tag, "messages": [first, *others]})
    return out


def workload(name: str, where: Path, sz: Sizes, seed: int = 0) -> Workload:
    """The ``shared`` or ``none`` workload's files under ``where`` (the same text for both)."""
    sampled, rest = shared_rows(sz, random.Random(seed))
    if name == "shared":
        files = [(sampled, sz.samples), (rest, None)]
    else:
        files = [(unshared(sampled, sz.samples), None), (unshared(rest, 1), None)]
    wl = Workload(name)
    for i, (rows, samples) in enumerate(files):
        path = where / f"{name}-{i}.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
        wl.parts.append((path, samples))
    return wl


def routing(args: argparse.Namespace) -> Any:
    """Every prompt short, ``--max-tokens``, greedy."""
    from producer.enqueue import Routing

    return Routing(
        model="default",
        short_max_tokens=args.max_tokens,
        long_prompt_tokens=100_000,
        params={"temperature": 0.0},
    )


def direct_requests(wl: Workload, args: argparse.Namespace) -> list[dict[str, Any]]:
    """The workload's jobs as the direct client sends them: the requests tokenmill's producer
    makes (samples included), in the order it enqueues them."""
    from producer.readers import iter_records
    from producer.rows import normalize_row

    route, reqs = routing(args), []
    for path, samples in wl.parts:
        for rec in iter_records(path):
            row = normalize_row(rec.source, rec.data)
            specs = route.samples(row, PARTITION, rec.source, samples) if samples else [
                route.spec(row, PARTITION, rec.source)]  # fmt: skip
            reqs += [{"id": s.job_id, "queue": "short", "request": s.request} for s in specs]
    return reqs


# --- the servers ------------------------------------------------------------------------------


def make_model(where: Path) -> Path:
    """The bench's model directory: the test model's tokenizer files and a bigger ``config.json``
    (served with ``--load-format dummy``: random weights, no file)."""
    sys.path.insert(0, str(ROOT))  # tests/ is not an installed package
    from tests.engines import sglang_env

    src, dst = sglang_env().model, where / "model"
    dst.mkdir(parents=True, exist_ok=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(src / name, dst / name)
    config = json.loads((src / "config.json").read_text())
    config.update(MODEL, num_key_value_heads=2)
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    return dst


def start_servers(children: Children, where: Path, model: Path, kv: int) -> list[Any]:
    """The two servers, launched side by side, each on its core; ready (``/health`` 200) and
    warmed up (one long prompt each, then the prefix cache flushed)."""
    from tests.engines import start_engine, wait_healthy

    flags = ("--model-path", str(model), "--load-format", "dummy", "--max-total-tokens", str(kv))
    engines = []
    for core in SERVER_CORES:
        engine = start_engine("sglang", where, *flags, cpus=core, wait_ready=False)
        children.callback(engine.stop)
        engines.append(engine)
    for engine in engines:
        wait_healthy(engine)
    rng = random.Random(-1)
    for engine in engines:
        chat(engine.url, f"Warm-up. {words(rng, 1500)}", 8)
        flush(engine.url)
    return engines


def chat(url: str, text: str, max_tokens: int) -> dict[str, Any]:
    body = {"model": "default", "messages": [{"role": "user", "content": text}], "max_tokens": max_tokens}
    req = urllib.request.Request(
        f"{url}/v1/chat/completions", orjson.dumps(body), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=300) as resp:
        return dict(json.loads(resp.read()))


def flush(url: str) -> None:
    """Empty the server's prefix cache (SGLang refuses while a request runs: retried)."""
    wait_for(lambda: http_status_post(f"{url}/flush_cache") == 200, 60, f"{url}/flush_cache")


def http_status_post(url: str) -> int:
    try:
        with urllib.request.urlopen(urllib.request.Request(url, b"", method="POST"), timeout=30) as resp:
            return int(resp.status)
    except urllib.error.HTTPError as exc:
        return int(exc.code)
    except OSError:
        return 0


def clean_start(engines: list[Any]) -> list[int]:
    """Flush the servers' prefix caches; where their logs stand now (a variant's lines follow)."""
    for engine in engines:
        flush(engine.url)
    return [engine.log.stat().st_size for engine in engines]


# --- the variants -------------------------------------------------------------------------------


def run_tokenmill(
    work: Path, wl: Workload, engines: list[Any], args: argparse.Namespace, affinity: bool
) -> tuple[float, list[int]]:
    """One worker of ``--worker-threads`` threads on both servers; the wall time from the enqueue to
    the last commit, and the servers' log offsets at its start."""
    from producer.enqueue import Enqueuer
    from tokenmill.ledger import Ledger

    with Children() as children:
        rds = children.redis(work / f"redis-{time.monotonic_ns()}")
        env = {
            "TOKENMILL_REDIS_URL": rds.url,
            "TOKENMILL_SERVER_URL": ",".join(e.url for e in engines),
            "TOKENMILL_SERVER_AFFINITY": "1" if affinity else "0",
            **dict(args.worker_env),
        }
        start_worker(children, work, "short", args.worker_threads, env)
        client = redis.Redis.from_url(rds.url)
        route, total, counts = routing(args), wl.jobs(), keys.RunKeys(RUN).counts()
        offsets = clean_start(engines)
        t0 = time.monotonic()
        for path, samples in wl.parts:
            Enqueuer(Ledger(client, RUN), route, max_queued=100_000, samples=samples).enqueue_file(
                path, PARTITION
            )
        wait_for(
            lambda: int(client.hget(counts, f"done|{PARTITION}") or 0) == total,
            args.timeout,
            f"tokenmill to finish {wl.name}",
        )
        return time.monotonic() - t0, offsets


def start_router(children: Children, work: Path, urls: list[str], policy: str) -> str:
    """SGLang's router (from the SGLang venv) with ``policy`` in front of ``urls``, ready."""
    from tests.engines import sglang_env

    port = free_port()
    args = [
        str(sglang_env().python), "-m", "sglang_router.launch_router", "--worker-urls", *urls,
        "--policy", policy, "--host", "127.0.0.1", "--port", str(port),
        "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()),
        "--worker-startup-check-interval", "1",
        "--disable-health-check",  # its probes (a prefill each) would add to the counts
    ]  # fmt: skip
    router = children.spawn(f"router-{policy}", args, work / f"router-{policy}-{port}.log")
    url = f"http://127.0.0.1:{port}"

    def ready() -> bool:
        if not router.alive():
            raise RuntimeError(f"the router exited:\n{router.output()[-3000:]}")
        return http_status(f"{url}/readiness") == 200

    wait_for(ready, 120, f"the router on {url}", 0.2)
    return url


def run_router(
    work: Path, reqs_path: Path, engines: list[Any], args: argparse.Namespace, policy: str
) -> tuple[float, list[int]]:
    """The direct client through the router at ``--concurrency``; its wall time and the servers'
    log offsets at its start (after the router's own requests to them)."""
    with Children() as children:
        router = start_router(children, work, [e.url for e in engines], policy)
        offsets = clean_start(engines)
        out = work / f"direct-{time.monotonic_ns()}.json"
        argv = [sys.executable, str(ROOT / "bench" / "e2e.py"), "--direct-client", router, str(reqs_path),
                str(out), "--short-concurrency", str(args.concurrency)]  # fmt: skip
        child = children.spawn("direct", argv, work / "direct.log")
        wait_for(lambda: not child.alive(), args.timeout, "the direct client to finish", 0.1)
        if child.proc.returncode != 0:
            raise RuntimeError(f"the direct client failed:\n{child.output()[-3000:]}")
        return float(orjson.loads(out.read_bytes())["wall_s"]), offsets


def run_variant(work: Path, wl: Workload, reqs_path: Path, engines: list[Any], args: argparse.Namespace,
                variant: str) -> dict[str, Any]:  # fmt: skip
    """``variant`` on the running servers, their prefix caches flushed first; what it took, and
    the cores other processes of the machine used meanwhile (``others_cores``: noise)."""

    def ours() -> float:
        return own_cpu_s() + sum(tree_cpu_s(e.pid) for e in engines)

    t0, busy0, ours0 = time.monotonic(), busy_cpu_s(), ours()
    if variant in ("least-loaded", "affinity"):
        wall, offsets = run_tokenmill(work, wl, engines, args, affinity=variant == "affinity")
    else:
        wall, offsets = run_router(work, reqs_path, engines, args, variant)
    others = max(0.0, busy_cpu_s() - busy0 - (ours() - ours0)) / (time.monotonic() - t0)
    logs = [SglangLog.since(e.log, off) for e, off in zip(engines, offsets, strict=True)]
    return {
        "jobs": wl.jobs(),
        "wall_s": round(wall, 2),
        "new_tokens": sum(x.new_tokens for x in logs),
        "cached_tokens": sum(x.cached_tokens for x in logs),
        "new_by_server": [x.new_tokens for x in logs],
        "retractions": sum(x.retractions for x in logs),
        "others_cores": round(others, 2),
    }


def rotated(items: tuple[str, ...] | list[str], k: int) -> list[str]:
    """``items`` rotated left by ``k``: each round starts with another variant."""
    k %= len(items)
    return [*items[k:], *items[:k]]


def measure(work: Path, args: argparse.Namespace) -> Iterator[tuple[str, str, dict[str, Any]]]:
    """(workload, variant, figures) of each run: rounds, then workloads, then variants rotated."""
    model = make_model(work)
    loads = {name: workload(name, work, Sizes()) for name in args.workloads}
    reqs = {}
    for name, wl in loads.items():
        reqs[name] = work / f"{name}-requests.json"
        reqs[name].write_bytes(orjson.dumps(direct_requests(wl, args)))
    for rnd in range(args.rounds):
        for name, wl in loads.items():
            with heavy(args.lock), Children() as children:
                engines = start_servers(children, work / f"r{rnd}-{name}", model, args.kv)
                for variant in rotated(args.only, rnd):
                    yield (
                        name,
                        variant,
                        {"round": rnd, **run_variant(work, wl, reqs[name], engines, args, variant)},
                    )


# --- the report ---------------------------------------------------------------------------------


def report(name: str, results: dict[str, list[dict[str, Any]]], args: argparse.Namespace) -> str:
    """The table of one workload (medians, then each round's figure), and the verdicts."""

    def med(rs: list[dict[str, Any]], key: str) -> float:
        return float(statistics.median(r[key] for r in rs))

    def each(rs: list[dict[str, Any]], key: str, fmt: str = "{}") -> str:
        return ", ".join(fmt.format(r[key]) for r in rs)

    ref = med(results["cache_aware"], "wall_s") if "cache_aware" in results else None
    rows = []
    for variant, rs in results.items():
        split = " / ".join(f"{statistics.median(r['new_by_server'][i] for r in rs):,.0f}" for i in range(2))
        rows.append([
            variant,
            f"{med(rs, 'wall_s'):.1f} ({each(rs, 'wall_s', '{:.1f}')})",
            f"{med(rs, 'new_tokens'):,.0f} ({each(rs, 'new_tokens', '{:,}')})",
            split,
            f"{med(rs, 'cached_tokens'):,.0f}",
            f"{med(rs, 'retractions'):g} ({each(rs, 'retractions')})",
            f"{med(rs, 'wall_s') / ref:.3f}" if ref else "",
            f"{med(rs, 'others_cores'):.2f}",
        ])  # fmt: skip
    head = ["variant", "wall s (rounds)", "prompt tokens computed (rounds)", "computed A / B", "cached",
            "retractions (rounds)", "wall / cache_aware", "others' cores"]  # fmt: skip
    first = next(iter(results.values()))
    out = [f"\nworkload {name}: {first[0]['jobs']} jobs, median of {len(first)}", table(head, rows)]
    out += verdicts(name, results, med)
    return "\n".join(out)


def verdicts(name: str, results: dict[str, list[dict[str, Any]]], med: Any) -> list[str]:
    """Issue 31's "done means": on ``shared``, affinity computes no more prompt tokens than the
    router's cache_aware and takes no longer (1.0x); on ``none``, it is no slower than
    least-loaded."""
    if "affinity" not in results:
        return []
    aff = results["affinity"]
    if name == "shared" and "cache_aware" in results:
        ca = results["cache_aware"]
        tokens = med(aff, "new_tokens") <= med(ca, "new_tokens")
        wall = med(aff, "wall_s") <= med(ca, "wall_s")
        return [
            f"affinity computes {med(aff, 'new_tokens'):,.0f} prompt tokens vs cache_aware's "
            f"{med(ca, 'new_tokens'):,.0f}: {verdict(tokens)}",
            f"affinity wall / cache_aware = {med(aff, 'wall_s') / med(ca, 'wall_s'):.3f} (≤ 1.0): "
            f"{verdict(wall)}",
        ]
    if name == "none" and "least-loaded" in results:
        ratio = med(aff, "wall_s") / med(results["least-loaded"], "wall_s")
        return [f"affinity wall / least-loaded = {ratio:.3f} (≤ 1.0): {verdict(ratio <= 1.0)}"]
    return []


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engine", choices=("sglang",), default="sglang")
    ap.add_argument("--workloads", default=",".join(WORKLOADS), help="comma-separated: shared, none")
    ap.add_argument(
        "--only", default=",".join(VARIANTS), help=f"variants, comma-separated: {', '.join(VARIANTS)}"
    )
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--concurrency", type=int, default=32, help="the direct client's requests at a time")
    ap.add_argument(
        "--worker-threads", type=int, default=150,
        help="the tokenmill worker's threads (its default for the short queue: admission decides "
        "how many of them stream at once)",
    )  # fmt: skip
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--kv", type=int, default=20000, help="each server's --max-total-tokens")
    ap.add_argument("--timeout", type=float, default=600)
    ap.add_argument("--lock", default=None, help="a file to flock around each round of a workload")
    ap.add_argument("--json-out", default=None, help="append each run's figures as a JSON line here")
    ap.add_argument(
        "--worker-env", type=setting, action="append", default=[], metavar="NAME=VALUE",
        help="a setting for the tokenmill variants' worker (e.g. TOKENMILL_ADMISSION=false)",
    )  # fmt: skip
    ap.add_argument("--keep", action="store_true", help="keep the working directory (logs)")
    args = ap.parse_args()
    args.workloads = [w.strip() for w in args.workloads.split(",") if w.strip()]
    args.only = [v.strip() for v in args.only.split(",") if v.strip()]
    for bad in set(args.workloads) - set(WORKLOADS) | set(args.only) - set(VARIANTS):
        raise SystemExit(f"unknown workload or variant {bad!r}")
    exit_on_sigterm()
    print(f"machine: {machine()}")
    print(f"model: Qwen2 {MODEL}, dummy weights; servers on cores {', '.join(SERVER_CORES)}, 1 thread each")
    if args.worker_env:
        print(f"the tokenmill variants' worker: {settings_text(args.worker_env)}")
    print(f"busy cores before the start: {wait_quiet():.2f} (waits up to 2 min for an idle machine)")
    load = MachineLoad()
    results: dict[str, dict[str, list[dict[str, Any]]]] = {
        w: {v: [] for v in args.only} for w in args.workloads
    }
    with workdir(keep=args.keep, prefix="tm-bench-servers-") as work:
        for name, variant, figures in measure(work, args):
            results[name][variant].append(figures)
            print(f"  {name} {variant}: {figures}", flush=True)
            if args.json_out:
                with open(args.json_out, "a") as fh:
                    fh.write(json.dumps({"workload": name, "variant": variant, **figures}) + "\n")
    print(load.line())
    for name in args.workloads:
        print(report(name, results[name], args))


if __name__ == "__main__":
    main()
