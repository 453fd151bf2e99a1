"""A hung test fails within its timeout, whatever loop it hangs on (pytest-timeout's hooks).

pytest-timeout's ``signal`` method raises its failure from a SIGALRM handler. uvloop runs a
Python signal handler inside a callback of its own (``Loop._read_from_self``) and only logs what
it raises, unless that is a ``SystemExit`` or a ``KeyboardInterrupt``: a test waiting on
``workers.event_loop.run`` with no deadline hung past its timeout, and under xdist its worker never
finished. Here the handler raises :class:`TimedOut`, a ``SystemExit``, which uvloop's and
asyncio's loops let through and pytest reports as the test's failure. Should even that not end
the test (the main thread stuck in C, the exception swallowed, a teardown that hangs in turn),
pytest-timeout's ``thread`` method ends the process :func:`backstop_s` later: under xdist the
worker is reported as crashed while running the test, which fails, and a new worker runs the
rest (``tests/test_timeouts.py``).
"""

from __future__ import annotations

import signal
import sys
import threading
import traceback
from collections.abc import Callable, Generator
from types import FrameType
from typing import Any

import pytest
from pytest_timeout import is_debugging, timeout_timer

_CANCEL = pytest.StashKey[Callable[[], None]]()
_BACKSTOP = pytest.StashKey[threading.Timer]()


class TimedOut(SystemExit):
    """A test ran past its timeout (a ``SystemExit``, so that every event loop lets it through)."""


def backstop_s(timeout_s: float) -> float:
    """How long after its timeout a test that is still running ends its process (its teardown,
    stopping the processes it started, may take a while)."""
    return max(1.0, timeout_s / 5)


def _other_stacks() -> str:
    """The stacks of the threads other than this one (whose stack the failure shows)."""
    names = {t.ident: t.name for t in threading.enumerate()}
    return "".join(
        f"--- thread {names.get(ident, ident)}\n{''.join(traceback.format_stack(frame))}"
        for ident, frame in sys._current_frames().items()
        if ident != threading.get_ident()
    )


@pytest.hookimpl(tryfirst=True, optionalhook=True)
def pytest_timeout_set_timer(item: pytest.Item, settings: Any) -> bool | None:
    """The ``signal`` method's alarm, raising :class:`TimedOut`, and the backstop behind it."""
    if settings.method != "signal" or threading.current_thread() is not threading.main_thread():
        return None  # pytest-timeout's own

    fired = threading.Event()

    def on_alarm(signum: int, frame: FrameType | None) -> None:
        if is_debugging():
            return
        fired.set()
        print(_other_stacks(), file=sys.stderr)
        raise TimedOut(f"Timeout (>{settings.timeout}s): the test ran past its timeout")

    backstop = threading.Timer(
        settings.timeout + backstop_s(settings.timeout), timeout_timer, (item, settings)
    )
    backstop.daemon = True

    def cancel() -> None:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, signal.SIG_DFL)
        if not fired.is_set():  # after the alarm it stays armed until the test's teardown ends
            backstop.cancel()

    item.stash[_CANCEL] = cancel
    item.stash[_BACKSTOP] = backstop
    signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, settings.timeout)
    backstop.start()
    return True


@pytest.hookimpl(tryfirst=True, optionalhook=True)
def pytest_timeout_cancel_timer(item: pytest.Item) -> bool | None:
    """Cancel what :func:`pytest_timeout_set_timer` set (pytest-timeout also calls this when a
    test fails, so the backstop never ends a process whose test has been reported)."""
    cancel = item.stash.get(_CANCEL, None)
    if cancel is None:
        return None
    del item.stash[_CANCEL]
    cancel()
    return True


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item) -> Generator[None, object, object]:
    """The test's setup, call and teardown are over: its backstop, if still armed, is not needed."""
    try:
        return (yield)
    finally:
        backstop = item.stash.get(_BACKSTOP, None)
        if backstop is not None:
            backstop.cancel()
