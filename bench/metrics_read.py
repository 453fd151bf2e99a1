"""The load watch's read of a server's ``/metrics``: the CPU it costs the worker.

The admission's load watch reads ``/v1/loads`` and, for the retraction counter, ``/metrics``
twice a second (``admission_poll_s``). Real SGLang 0.5.23 (the tiny CPU model of ``make
sglang-env``, with ``--enable-metrics``) serves a page of ~600 lines, mostly histograms, once it
has answered a few requests. Measured side by side, interleaved round by round on the same
page: ``prometheus_client``'s parser over the whole page (what ``parse_metrics`` did before),
``parse_metrics`` (the same parser over the sample lines of the figures it keeps), and the
whole read (HTTP GET plus ``parse_metrics``), each the median CPU (user + system) of a round of
``--calls`` calls. Then the other side of the reads: the CPU of SGLang's front end (its main
process: HTTP and tokenizer manager; on this machine it shares the scheduler's core) for each
``/metrics`` page and each ``/v1/loads``. (A page asked for named samples, ``?name[]=``, would be
cheaper, but 0.5.23's multiprocess registry answers it with an empty page: seen.)

    .venv/bin/python bench/metrics_read.py [--rounds 5] [--calls 50] [--lock /tmp/tokenmill-heavy.lock]

``--steps`` measures instead what the reads cost the server's work: ``--streams`` streaming
requests kept in flight (each of ``max_tokens`` 200, replaced when it ends, on a pool that holds
them all), and phases of ``--phase-s`` seconds in each of ``--rounds`` rounds, their order
rotated from round to round: no reads, ``/v1/loads`` at ``--hz``, and ``/v1/loads`` plus
``/metrics`` at ``--hz`` (the load watch at its tightest). Each phase's mean decode step, from
SGLang's log (``--decode-log-interval 1``), and each phase's against the no-read phase of its
round.

    .venv/bin/python bench/metrics_read.py --steps [--streams 16] [--hz 2] [--rounds 12] [--phase-s 4]
"""

from __future__ import annotations

import argparse
import json
import resource
import threading
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

from _common import (
    Children,
    SglangLog,
    exit_on_sigterm,
    heavy,
    machine,
    median,
    pin_clients,
    proc_cpu_s,
    start_sglang,
    table,
    workdir,
)
from prometheus_client.parser import text_string_to_metric_families

from tokenmill import server_report
from tokenmill.capacity import get_bytes


def cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def per_call_ms(fn: Callable[[], object], calls: int) -> float:
    start = cpu_s()
    for _ in range(calls):
        fn()
    return (cpu_s() - start) / calls * 1000


def served_ms(pid: int, url: str, calls: int) -> float:
    """The CPU of process ``pid`` for each GET of ``url`` (the mean of ``calls``)."""
    start = proc_cpu_s(pid)
    for _ in range(calls):
        get_bytes(url, None, 10.0)
    return (proc_cpu_s(pid) - start) / calls * 1000


def whole_page(text: str) -> int:
    return sum(len(f.samples) for f in text_string_to_metric_families(text))


def chat(url: str, content: str, **options: object) -> urllib.request.Request:
    """A chat request to the server at ``url``."""
    body = {"model": "default", "messages": [{"role": "user", "content": content}], **options}
    data = json.dumps(body).encode()
    return urllib.request.Request(
        url + "/v1/chat/completions", data=data, headers={"Content-Type": "application/json"}
    )


def warm_up(url: str) -> None:
    """A few requests, so that the page holds the histograms a working server shows."""
    for _ in range(4):
        with urllib.request.urlopen(chat(url, "hi", max_tokens=16), timeout=120) as resp:
            resp.read()


def stream_forever(url: str, stop: threading.Event) -> None:
    """One request in flight until ``stop``: each streams 200 tokens, then the next starts."""
    while not stop.is_set():
        req = chat(url, "Tell me a long story.", max_tokens=200, stream=True, temperature=1.0)
        with urllib.request.urlopen(req, timeout=120) as resp:
            while resp.readline():
                pass


def read_loop(url: str, hz: float, stop: threading.Event, phase: list[str]) -> None:
    """The load watch's reads at its tightest: ``/v1/loads``, and ``/metrics`` too, ``hz`` a second."""
    while not stop.wait(1 / hz):
        if phase[0] != "no reads":
            get_bytes(url + "/v1/loads", None, 10.0)
        if phase[0] == "/v1/loads + /metrics":
            get_bytes(url + "/metrics", None, 10.0)


