"""End to end: tokenmill (enqueue + Celery workers + ledger) vs. a direct asyncio streaming client.

The same prompts, against a fresh sim with the same knobs each time, alternating A B A B:

- tokenmill: a private redis-server, a ``short`` worker (``--concurrency 150``) and a ``long``
  worker (32), both real ``tokenmill worker`` processes with default settings; timed from the
  first enqueue (``producer.enqueue.Enqueuer`` in this process) to the last commit (the
  ledger's ``done_ms``). CPU: the two worker processes, from /proc/<pid>/stat.
- direct: the hand-written way, in a child process: aiohttp (no connection cap), one
  ``asyncio.Semaphore`` per queue (150 short, 32 long), streaming ``/v1/chat/completions`` and
  parsing each SSE line with orjson. Same requests (built by tokenmill's own routing), timed
  from the first request to the last response. CPU: the child's own, around the run.

Both must produce the same completions (per prompt: text, reasoning and completion tokens);
the benchmark checks it. The sim is the bottleneck the way a GPU is (``--sim-step-ms``).

With ``--engine sglang`` the server is real SGLang 0.5.23 (the tiny CPU model of the test tier,
``make sglang-env``), fresh for each run, and the requests are greedy. There the server shares the
machine's 2 cores with the client, so client CPU shows up as wall time. Greedy outputs of two runs
can part where two logits are within rounding of each other, so identical outputs are counted,
not required.

    .venv/bin/python bench/e2e.py                     # 600 prompts, A B A B: ~3 minutes
    .venv/bin/python bench/e2e.py --engine sglang --rounds 1
    .venv/bin/python bench/e2e.py --prompts 300 --rounds 1
    .venv/bin/python bench/e2e.py --per-token 300       # the stream path alone: CPU per token
    .venv/bin/python bench/e2e.py --per-request 600     # what sending a request costs: CPU per request
    .venv/bin/python bench/e2e.py --short-outputs --rounds 3   # 1,500 prompts, ~170-token outputs

``--short-outputs`` is the workload where per-job costs weigh most: 1,500 prompts (one in ten
long) whose outputs average ~170 tokens (the sim's 42-297), the same 150/32 concurrency. It
reports CPU per job beside CPU per token.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import sys
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson
import redis
from _common import (
    Child,
    Children,
    MachineLoad,
    exit_on_sigterm,
    machine,
    median,
    pin_clients,
    proc_cpu_s,
    setting,
    settings_text,
    start_sglang,
    start_sim,
    start_worker,
    table,
    thread_cpu_s,
    thread_split,
    tree_cpu_s,
    verdict,
    wait_for,
    wait_quiet,
    workdir,
)

RUN = "e2e"
SHORT_OUTPUTS = (1500, 170)  # --short-outputs: prompts, the sim's mean output tokens
PARTITION = "P"
WORDS = (
    "explain prove derive compare summarize the of and to in is that for it as with model token "
    "cache queue server stream batch prompt GPU kernel tensor café naïve 日本 中文 🙂"
).split()


@dataclass(frozen=True, slots=True)
class Knobs:
    """The workload and the sim: everything both variants share."""

    prompts: int
    long_every: int
    short_max_tokens: int
    long_max_tokens: int
    long_prompt_tokens: int
    short_concurrency: int
    long_concurrency: int
    sim: tuple[str, ...]
    engine: str = "sim"
    sglang: tuple[str, ...] = ()

    @property
    def temperature(self) -> float | None:
        return 0.0 if self.engine == "sglang" else None


# --- the dataset ---------------------------------------------------------------------------------


def write_dataset(path: Path, k: Knobs) -> Path:
    """``k.prompts`` distinct rows with ids; every ``long_every``-th has a long prompt."""
    lines = []
    for i in range(k.prompts):
        n_words = 1400 if k.long_every and i % k.long_every == k.long_every - 1 else 20 + i % 60
        text = f"#{i} " + " ".join(WORDS[(i * 7 + j * 3) % len(WORDS)] for j in range(n_words))
        lines.append(orjson.dumps({"id": f"p{i}", "messages": [{"role": "user", "content": text}]}))
    path.write_bytes(b"\n".join(lines) + b"\n")
    return path


def routing(k: Knobs) -> Any:
    from producer.enqueue import Routing

    return Routing(
        model="default",
        short_max_tokens=k.short_max_tokens,
        long_max_tokens=k.long_max_tokens,
        long_prompt_tokens=k.long_prompt_tokens,
        params={} if k.temperature is None else {"temperature": k.temperature},
    )


def direct_requests(data: Path, k: Knobs) -> list[dict[str, Any]]:
    """The requests tokenmill sends for ``data`` (same routing, same bodies), with their job ids."""
    from producer.readers import iter_records
    from producer.rows import normalize_row

    out = []
    for rec in iter_records(data):
        assert rec.data is not None
        spec = routing(k).spec(normalize_row(rec.source, rec.data), PARTITION, rec.source)
        out.append({"id": spec.job_id, "queue": spec.queue, "request": spec.request})
    return out


def digest(content: str, reasoning: str | None) -> str:
    return hashlib.blake2b(f"{content}\0{reasoning or ''}".encode(), digest_size=12).hexdigest()


# --- measurements common to both variants --------------------------------------------------------


@dataclass(slots=True)
class Result:
    variant: str
    wall_s: float
    client_cpu_s: float
    tokens: int
    outputs: dict[str, tuple[int, str, str]]  # job id -> (completion tokens, finish, digest)
    in_flight: list[int] = field(default_factory=list)
    sim_cpu_s: float = 0.0
    redis_cpu_s: float = 0.0
    split: dict[str, float] = field(default_factory=dict)  # worker CPU by thread kind

    @property
    def tok_s(self) -> float:
        return self.tokens / self.wall_s

    @property
    def cpu_ms_per_1k(self) -> float:
        return self.client_cpu_s / self.tokens * 1e6


class Sampler(threading.Thread):
    """Samples the server's requests in flight (running + queued) twice a second: the sim's
    ``/_sim/stats``, SGLang's ``/v1/loads``."""

    def __init__(self, url: str, engine: str) -> None:
        super().__init__(daemon=True)
        self.url = url
        self.engine = engine
        self.samples: list[int] = []
        self.stop_event = threading.Event()

    def run(self) -> None:
        path = "/_sim/stats" if self.engine == "sim" else "/v1/loads"
        while not self.stop_event.wait(0.5):
            try:
                with urllib.request.urlopen(f"{self.url}{path}", timeout=2) as resp:
                    s = orjson.loads(resp.read())
            except OSError:
                continue
            if self.engine == "sim":
                self.samples.append(int(s["running"]) + int(s["queued"]))
            else:
                self.samples.append(
                    sum(int(x["num_running_reqs"]) + int(x["num_waiting_reqs"]) for x in s["loads"])
                )

    def stop(self) -> list[int]:
        self.stop_event.set()
        self.join(5)
        return self.samples


