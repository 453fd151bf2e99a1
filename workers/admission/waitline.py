"""A process's jobs waiting for admission, first come first served: only the head asks Redis.

The jobs wait on the worker's event loop (``workers/job_path.py``). The one at the head asks for
room, then sleeps until woken (a slot freed in this process, a wider window) or a timeout; the
others sleep until they reach the head. So hundreds of waiting jobs cost one poll, not hundreds.
A job whose earlier attempt was cut stands ``ahead`` of the jobs that never ran: interrupted
work resumes before new work starts.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from collections.abc import AsyncIterator


class Turn:
    """A job's place in a :class:`WaitLine` (used on the loop only)."""

    def __init__(self, line: WaitLine, ahead: bool) -> None:
        self._line = line
        self._wake = asyncio.Event()
        self.ahead = ahead
        self._passed_at = -1  # the line's epoch when it last stepped back

    @property
    def passed(self) -> bool:
        """Whether it stepped back since the head was last woken (room may have come since)."""
        return self._passed_at == self._line.epoch

    def step_back(self) -> bool:
        """Let the first job that has not stepped back ask before this one (the head waits for
        one server only; the job behind may have room elsewhere). False when there is none:
        this job stays the head and waits."""
        return self._line.step_back(self)

    def first(self) -> bool:
        """Whether this job is at the head of the line (the one that asks for room)."""
        return self._line.head() is self

    def arm(self) -> None:
        """Forget past wake-ups: call before asking for room, so that a slot freed while
        asking is not missed by the wait that follows."""
        self._wake.clear()

    async def wait(self, timeout_s: float) -> None:
        """Sleep until woken (head reached, or a slot freed here) or ``timeout_s``; a wake-up
        is used up (a job woken as the head, then moved back, must not find it set again
        behind: it would spin)."""
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout_s):
                await self._wake.wait()
        self._wake.clear()

    def wake(self) -> None:
        self._wake.set()


class WaitLine:
    """This process's jobs waiting for admission. Joined on the loop; woken from any thread."""

    def __init__(self) -> None:
        self._turns: deque[Turn] = deque()
        self.epoch = 0  # counts the head's wake-ups: a step back lasts until the next
        self._loop: asyncio.AbstractEventLoop | None = None

    def head(self) -> Turn | None:
        return self._turns[0] if self._turns else None

    def wake_head(self) -> None:
        """Let the head ask again now (a slot was freed or shrank, or the head left); safe from
        any thread."""
        loop = self._loop
        if loop is None or not self._turns:
            return
        try:
            on_loop = asyncio.get_running_loop() is loop
        except RuntimeError:
            on_loop = False
        if on_loop:
            self._wake_head()
        else:
            loop.call_soon_threadsafe(self._wake_head)

    def _wake_head(self) -> None:
        self.epoch += 1  # room may have come: every job that stepped back asks again, in order
        if self._turns:
            self._turns[0].wake()

    def step_back(self, turn: Turn) -> bool:
        if not self._turns or self._turns[0] is not turn:
            return False
        at = next((i for i, t in enumerate(self._turns) if not t.passed and t is not turn), None)
        if at is None:
            return False
        ahead = self._turns[at]
        del self._turns[at]
        self._turns.appendleft(ahead)  # the first job that has not stepped back asks now
        turn._passed_at = self.epoch
        ahead.wake()
        return True

    @contextlib.asynccontextmanager
    async def join(self, ahead: bool = False) -> AsyncIterator[Turn]:
        """Stand in line until the block exits; leaving wakes the next job. With ``ahead``,
        stand behind the other such jobs only."""
        self._loop = asyncio.get_running_loop()
        turn = Turn(self, ahead)
        at = len(self._turns)
        if ahead:
            at = next((i for i, t in enumerate(self._turns) if not t.ahead), at)
        self._turns.insert(at, turn)
        if at == 0:
            turn.wake()
        try:
            yield turn
        finally:
            self._turns.remove(turn)
            self._wake_head()
