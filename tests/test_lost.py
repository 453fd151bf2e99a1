"""Which streams a server no longer holds (workers/lost.py): the pure rule, from the loads the
watch read and what each stream received; a restarted or replaced server is noticed within
seconds, and a server that is slow, queueing, prefilling or unreachable never is."""

from __future__ import annotations

from tokenmill.server_report import Load
from workers.lost import Heard, Reading, lost

QUIET = 5.0
NOW = 100.0
IDLE = Load(running=0, waiting=0, used_tokens=0, capacity=4000)


def readings(load: Load, start: float = NOW - 6, every: float = 1.0) -> list[Reading]:
    """One reading a second from ``start`` to now, each showing ``load``."""
    out, at = [], start
    while at <= NOW:
        out.append(Reading(at, load))
        at += every
    return out


# streams silent since before the readings began: two mid-answer, one never answered
DEAD = [Heard("a", NOW - 20, True), Heard("b", NOW - 20, True), Heard("c", NOW - 18, False)]


def test_a_replacement_that_holds_nothing_for_the_quiet_span_loses_every_silent_stream() -> None:
    # Given streams silent for 20 s, and a server that reported nothing running, waiting or held
    # in every reading of the last 6 s
    # When the rule looks
    # Then every one of them is lost, answered or not
    assert lost(readings(IDLE), DEAD, NOW, QUIET) == ["a", "b", "c"]


def test_a_stream_still_receiving_chunks_is_never_lost() -> None:
    # Given an idle-looking server and a stream that heard a chunk 2 s ago
    live = Heard("live", NOW - 2, True)
    # Then it is not lost, while the silent ones are
    assert lost(readings(IDLE), [*DEAD, live], NOW, QUIET) == ["a", "b", "c"]
    # and neither is one that heard its last chunk 4.5 s ago (less than the quiet span)
    assert lost(readings(IDLE), [Heard("x", NOW - 4.5, True)], NOW, QUIET) == []


def test_a_server_with_requests_waiting_loses_nothing() -> None:
    # Given silent streams, and a server queueing (or holding retracted) requests in one reading
    reads = readings(IDLE)
    reads[3] = Reading(reads[3].at, IDLE._replace(waiting=2))
    # Then nothing is lost: a queued request hears nothing
    assert lost(reads, DEAD, NOW, QUIET) == []
    assert (
        lost(readings(Load(running=40, waiting=4, used_tokens=3000, capacity=4000)), DEAD, NOW, QUIET) == []
    )


def test_a_server_not_read_for_the_whole_quiet_span_loses_nothing() -> None:
    # Given a load watch that could not reach the server (no readings), or could again only 4 s
    # ago (a failed read forgets those before it)
    # Then nothing is lost
    assert lost([], DEAD, NOW, QUIET) == []
    assert lost(readings(IDLE, start=NOW - 4), DEAD, NOW, QUIET) == []


def test_a_prefilling_server_keeps_the_streams_it_has_not_answered_yet() -> None:
    # Given a server with nothing running or waiting but KV in use: a long prompt's prefill,
    # which SGLang counts neither running nor waiting
    prefilling = IDLE._replace(used_tokens=30_000)
    # Then a stream that was never answered is not lost
    assert lost(readings(prefilling), [Heard("long", NOW - 20, False)], NOW, QUIET) == []


def test_a_server_running_fewer_requests_than_silent_answered_streams_loses_those_only() -> None:
    # Given a replacement already running one new request, and two answered streams and one
    # unanswered stream silent since before
    one_running = IDLE._replace(running=1, used_tokens=200)
    # Then the answered ones are lost (a decoding request hears a chunk at every step)
    assert lost(readings(one_running), DEAD, NOW, QUIET) == ["a", "b"]
    # but a slow server whose running requests cover the silent ones loses nothing
    stalled = IDLE._replace(running=2, used_tokens=500)
    assert lost(readings(stalled), DEAD, NOW, QUIET) == []


def test_a_stream_silent_since_before_another_process_found_the_server_idle_is_lost() -> None:
    # Given a server that this process reads busy (and queueing), the retried jobs of another
    # process that found it idle over a quiet span beginning 12 s ago
    busy = readings(Load(running=8, waiting=2, used_tokens=900, capacity=4000))
    # Then the streams silent since before then are lost, and one that heard a chunk after is not
    later = Heard("later", NOW - 6, True)
    assert lost(busy, [*DEAD, later], NOW, QUIET, idle_at=NOW - 12) == ["a", "b", "c"]
    # and without that finding nothing is
    assert lost(busy, [*DEAD, later], NOW, QUIET) == []