# --- variant A: tokenmill ------------------------------------------------------------------------


def start_server(ch: Children, where: Path, k: Knobs) -> tuple[int, str]:
    """A fresh server for one run: (its main pid, its URL)."""
    if k.engine == "sglang":
        engine, url = start_sglang(ch, where, *k.sglang)
        return engine.pid, url
    sim, url = start_sim(ch, where, k.sim)
    return sim.pid, url


def run_tokenmill(
    work: Path,
    k: Knobs,
    data: Path,
    client: redis.Redis,
    redis_url: str,
    rnd: int,
    worker_env: dict[str, str] | None = None,
) -> Result:
    from producer.enqueue import Enqueuer
    from tokenmill.ledger import Ledger

    client.flushall()
    where = work / f"tokenmill-{rnd}"
    with Children() as ch:
        server_pid, url = start_server(ch, where, k)
        env = {**(worker_env or {}), "TOKENMILL_REDIS_URL": redis_url, "TOKENMILL_SERVER_URL": url}
        workers = [
            start_worker(ch, where, "short", k.short_concurrency, env),
            start_worker(ch, where, "long", k.long_concurrency, env),
        ]
        redis_pid = int(client.info("server")["process_id"])
        ledger = Ledger(client, RUN)
        enq = Enqueuer(ledger, routing(k), max_queued=100_000)
        sampler = Sampler(url, k.engine)
        cpu0 = [proc_cpu_s(w.pid) for w in workers]
        threads0 = [thread_cpu_s(w.pid) for w in workers]
        sim0, redis0 = tree_cpu_s(server_pid), proc_cpu_s(redis_pid)
        sampler.start()
        start = time.time()
        enq.enqueue_file(data, PARTITION)
        assert enq.summary.total_new == k.prompts, enq.summary.line(RUN)
        wait_for(lambda: _finished(ledger, workers), 900, "the tokenmill run to finish", 0.1)
        cpu = sum(proc_cpu_s(w.pid) - c for w, c in zip(workers, cpu0, strict=True))
        split = thread_split(workers, threads0)
        sim_cpu, redis_cpu = tree_cpu_s(server_pid) - sim0, proc_cpu_s(redis_pid) - redis0
        in_flight = sampler.stop()
        counts = ledger.counts()[PARTITION]
        if counts["failed"]:
            raise RuntimeError(f"{counts['failed']} jobs failed: see the worker logs in {where}")
        outputs, last_ms = _ledger_outputs(ledger)
    tokens = sum(t for t, _, _ in outputs.values())
    wall = last_ms / 1000 - start
    return Result("tokenmill", wall, cpu, tokens, outputs, in_flight, sim_cpu, redis_cpu, split)


