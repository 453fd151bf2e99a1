"""One event loop per worker process, on its own thread.

Celery's threads pool runs one task per thread; each task hands its stream to this loop and
waits. All of a process's streams then share one loop (one HTTP connection pool, no GIL
contention between 150 reader threads), which is what brings the stream path to a plain asyncio
client's CPU per token (bench/e2e.py --per-token).

The loop is uvloop's by default (the ``event_loop`` setting): on the short-output workload it cut
the loop thread's CPU by 10-15% against asyncio's own loop (bench/e2e.py --short-outputs,
docs/benchmarks-history/short-outputs.md). ``TOKENMILL_EVENT_LOOP=asyncio`` runs the standard library's
loop instead.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine
from concurrent.futures import Future
from typing import Any, TypeVar

from tokenmill.errors import ConfigError
from tokenmill.settings import EVENT_LOOPS

T = TypeVar("T")


def new_loop(kind: str) -> asyncio.AbstractEventLoop:
    """A new event loop of ``kind``, one of :data:`~tokenmill.settings.EVENT_LOOPS` (checked by
    the settings object)."""
    if kind == "asyncio":
        return asyncio.new_event_loop()
    try:
        import uvloop
    except ImportError:
        raise ConfigError(
            "TOKENMILL_EVENT_LOOP=uvloop, but uvloop is not installed (it has no Windows build): "
            "install it, or set TOKENMILL_EVENT_LOOP=asyncio"
        ) from None
    return uvloop.new_event_loop()


def run(coro: Coroutine[Any, Any, T], kind: str = EVENT_LOOPS[0]) -> T:
    """``asyncio.run`` on a loop of ``kind``, by default the worker's (for benchmarks and tests
    that stand in for a worker)."""
    with asyncio.Runner(loop_factory=lambda: new_loop(kind)) as runner:
        return runner.run(coro)


class LoopThread:
    """An event loop of ``kind`` running forever on a daemon thread."""

    def __init__(self, kind: str = EVENT_LOOPS[0]) -> None:
        self.loop = new_loop(kind)
        self._thread = threading.Thread(target=self._run, name="tokenmill-loop", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    def submit(self, coro: Coroutine[Any, Any, T]) -> Future[T]:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=5)