def step_ms(log: Path, start: int) -> float:
    """The mean decode step (ms) in what ``log`` gained since byte ``start``."""
    steps = SglangLog.since(log, start).decode_steps
    n = sum(c for c, _ in steps.values())
    return sum(s for _, s in steps.values()) / n * 1000 if n else float("nan")


def steps_main(args: argparse.Namespace) -> None:
    phases = ("no reads", "/v1/loads", "/v1/loads + /metrics")
    got: dict[str, list[float]] = {p: [] for p in phases}
    with heavy(args.lock), workdir(prefix="tm-bench-metrics-") as work, Children() as children:
        flags = ("--enable-metrics", "--decode-log-interval", "1", "--max-total-tokens", "20000")
        engine, url = start_sglang(children, work, *flags)
        stop, phase = threading.Event(), ["no reads"]
        threads = [threading.Thread(target=stream_forever, args=(url, stop)) for _ in range(args.streams)]
        threads.append(threading.Thread(target=read_loop, args=(url, args.hz, stop, phase)))
        for t in threads:
            t.daemon = True  # a stream blocked in its read does not hold up the exit
            t.start()
        try:
            time.sleep(5)  # the streams spread out
            for r in range(args.rounds):
                for name in phases[r % len(phases) :] + phases[: r % len(phases)]:  # rotated: the host drifts
                    phase[0] = name
                    time.sleep(0.5)  # reads of the phase before are done
                    start = engine.log.stat().st_size
                    time.sleep(args.phase_s)
                    got[name].append(step_ms(engine.log, start))
        finally:
            stop.set()
    rows = []
    for name, v in got.items():
        ratios = [x / base for x, base in zip(v, got["no reads"], strict=True)]
        rows.append([name, ", ".join(f"{x:.2f}" for x in v), f"{median(ratios):.3f}"])
    shape = f"{args.rounds} rounds of {args.phase_s} s phases"
    print(f"{args.streams} streams in flight, reads at {args.hz} Hz, {shape}")
    print(table(["phase", "mean decode step, ms (rounds)", "/ no reads (median of rounds)"], rows))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--calls", type=int, default=50)
    ap.add_argument("--lock", default=None, help="a file to flock around the run (shared CPU)")
    ap.add_argument("--steps", action="store_true", help="what the reads cost the server's decode steps")
    ap.add_argument("--streams", type=int, default=16)
    ap.add_argument("--hz", type=float, default=2.0)
    ap.add_argument("--phase-s", type=float, default=4.0)
    args = ap.parse_args()
    exit_on_sigterm()
    print(f"machine: {machine()}")
    print(f"cores: {pin_clients()}")
    if args.steps:
        steps_main(args)
        return
    with heavy(args.lock), workdir(prefix="tm-bench-metrics-") as work, Children() as children:
        engine, url = start_sglang(children, work, "--enable-metrics")
        warm_up(url)
        text = get_bytes(url + "/metrics", None, 10.0).decode()
        print(f"page: {len(text):,} bytes, {text.count(chr(10))} lines, {whole_page(text)} samples")
        ways: dict[str, Callable[[], object]] = {
            "the library over the whole page (before)": lambda: whole_page(text),
            "parse_metrics (the kept samples only)": lambda: server_report.parse_metrics(text),
            "read: GET /metrics + parse_metrics": lambda: server_report.metrics(url, 10.0),
        }
        got: dict[str, list[float]] = {name: [] for name in ways}
        pages = {"GET /metrics": url + "/metrics", "GET /v1/loads": url + "/v1/loads"}
        served: dict[str, list[float]] = {name: [] for name in pages}
        for _ in range(args.rounds):
            for name, fn in ways.items():
                got[name].append(per_call_ms(fn, args.calls))
            for name, page in pages.items():
                served[name].append(served_ms(engine.pid, page, args.calls))
    before = median(got["the library over the whole page (before)"])
    rows = [
        [name, f"{median(v):.2f}", ", ".join(f"{x:.2f}" for x in v), f"{median(v) / before:.3f}"]
        for name, v in got.items()
    ]
    print(table(["CPU a call", "ms (median)", "rounds", "/ before"], rows))
    rows = [[name, f"{median(v):.2f}", ", ".join(f"{x:.2f}" for x in v)] for name, v in served.items()]
    print(table(["SGLang front end's CPU a read", "ms (median)", "rounds"], rows))


if __name__ == "__main__":
    main()