def _finished(ledger: Any, workers: list[Child]) -> bool:
    for w in workers:
        if not w.alive():
            raise RuntimeError(f"{w.name} died:\n{w.output()[-2000:]}")
    c = ledger.counts().get(PARTITION)
    return bool(c) and c["queued"] == 0 and c["running"] == 0


def _ledger_outputs(ledger: Any) -> tuple[dict[str, tuple[int, str, str]], int]:
    outputs: dict[str, tuple[int, str, str]] = {}
    last_ms = 0
    for job_id, (raw, done_ms) in ledger.iter_jobs(PARTITION, ["result", "done_ms"]):
        res = orjson.loads(raw)
        outputs[job_id] = (
            int(res["usage"]["completion_tokens"]),
            res["finish_reason"],
            digest(res["content"], res.get("reasoning_content")),
        )
        last_ms = max(last_ms, int(done_ms))
    return outputs, last_ms


# --- variant B: the direct asyncio client --------------------------------------------------------


def run_direct(work: Path, k: Knobs, reqs_path: Path, rnd: int) -> Result:
    where = work / f"direct-{rnd}"
    out = where / "direct.json"
    with Children() as ch:
        server_pid, url = start_server(ch, where, k)
        sampler = Sampler(url, k.engine)
        sim0 = tree_cpu_s(server_pid)
        sampler.start()
        args = [
            sys.executable, __file__, "--direct-client", url, str(reqs_path), str(out),
            "--short-concurrency", str(k.short_concurrency), "--long-concurrency", str(k.long_concurrency),
        ]  # fmt: skip
        child = ch.spawn("direct", args, where / "direct.log")
        wait_for(lambda: not child.alive(), 900, "the direct client to finish", 0.1)
        sim_cpu = tree_cpu_s(server_pid) - sim0
        in_flight = sampler.stop()
    if child.proc.returncode != 0 or not out.exists():
        raise RuntimeError(f"the direct client failed:\n{child.output()[-3000:]}")
    doc = orjson.loads(out.read_bytes())
    outputs = {j: (int(t), f, d) for j, (t, f, d) in doc["outputs"].items()}
    tokens = sum(t for t, _, _ in outputs.values())
    return Result("direct", doc["wall_s"], doc["cpu_s"], tokens, outputs, in_flight, sim_cpu)


