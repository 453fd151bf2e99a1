"""The sim's process life: startup, bind, warmup, signals, drain and exit (contract §2.1, §6).

1. *Loading* (``--sim-startup-delay-s``): the scheduler's startup lines; the port is not bound,
   so clients get "connection refused". The OOM knobs fire here.
2. *Starting* (``--sim-warmup-s``): bound; /model_info, /v1/models, /server_info answer 200,
   /health, /health_generate and /ready answer 503.
3. *Up*: after the warmup request, ``The server is fired up and ready to roll!``.

A port another process holds when the sim binds: uvicorn's bind error, then the sim lingers as
SGLang 0.5.23 does (its warmup asks the port for /model_info 120 times, SIGTERM ignored), then
SIGKILLs itself (:func:`_warmup_unbound`).

Children: ``sglang::scheduler`` and ``sglang::detokenizer`` stand-ins (:mod:`.children`); when
one dies, /health hangs and streams stop for ``--sim-crash-diagnostics-s``, then the tree dies.

SIGTERM: /health turns 503, in-flight requests finish (new ones are still accepted, as in
SGLang), ``Gracefully exiting...`` every ``--sim-drain-poll-s``, then exit 0 (0.5.23).
SIGINT: stop at once, exit 0; a second SIGINT exits 130 immediately.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import traceback
from typing import NoReturn

import aiohttp
from aiohttp import web

from server_mgr.sim import children, faults, logs
from server_mgr.sim.app import build_app
from server_mgr.sim.config import SimConfig
from server_mgr.sim.logs import SimLog
from server_mgr.sim.scheduler import Scheduler
from server_mgr.sim.state import SimState

WARMUP_PROMPT_TOKENS = 7  # "The capital city of France is"


def run(cfg: SimConfig) -> int:
    """Run the sim until it stops; returns the process exit code."""
    return asyncio.run(_main(cfg))


async def _load(cfg: SimConfig, log: SimLog) -> None:
    """The loading phase: startup lines spread over the startup delay; OOM faults."""
    delay = cfg.startup_delay_s
    log.info(logs.server_args_line(cfg))
    for line in logs.startup_lines_before_pool(cfg):
        log.info(line, rank=True)
    await asyncio.sleep(delay * 0.4)
    if cfg.oom_below is not None and cfg.mem_fraction_static < cfg.oom_below:
        faults.oom_too_low(cfg, log)
    for line in logs.kv_allocated_lines(cfg):
        log.info(line, rank=True)
    await asyncio.sleep(delay * 0.3)
    if cfg.oom_above is not None and cfg.mem_fraction_static > cfg.oom_above:
        faults.oom_too_high(cfg, log)
    for line in logs.graph_and_limits_lines(cfg):
        log.info(line, rank=True)
    await asyncio.sleep(delay * 0.3)


async def _warmup(state: SimState) -> None:
    """SGLang's warmup: poll /model_info, one tiny /generate, then Up."""
    cfg, log = state.cfg, state.log
    if not cfg.skip_server_warmup:
        await asyncio.sleep(cfg.warmup_s)
        log.access("127.0.0.1:0", "GET", "/model_info", 200, "OK")
        log.info(logs.prefill_line(1, WARMUP_PROMPT_TOKENS, 0.0, 0, 0, 0.0), rank=True)
        log.access("127.0.0.1:0", "POST", "/generate", 200, "OK")
    if state.shutting_down:
        return
    state.status = "Up"
    log.info("The server is fired up and ready to roll!")


WARMUP_TRIES = 120  # SGLang's warmup asks for /model_info this many times, a second apart


async def _warmup_unbound(cfg: SimConfig, log: SimLog, kids: list[children.Child]) -> NoReturn:
    """SGLang 0.5.23 when another process holds its port: uvicorn gives up, but the warmup
    thread started with the app goes on asking that port for /model_info (each try up to 5 s)
    and then SIGKILLs the tree, so the process lingers minutes; SIGTERM ends nothing meanwhile."""
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, lambda: None)
    url = f"http://{cfg.host}:{cfg.port}/model_info"
    error = ""
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as session:
        for _ in range(WARMUP_TRIES):
            await asyncio.sleep(1.0)
            try:
                async with session.get(url) as resp:
                    error = f"GET /model_info answered {resp.status}"
            except (aiohttp.ClientError, TimeoutError) as exc:
                error = f"{type(exc).__name__}: {exc}"
    log.error(f"Initialization failed. warmup error: {error}")
    children.kill(kids)
    faults.kill_tree(log)


