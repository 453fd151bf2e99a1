"""Why a server died, read from its log and exit code (contract §5.4, §6.4).

Exit code 137 / -9 is not proof of the kernel OOM killer: SGLang SIGKILLs its own process tree
after any child crash, warmup failure or watchdog event. So the log decides the class, and the
exit code is only the last resort. Each class carries the remedy the supervisor applies.
"""

from __future__ import annotations

import re
import signal
from dataclasses import dataclass

RESTART = "restart"
RAISE_FRACTION = "raise_fraction"
LOWER_FRACTION = "lower_fraction"
GIVE_UP = "give_up"

_TIMESTAMP_RE = re.compile(r"^\[\d{4}-\d\d-\d\d \d\d:\d\d:\d\d(?:\.\d+)?[^\]]*\]\s*")
_EXCEPTION_RE = re.compile(r"^(?:[\w.]+\.)?\w*(?:Error|Exception)\b.*")


@dataclass(frozen=True, slots=True)
class Crash:
    """A classified death: ``kind`` is the stable class recorded in ``last_error``."""

    kind: str
    detail: str
    remedy: str
    returncode: int | None = None
    # the smallest mem_fraction_static the log says would fit (SGLang 0.5.23 names it)
    min_fraction: float | None = None

    def describe(self) -> str:
        """One line for ``last_error`` and events: ``kind: detail (exit N)``."""
        code = "" if self.returncode is None else f" (exit {self.returncode})"
        return f"{self.kind}: {self.detail}{code}"


# uvicorn's error when another process holds the port. SGLang 0.5.23 does not exit on it: its
# warmup thread goes on asking the port for /model_info (120 tries, each up to 6 s) before it
# SIGKILLs itself, and SIGTERM does not end it meanwhile.
_PORT_TAKEN_RE = re.compile(r"address already in use|Errno 98", re.I)

# (kind, pattern, remedy, explanation prefix); the first match in the log wins.
_RULES: tuple[tuple[str, re.Pattern[str], str, str], ...] = (
    (
        "oom_fraction_too_low",
        re.compile(r"Not enough memory.*mem-fraction-static", re.I),
        RAISE_FRACTION,
        "mem_fraction_static too low",
    ),
    (
        # SGLang 0.5.23, when the weights leave nothing for the KV pool (seen on the CPU path):
        # "Loaded weights leave no GPU memory for the KV cache under --mem-fraction-static=X.
        # Raise --mem-fraction-static above Y (minimum viable = ...)"
        "oom_fraction_too_low",
        re.compile(r"leave no GPU memory for the KV cache"),
        RAISE_FRACTION,
        "mem_fraction_static too low",
    ),
    (
        "oom_fraction_too_high",
        re.compile(r"Capture .*graph failed.*out of memory", re.I),
        LOWER_FRACTION,
        "mem_fraction_static too high (CUDA-graph capture ran out of memory)",
    ),
    (
        "hicache_host_memory",
        re.compile(r"Not enough host memory available"),
        GIVE_UP,
        "not enough host RAM for hicache_size",
    ),
    (
        "invalid_arguments",
        re.compile(
            r"served_model_name cannot contain|error: argument |"
            r"error: unrecognized arguments"
        ),
        GIVE_UP,
        "SGLang refused its arguments",
    ),
    ("port_in_use", _PORT_TAKEN_RE, RESTART, "the HTTP port is taken"),
    ("watchdog_timeout", re.compile(r"watchdog timeout", re.I), RESTART, "a forward step hung"),
    (
        "gpu_memory_unbalanced",
        re.compile(r"memory capacity is unbalanced"),
        RESTART,
        "another process holds GPU memory",
    ),
    ("warmup_failed", re.compile(r"warmup error"), RESTART, "the warmup request failed"),
    ("scheduler_exception", re.compile(r"Scheduler hit an exception"), RESTART, "a scheduler raised"),
    (
        "subprocess_crashed",
        re.compile(r"Subprocess .* crashed with exit code"),
        RESTART,
        "a child process died",
    ),
    (
        "scheduler_killed",
        re.compile(r"scheduler died during initialization \(exit code: -9\)"),
        RESTART,
        "a scheduler was SIGKILLed during startup (the kernel OOM killer is one cause; check dmesg)",
    ),
)
_MIN_FRACTION_RE = re.compile(r"Raise --mem-fraction-static above ([0-9.]+)")
_CUDA_OOM_RE = re.compile(r"(Prefill|Decode) out of memory|OutOfMemoryError|CUDA out of memory")


def dooms_the_start(line: str) -> bool:
    """A log line (or text) after which a starting server will never serve, though its process lives on:
    the supervisor ends the start on it rather than wait for the process to die."""
    return _PORT_TAKEN_RE.search(line) is not None


def classify(log_text: str, returncode: int | None, *, first_prefill: bool) -> Crash:
    """The class of a death from the log written since launch and the exit code.

    ``first_prefill`` says the server had not finished a decode step yet: a CUDA OOM then means
    the static fraction leaves too little room for activations, so the fraction is lowered.
    """
    lines = [_TIMESTAMP_RE.sub("", line).strip() for line in log_text.splitlines()]
    for kind, pattern, remedy, why in _RULES:
        hit = _first(lines, pattern)
        if hit is not None:
            floor = _MIN_FRACTION_RE.search(lines[hit])
            return Crash(
                kind,
                f"{why}: {_detail(lines, hit)}",
                remedy,
                returncode,
                float(floor[1]) if floor else None,
            )
    hit = _first(lines, _CUDA_OOM_RE)
    if hit is not None:
        remedy = LOWER_FRACTION if first_prefill else RESTART
        why = "CUDA out of memory on the first prefill" if first_prefill else "CUDA out of memory"
        return Crash("cuda_oom", f"{why}: {lines[hit][:300]}", remedy, returncode)
    return _by_exit_code(lines, returncode)


def _by_exit_code(lines: list[str], returncode: int | None) -> Crash:
    error = _last_exception(lines[-60:])  # among the last lines of the log
    said = f"; last error line: {error}" if error else ""
    if returncode in (-9, 137):
        return Crash(
            "killed",
            "SIGKILLed with no crash reason in the log (an operator, a parent, "
            "or the kernel OOM killer: check dmesg; exit 137 alone does not say which)" + said,
            RESTART,
            returncode,
        )
    if returncode is not None and returncode < 0:
        name = signal.Signals(-returncode).name if -returncode in signal.valid_signals() else "?"
        return Crash("signaled", f"killed by {name}{said}", RESTART, returncode)
    last = error or next((s for s in reversed(lines) if s), "")[:300]
    if returncode == 2:
        return Crash("invalid_arguments", f"argument error: {last}", GIVE_UP, returncode)
    return Crash("exited", last or "exited without a message", RESTART, returncode)


def _first(lines: list[str], pattern: re.Pattern[str]) -> int | None:
    return next((i for i, line in enumerate(lines) if pattern.search(line)), None)


def _detail(lines: list[str], hit: int) -> str:
    """The matched line, or for a traceback banner the exception line that follows it."""
    line = lines[hit]
    if "hit an exception" in line:
        line = _last_exception(lines[hit + 1 : hit + 200]) or line
    return line[:300]


def _last_exception(lines: list[str]) -> str:
    """The last exception line of ``lines`` ("" if none)."""
    return next((s for s in reversed(lines) if _EXCEPTION_RE.match(s)), "")[:300]