async def _stream_one(
    session: Any, url: str, item: dict[str, Any], sem: asyncio.Semaphore
) -> tuple[Any, ...]:
    body = {**item["request"], "stream": True, "stream_options": {"include_usage": True}}
    async with (
        sem,
        session.post(
            f"{url}/v1/chat/completions",
            data=orjson.dumps(body),
            headers={"Content-Type": "application/json", "Authorization": "Bearer EMPTY"},
        ) as resp,
    ):
        if resp.status != 200:
            raise RuntimeError(f"HTTP {resp.status}: {await resp.text()}")
        content: list[str] = []
        reasoning: list[str] = []
        finish = usage = None
        async for line in resp.content:
            if not line.startswith(b"data: "):
                continue
            payload = line[6:].rstrip()
            if payload == b"[DONE]":
                break
            obj = orjson.loads(payload)
            choices = obj.get("choices")
            if choices:
                delta = choices[0].get("delta") or {}
                text = delta.get("content")
                if text:
                    content.append(text)
                text = delta.get("reasoning_content")
                if text:
                    reasoning.append(text)
                finish = choices[0].get("finish_reason") or finish
            elif obj.get("usage"):
                usage = obj["usage"]
            elif "error" in obj:
                raise RuntimeError(f"error chunk: {obj['error']}")
    if usage is None or finish is None:
        raise RuntimeError(f"{item['id']}: the stream ended without usage or finish_reason")
    return item["id"], int(usage["completion_tokens"]), finish, "".join(content), "".join(reasoning)


async def _direct(url: str, reqs: list[dict[str, Any]], short_c: int, long_c: int) -> dict[str, Any]:
    import aiohttp

    sems = {"short": asyncio.Semaphore(short_c), "long": asyncio.Semaphore(long_c)}
    connector = aiohttp.TCPConnector(limit=0)  # the semaphores bound concurrency, not the pool
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=10)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        cpu0, t0 = time.process_time(), time.perf_counter()
        done = await asyncio.gather(*(_stream_one(session, url, r, sems[r["queue"]]) for r in reqs))
        wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    outputs = {j: (t, f, digest(c, r or None)) for j, t, f, c, r in done}
    return {"wall_s": wall, "cpu_s": cpu, "outputs": outputs}


def direct_client_main(url: str, reqs_path: str, out_path: str, short_c: int, long_c: int) -> None:
    reqs = orjson.loads(Path(reqs_path).read_bytes())
    doc = asyncio.run(_direct(url, reqs, short_c, long_c))
    Path(out_path).write_bytes(orjson.dumps(doc))


# --- per token: the worker's stream path alone ------------------------------------------------


# --per-token's variants: the worker's stream path on its own transport; the same path (the
# worker's line splitter and chunk parser) reading aiohttp's body chunks instead, what it would
# cost with aiohttp as its transport; and aiohttp used directly (lines + orjson). All on the
# worker's event loop (the ``event_loop`` setting's default, uvloop).
PER_TOKEN_VARIANTS = ("worker", "aiohttp", "direct")


def stream_path(url: str, reqs: list[dict[str, Any]], concurrency: int, variant: str) -> tuple[float, int]:
    """CPU seconds and completion tokens for ``reqs`` through one of :data:`PER_TOKEN_VARIANTS`
    on the worker's event loop."""
    from tokenmill.settings import EVENT_LOOPS
    from workers.event_loop import run

    return run(_stream_path(url, reqs, concurrency, variant), EVENT_LOOPS[0])


