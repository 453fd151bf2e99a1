"""``tests.procs.wait_for``, the one way the tests wait: what it polls past and what ends it."""

from __future__ import annotations

import pytest

from tests.engines import PortTaken as EnginesPortTaken
from tests.procs import PortTaken, wait_for


class Calls:
    """A condition that raises each of ``outcomes`` in turn (or returns it, if not an exception)."""

    def __init__(self, *outcomes: object) -> None:
        self.outcomes = list(outcomes)
        self.calls = 0

    def __call__(self) -> object:
        self.calls += 1
        outcome = self.outcomes.pop(0) if len(self.outcomes) > 1 else self.outcomes[0]
        if isinstance(outcome, BaseException):
            raise outcome
        return outcome


def test_a_condition_that_raises_now_and_then_is_polled_until_it_holds() -> None:
    # Given a condition not checkable at first (refused, then not yet), then true
    cond = Calls(ConnectionRefusedError("refused"), KeyError("not yet"), None, "ready")

    # When it is waited for
    value = wait_for(cond, 5, "the service", every=0.001)

    # Then the transient errors were polled past and its value is returned
    assert (value, cond.calls) == ("ready", 4)


def test_a_failed_assertion_in_the_condition_ends_the_wait_at_once() -> None:
    # Given a condition that finds its process dead
    cond = Calls(AssertionError("sglang exited 1: Traceback ..."))

    # When it is waited for, with a deadline far off
    with pytest.raises(AssertionError, match=r"^sglang exited 1") as failed:
        wait_for(cond, 5, "sglang to answer", every=0.001)

    # Then the assertion itself is raised after one call, not a time-out later
    assert cond.calls == 1
    assert "timed out" not in str(failed.value)


def test_port_taken_ends_the_wait_at_once_so_the_launch_can_try_another_port() -> None:
    # Given a condition that finds another program on the engine's port
    cond = Calls(PortTaken(8000))

    # When it is waited for
    with pytest.raises(PortTaken):
        wait_for(cond, 5, "the engine", every=0.001)

    # Then it is raised at once, the class tests.engines' retry catches
    assert cond.calls == 1
    assert EnginesPortTaken is PortTaken


def test_a_class_the_caller_names_ends_the_wait_at_once_and_others_still_do_not() -> None:
    # Given a condition that raises a class the caller named, and one that raises another
    named = Calls(LookupError("no such run"))
    other = Calls(ValueError("half written"))

    # When each is waited for, LookupError named as fatal
    with pytest.raises(LookupError):
        wait_for(named, 5, "the run", every=0.001, propagate=(LookupError,))
    with pytest.raises(AssertionError, match="timed out") as timed_out:
        wait_for(other, 0.05, "the run", every=0.001, propagate=(LookupError,))

    # Then the named one ended it on the first call; the other was polled to the deadline
    assert named.calls == 1
    assert other.calls > 1
    assert str(timed_out.value) == "timed out after 0.05s waiting for the run (last error: half written)"


def test_a_condition_that_never_holds_times_out_naming_what_was_awaited() -> None:
    # Given a condition that stays false; when it is waited for; then the time-out names it
    with pytest.raises(AssertionError) as timed_out:
        wait_for(Calls(0), 0.05, "the sealer", every=0.001)

    assert str(timed_out.value) == "timed out after 0.05s waiting for the sealer"