async def _drain(state: SimState) -> None:
    """Wait for in-flight requests (no drain timeout, as in SGLang), then stop."""
    while state.inflight and state.status != "UnHealthy":
        rids = list(state.inflight)
        state.log.info(
            f"Gracefully exiting... Remaining number of requests {len(rids)}. "
            f"Remaining requests remaining_rids={rids[:10]}."
        )
        await asyncio.sleep(state.cfg.drain_poll_s)
    state.exit_code = 0
    state.stop.set()


def _install_signals(state: SimState, tasks: set[asyncio.Task[None]]) -> None:
    loop = asyncio.get_running_loop()

    def on_sigterm() -> None:
        if state.shutting_down:
            return
        state.shutting_down = True
        state.log.info(
            f"SIGTERM received. signum={int(signal.SIGTERM)} frame=None. "
            "Draining requests and shutting down..."
        )
        tasks.add(loop.create_task(_drain(state)))

    def on_sigint() -> None:
        if state.stop.is_set():
            os._exit(130)  # a second Ctrl-C forces the exit, as uvicorn does
        state.shutting_down = True
        state.exit_code = 0
        state.stop.set()

    loop.add_signal_handler(signal.SIGTERM, on_sigterm)
    loop.add_signal_handler(signal.SIGINT, on_sigint)


async def _on_child_death(state: SimState, died: asyncio.Event) -> None:
    """A child died: SGLang's SIGQUIT path, with /health hanging while it "settles"."""
    await died.wait()
    log = state.log
    state.set_health_stall(True)
    state.set_stall_streams(True)
    log.error("Sleeping 5 seconds before crash diagnostics to let GPU activity settle.")
    await asyncio.sleep(state.cfg.crash_diagnostics_s)
    log.error("No live scheduler processes found; skipping py-spy and CUDA coredump.")
    faults.die(log)


def _on_scheduler_exit(task: asyncio.Task[None], log: SimLog) -> None:
    """The step loop never ends on its own: if it raised, die as SGLang does on a crash."""
    if task.cancelled() or task.exception() is None:
        return
    exc = task.exception()
    detail = "".join(traceback.format_exception(exc)).rstrip()
    log.error(f"Scheduler hit an exception: {detail}", rank=True)
    faults.die(log)


async def _main(cfg: SimConfig) -> int:
    log = SimLog(cfg.log_level, cfg.rank_prefix)
    kids = children.spawn()
    try:
        return await _serve(cfg, log, kids)
    finally:
        children.kill(kids)


# SGLang's uvicorn closes a kept-alive connection idle this long (SGLANG_TIMEOUT_KEEP_ALIVE);
# aiohttp's own default is 75 s
KEEP_ALIVE_S = 5.0


async def _serve(cfg: SimConfig, log: SimLog, kids: list[children.Child]) -> int:
    await _load(cfg, log)
    state = SimState(cfg=cfg, log=log, scheduler=Scheduler(cfg, log))
    runner = web.AppRunner(
        build_app(state),
        access_log=None,
        handler_cancellation=True,
        shutdown_timeout=1.0,
        keepalive_timeout=KEEP_ALIVE_S,
    )
    await runner.setup()
    try:
        await web.TCPSite(runner, cfg.host, cfg.port, reuse_address=True).start()
    except OSError as exc:
        for line in logs.uvicorn_lines(cfg)[:3]:
            log.info(line)
        log.error(
            f"ERROR:    [Errno {exc.errno}] error while attempting to bind on address "
            f"({cfg.host!r}, {cfg.port}): {os.strerror(exc.errno or 0).lower()}"
        )
        log.info("INFO:     Waiting for application shutdown.")
        await runner.cleanup()
        if cfg.skip_server_warmup:
            return 1
        await _warmup_unbound(cfg, log, kids)
    for line in logs.uvicorn_lines(cfg):
        log.info(line)
    tasks: set[asyncio.Task[None]] = set()
    _install_signals(state, tasks)
    scheduler_task = asyncio.create_task(state.scheduler.run())
    scheduler_task.add_done_callback(lambda t: _on_scheduler_exit(t, log))
    tasks.add(scheduler_task)
    tasks.add(asyncio.create_task(_warmup(state)))
    died = asyncio.Event()
    tasks.add(asyncio.create_task(children.watch(kids, log, died)))
    tasks.add(asyncio.create_task(_on_child_death(state, died)))
    await state.stop.wait()
    for task in tasks:
        task.cancel()
    for task in tasks:
        with contextlib.suppress(asyncio.CancelledError):
            await task
    await runner.cleanup()
    return state.exit_code