async def _stream_path(
    url: str, reqs: list[dict[str, Any]], concurrency: int, variant: str
) -> tuple[float, int]:
    """CPU seconds and completion tokens for ``reqs``, ``concurrency`` at a time, in this process:
    through ``workers.stream.stream_chat`` on the worker's own stream client, through the worker's
    parser on aiohttp's chunks, or directly."""
    import aiohttp

    from tokenmill.settings import Settings
    from workers.stream import STREAM_OPTIONS, Progress, StreamClient, _Lines, handler_for, stream_chat

    sem = asyncio.Semaphore(concurrency)
    s = Settings.load(server_url=url)
    client = StreamClient(url, s.api_key, s.connect_timeout_s)  # as a worker's Runtime builds it
    session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
    loop = asyncio.get_running_loop()
    headers = {"Content-Type": "application/json", "Authorization": "Bearer EMPTY"}

    async def via_worker(item: dict[str, Any]) -> int:
        async with sem:
            p = await stream_chat(client, item["request"], {"rid": item["id"]}, Progress())
            return int((p.usage or {}).get("completion_tokens") or 0)

    async def via_aiohttp(item: dict[str, Any]) -> int:
        body = orjson.dumps(
            {**item["request"], "rid": item["id"], "stream": True, "stream_options": STREAM_OPTIONS}
        )
        p = Progress()
        lines = _Lines(p, loop, handler_for(item["request"], p))
        async with sem, session.post(f"{url}/v1/chat/completions", data=body, headers=headers) as resp:
            if resp.status != 200:
                raise RuntimeError(f"HTTP {resp.status}: {await resp.text()}")
            async for chunk in resp.content.iter_any():
                lines.feed(chunk)
        lines.end()
        if p.finish_reason is None:
            raise RuntimeError(f"{item['id']}: the stream ended without a finish_reason")
        return int((p.usage or {}).get("completion_tokens") or 0)

    async def direct(item: dict[str, Any]) -> int:
        return int((await _stream_one(session, url, item, sem))[1])

    one = {"worker": via_worker, "aiohttp": via_aiohttp, "direct": direct}[variant]
    cpu0 = time.process_time()
    tokens = await asyncio.gather(*(one(r) for r in reqs))
    cpu = time.process_time() - cpu0
    await client.close()
    await session.close()
    return cpu, sum(tokens)


def _parse_costs_us() -> tuple[float, float]:
    """``_on_line`` and ``orjson.loads`` alone on one of the sim's content chunks, in µs."""
    import timeit

    from server_mgr.sim.sse import ChunkEncoder
    from workers.stream import Progress, _on_line

    payload = ChunkEncoder("run/P:p1/1", int(time.time()), "default").content(" token")[6:].rstrip()
    loop = asyncio.new_event_loop()
    n = 100_000
    on_line = min(timeit.repeat(lambda: _on_line(payload, Progress(), loop), number=n, repeat=3)) / n
    loads = min(timeit.repeat(lambda: orjson.loads(payload), number=n, repeat=3)) / n
    loop.close()
    return on_line * 1e6, loads * 1e6


def per_token(k: Knobs, n: int, rounds: int) -> None:
    """The stream path alone, side by side: CPU per streamed token, worker code vs aiohttp."""
    rows: dict[str, list[tuple[float, int, float]]] = {v: [] for v in PER_TOKEN_VARIANTS}
    with workdir() as work, Children() as ch:
        reqs = [r for r in direct_requests(write_dataset(work / "P.jsonl", k), k) if r["queue"] == "short"][
            :n
        ]
        _, url = start_sim(ch, work, k.sim)
        for _ in range(rounds):
            for variant in rows:
                sampler = Sampler(url, "sim")
                sampler.start()
                cpu, tokens = stream_path(url, reqs, k.short_concurrency, variant)
                rows[variant].append((cpu, tokens, _mean(sampler.stop())))
                print(
                    f"{variant:7}: {cpu:.2f} CPU s, {tokens:,} tokens, {cpu / tokens * 1e6:.1f} µs per token"
                )
    direct = median([c / t for c, t, _ in rows["direct"]])
    table_rows = []
    for variant, label in (
        ("worker", "workers.stream.stream_chat on the worker's stream client (workers/transport.py)"),
        ("aiohttp", "the worker's line splitter and parser on aiohttp's body chunks"),
        ("direct", "direct: aiohttp lines + orjson"),
    ):
        per = median([c / t for c, t, _ in rows[variant]])
        flight = median([f for _, _, f in rows[variant]])
        by_round = ", ".join(
            f"{(c / t) / (dc / dt):.2f}x"
            for (c, t, _), (dc, dt, _) in zip(rows[variant], rows["direct"], strict=True)
        )
        table_rows.append(
            [
                label,
                f"{rows[variant][0][1]:,}",
                f"{per * 1e6:.1f}",
                f"{per / direct:.2f}x",
                by_round,
                f"{flight:.0f}",
            ]
        )
    print(
        f"\n{len(reqs)} short requests, {k.short_concurrency} at a time, one process, uvloop, "
        f"median of {rounds}:"
    )
    print(
        table(
            ["stream path", "tokens", "CPU µs / token", "vs direct", "by round", "mean in flight"], table_rows
        )
    )
    on_line, loads = _parse_costs_us()
    print(f"_on_line on one content chunk: {on_line:.2f} µs, of which orjson.loads {loads:.2f} µs")


