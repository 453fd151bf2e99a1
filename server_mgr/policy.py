"""What to do after a server died: relaunch after a backoff, step the memory fraction, or give up.

Pure decisions (no I/O), so every rule is testable on its own:

- a crash whose remedy is ``give_up`` (the arguments are refused, the host lacks RAM) fails at once;
- a startup OOM steps ``mem_fraction_static`` by ``mem_fraction_step`` in the direction the log
  names (past the smallest fitting fraction when the log names one), within
  ``mem_fraction_bounds``; a step back the other way means no fraction fits;
- any other crash is relaunched with exponential backoff, unless it is the (max_restarts + 1)-th
  within ``restart_window_s``: a crash loop ends in ``failed``. OOM steps are bounded by the
  bounds instead, so they do not count toward the crash loop.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from server_mgr.config import ServerConfig
from server_mgr.crash import GIVE_UP, LOWER_FRACTION, RAISE_FRACTION, Crash

RELAUNCH = "relaunch"
FAIL = "fail"


@dataclass(frozen=True, slots=True)
class Decision:
    """``action`` is RELAUNCH or FAIL; ``fraction`` is set when the memory fraction changes."""

    action: str
    reason: str
    delay_s: float = 0.0
    fraction: float | None = None


class RestartPolicy:
    """Remembers recent crashes and the last fraction step of one server."""

    def __init__(self, config: ServerConfig) -> None:
        self.config = config
        self.crashes: deque[float] = deque()
        self.last_step = 0  # +1 after raising the fraction, -1 after lowering it

    def decide(self, crash: Crash, now: float, fraction: float | None) -> Decision:
        """The decision for ``crash`` at time ``now``; ``fraction`` is the one just launched with."""
        if crash.remedy == GIVE_UP:
            return Decision(FAIL, f"{crash.describe()}; restarting cannot fix this")
        if crash.remedy in (RAISE_FRACTION, LOWER_FRACTION):
            return self._step(crash, fraction)
        return self._restart(crash, now)

    def _restart(self, crash: Crash, now: float) -> Decision:
        c = self.config
        self.crashes.append(now)
        while self.crashes and self.crashes[0] < now - c.restart_window_s:
            self.crashes.popleft()
        count = len(self.crashes)
        if count > c.max_restarts:
            return Decision(
                FAIL,
                f"crash loop: {count} crashes within {c.restart_window_s:g} s "
                f"(max_restarts = {c.max_restarts}); last: {crash.describe()}",
            )
        delay = min(c.backoff_max_s, c.backoff_initial_s * 2 ** (count - 1))
        return Decision(RELAUNCH, crash.describe(), delay_s=delay)

    def _step(self, crash: Crash, fraction: float | None) -> Decision:
        c = self.config
        direction = 1 if crash.remedy == RAISE_FRACTION else -1
        pinned = pinned_pool(c.extra_args)
        if direction > 0 and pinned is not None:
            # SGLang sizes the pool from --max-total-tokens alone then: no fraction changes it
            return Decision(
                FAIL,
                f"{crash.describe()}; the KV pool is set by --max-total-tokens {pinned} in extra_args, "
                "so raising mem_fraction_static cannot help: fix that value",
            )
        low, high = c.mem_fraction_bounds
        too, other = ("low", "high") if direction > 0 else ("high", "low")
        if fraction is None:
            fraction = low if direction > 0 else high
        if self.last_step == -direction:
            return Decision(
                FAIL,
                f"no mem_fraction_static fits: {fraction:g} is too {too}, but "
                f"the previous step found the other side too {other}; "
                f"last: {crash.describe()}",
            )
        new = round(fraction + direction * c.mem_fraction_step, 4)
        if direction > 0 and crash.min_fraction is not None:
            # the log names the smallest fraction that fits: go at least one step past it
            new = max(new, round(crash.min_fraction + c.mem_fraction_step, 4))
        if not low <= new <= high:
            return Decision(
                FAIL,
                f"mem_fraction_static {fraction:g} is too {too} and {new:g} "
                f"would leave mem_fraction_bounds [{low:g}, {high:g}]; "
                f"last: {crash.describe()}",
            )
        self.last_step = direction
        return Decision(RELAUNCH, f"{crash.kind}: mem_fraction_static {fraction:g} -> {new:g}", fraction=new)


def pinned_pool(extra_args: tuple[str, ...]) -> str | None:
    """The ``--max-total-tokens`` value given in ``extra_args``, if any."""
    for i, arg in enumerate(extra_args):
        if arg.startswith("--max-total-tokens="):
            return arg.split("=", 1)[1]
        if arg == "--max-total-tokens" and i + 1 < len(extra_args):
            return extra_args[i + 1]
    return None