def per_request(k: Knobs, n: int, rounds: int) -> None:
    """What sending a request costs, side by side: the same stream path on requests cut to
    2 tokens (``max_tokens`` 2), so the per-request work dominates: CPU per request."""
    rows: dict[str, list[float]] = {"worker": [], "direct": []}
    with workdir() as work, Children() as ch:
        short = [r for r in direct_requests(write_dataset(work / "P.jsonl", k), k) if r["queue"] == "short"]
        reqs = [{**r, "request": {**r["request"], "max_tokens": 2}} for r in short[:n]]
        _, url = start_sim(ch, work, k.sim)
        for _ in range(rounds):
            for variant in rows:
                cpu, _tokens = stream_path(url, reqs, k.short_concurrency, variant)
                rows[variant].append(cpu / len(reqs))
                each_ms = cpu / len(reqs) * 1e3
                print(f"{variant:6}: {cpu:.2f} CPU s for {len(reqs)} requests, {each_ms:.2f} ms each")
    direct = median(rows["direct"])
    worker = median(rows["worker"])
    where = f"{k.short_concurrency} at a time, one process, median of {rounds}"
    print(f"\n{len(reqs)} requests of 2 tokens, {where}:")
    worker_row = ["workers.stream.stream_chat on the worker's client and loop", f"{worker * 1e3:.2f}",
                  f"{worker / direct:.2f}x"]  # fmt: skip
    direct_row = ["direct: aiohttp lines + orjson", f"{direct * 1e3:.2f}", "1.00x"]
    print(table(["stream path", "CPU ms / request", "vs direct"], [worker_row, direct_row]))


# --- the run -------------------------------------------------------------------------------------


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=600, help="prompts in the dataset (default 600)")
    ap.add_argument("--long-every", type=int, default=10, help="one prompt in N is long (default 10)")
    ap.add_argument("--short-max-tokens", type=int, default=300)
    ap.add_argument("--long-max-tokens", type=int, default=1000)
    ap.add_argument("--long-prompt-tokens", type=int, default=1000, help="long-queue threshold (tokens)")
    ap.add_argument("--short-concurrency", type=int, default=150)
    ap.add_argument("--long-concurrency", type=int, default=32)
    ap.add_argument("--mean-output-tokens", type=int, default=300, help="the sim's mean output length")
    ap.add_argument("--step-ms", type=float, default=20.0, help="the sim's decode step time")
    ap.add_argument("--step-ms-per-req", type=float, default=0.02, help="the sim's step time per request")
    ap.add_argument("--rounds", type=int, default=2, help="A B rounds; medians are reported (default 2)")
    ap.add_argument("--engine", choices=("sim", "sglang"), default="sim", help="the server (default sim)")
    ap.add_argument(
        "--max-total-tokens",
        type=int,
        default=250_000,
        help="SGLang's KV pool (--engine sglang; default 250000)",
    )
    ap.add_argument(
        "--short-outputs",
        action="store_true",
        help="the short-output workload: 1,500 prompts, outputs ~170 tokens (overrides --prompts and "
        "--mean-output-tokens)",
    )
    ap.add_argument(
        "--worker-env",
        action="append",
        default=[],
        type=setting,
        metavar="NAME=VALUE",
        help="a TOKENMILL_* setting for the workers (a diagnostic; repeatable)",
    )
    ap.add_argument("--keep", action="store_true", help="keep the working directory (logs)")
    ap.add_argument(
        "--per-token", type=int, metavar="N", default=0, help="only the stream path: N requests, in process"
    )
    ap.add_argument(
        "--per-request", type=int, metavar="N", default=0, help="only the request cost: N 2-token requests"
    )
    ap.add_argument("--direct-client", nargs=3, metavar=("URL", "REQUESTS", "OUT"), help=argparse.SUPPRESS)
    return ap.parse_args()


def main() -> None:
    a = parse_args()
    if a.direct_client:
        url, reqs_path, out_path = a.direct_client
        direct_client_main(url, reqs_path, out_path, a.short_concurrency, a.long_concurrency)
        return
    exit_on_sigterm()
    if a.short_outputs:
        a.prompts, a.mean_output_tokens = SHORT_OUTPUTS
    sim = (
        "--reasoning-parser", "qwen3", "--sim-mean-output-tokens", str(a.mean_output_tokens),
        "--sim-step-ms", str(a.step_ms), "--sim-step-ms-per-req", str(a.step_ms_per_req),
    )  # fmt: skip
    sglang = ("--max-total-tokens", str(a.max_total_tokens), "--log-level", "warning")
    k = Knobs(
        a.prompts, a.long_every, a.short_max_tokens, a.long_max_tokens, a.long_prompt_tokens,
        a.short_concurrency, a.long_concurrency, sim, a.engine, sglang,
    )  # fmt: skip
    print(f"machine: {machine()}")
    print(
        f"sim: {' '.join(sim)}" if a.engine == "sim" else f"SGLang 0.5.23, tiny CPU model: {' '.join(sglang)}"
    )
    if a.engine == "sglang":
        print(f"cores: {pin_clients()}")
    if a.per_token:
        per_token(k, a.per_token, a.rounds)
        return
    if a.per_request:
        per_request(k, a.per_request, a.rounds)
        return
    worker_env = dict(a.worker_env)
    if worker_env:
        print(f"worker settings: {settings_text(a.worker_env)}")
    print(f"busy cores before the start: {wait_quiet():.2f} (waits up to 2 min for an idle machine)")
    results: list[Result] = []
    with workdir(a.keep) as work, Children() as children:
        load = MachineLoad()
        data = write_dataset(work / f"{PARTITION}.jsonl", k)
        reqs = direct_requests(data, k)
        reqs_path = work / "requests.json"
        reqs_path.write_bytes(orjson.dumps(reqs))
        n_long = sum(r["queue"] == "long" for r in reqs)
        print(f"dataset: {len(reqs)} prompts, {n_long} on the long queue")
        server = children.redis(work / "redis")
        client = redis.Redis.from_url(server.url)
        for rnd in range(1, a.rounds + 1):
            for variant in ("tokenmill", "direct"):
                if variant == "tokenmill":
                    r = run_tokenmill(work, k, data, client, server.url, rnd, worker_env)
                else:
                    r = run_direct(work, k, reqs_path, rnd)
                results.append(r)
                print(f"round {rnd} {r.variant:9}: {r.wall_s:6.2f} s, {r.tokens:,} tokens, "
                      f"{r.tok_s:,.0f} tok/s, client CPU {r.client_cpu_s:.2f} s "
                      f"({r.cpu_ms_per_1k:.1f} ms per 1k tokens), "
                      f"in flight mean {_mean(r.in_flight):.0f}, "
                      f"peak {max(r.in_flight, default=0)}")  # fmt: skip
        print(load.line())
    check_same_outputs(results, strict=k.engine == "sim")
    report(results, "sim" if k.engine == "sim" else "server")


def _mean(xs: list[int]) -> float:
    busy = [x for x in xs if x > 0]
    return sum(busy) / len(busy) if busy else 0.0


def check_same_outputs(results: list[Result], strict: bool = True) -> None:
    """Every run produced the same completions: per prompt, tokens, finish reason and text. Not
    ``strict``: count the prompts whose outputs differ, and require the same prompts and tokens."""
    ref = results[0].outputs
    same = True
    for r in results[1:]:
        diff = [j for j in ref if r.outputs.get(j) != ref[j]]
        if not diff:
            continue
        same = False
        if strict or set(r.outputs) != set(ref) or r.tokens != results[0].tokens:
            raise AssertionError(
                f"{r.variant} produced different outputs for {len(diff)} prompts: {diff[:5]}"
            )
        print(
            f"{r.variant} run: {len(ref) - len(diff)} of {len(ref)} outputs identical to the first run's "
            "(the others parted where greedy decoding met a near tie); same prompts, same tokens"
        )
    if same:
        print(f"\nidentical outputs in all {len(results)} runs: {len(ref)} prompts, "
              f"{results[0].tokens:,} completion tokens each")  # fmt: skip


def report(results: list[Result], server: str = "sim") -> None:
    rows = []
    med: dict[str, dict[str, float]] = {}
    for variant in ("tokenmill", "direct"):
        rs = [r for r in results if r.variant == variant]
        m = {
            "wall": median([r.wall_s for r in rs]),
            "tok_s": median([r.tok_s for r in rs]),
            "cpu": median([r.client_cpu_s for r in rs]),
            "per_1k": median([r.cpu_ms_per_1k for r in rs]),
            "per_job": median([r.client_cpu_s / len(r.outputs) * 1e3 for r in rs]),
            "flight": median([_mean(r.in_flight) for r in rs]),
            "peak": median([max(r.in_flight, default=0) for r in rs]),
            "sim": median([r.sim_cpu_s / r.tokens * 1e6 for r in rs]),
        }
        med[variant] = m
        who = "2 worker processes" if variant == "tokenmill" else "client process"
        rows.append([
            variant, len(rs), f"{m['wall']:.2f}", f"{m['tok_s']:,.0f}", f"{m['cpu']:.2f} ({who})",
            f"{m['per_1k']:.1f}", f"{m['per_job']:.2f}", f"{m['flight']:.0f} / {m['peak']:.0f}",
            f"{m['sim']:.1f}",
        ])  # fmt: skip
    print(table(
        ["variant", "runs", "wall s", "tokens/s", "client CPU s", "CPU ms / 1k tokens", "CPU ms / job",
         f"requests in flight at the {server} (mean / peak)", f"{server} CPU ms / 1k tokens"],
        rows,
    ))  # fmt: skip
    ratio = med["tokenmill"]["wall"] / med["direct"]["wall"]
    cpu_ratio = med["tokenmill"]["per_1k"] / med["direct"]["per_1k"]
    redis_cpu = median([r.redis_cpu_s for r in results if r.variant == "tokenmill"])
    print(f"\ntokenmill wall / direct wall: {ratio:.3f} (target <= 1.05: {verdict(ratio <= 1.05)})")
    print(f"tokenmill worker CPU per token / direct client CPU per token: {cpu_ratio:.2f}x "
          f"(target <= 1.2: {verdict(cpu_ratio <= 1.2)})")  # fmt: skip
    # Each round's ratio of its two runs (they ran back to back, so machine drift between
    # rounds cancels); the spread says how far one round can be trusted.
    by_round = [
        t.cpu_ms_per_1k / d.cpu_ms_per_1k
        for t, d in zip(
            [r for r in results if r.variant == "tokenmill"],
            [r for r in results if r.variant == "direct"],
            strict=True,
        )
    ]
    print(f"CPU per token ratio by round: {', '.join(f'{x:.2f}x' for x in by_round)} "
          f"(median {median(by_round):.2f}x)")  # fmt: skip
    job_gap = med["tokenmill"]["per_job"] - med["direct"]["per_job"]
    print(f"tokenmill worker CPU per job - direct client CPU per job: {job_gap:.2f} ms")
    print(f"(tokenmill's redis-server used {redis_cpu:.2f} CPU s per run on top, median)")
    tm = [r for r in results if r.variant == "tokenmill"]
    parts = ", ".join(
        f"{name} {median([r.split[name] for r in tm]):.2f} s"
        for name in ("event loop", "long worker's loop", "celery consumer", "task threads")
    )
    jobs = len(tm[0].outputs)
    print(f"tokenmill worker CPU by thread (median, both workers): {parts}; "
          f"{jobs} jobs, {tm[0].tokens / jobs:.0f} tokens per job")  # fmt: skip


if __name__ == "__main__":
    main()
