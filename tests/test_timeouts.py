"""A hung test fails within its timeout (``tests/timeouts.py``): a child pytest, on one xdist
worker, runs tests that hang the way the suite's did and one after them."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

from tests.procs import ROOT

TIMEOUT_S = 1.0

HUNG_TESTS = """
import asyncio
import time

from workers.event_loop import run


def test_a_wait_on_the_worker_loop_with_no_deadline():
    async def forever():
        await asyncio.Event().wait()

    run(forever())  # uvloop, on this thread, as tests.test_redis_async and tests.test_stream run


def test_a_wait_that_swallows_every_exception():
    while True:
        try:
            time.sleep(0.1)
        except BaseException:
            pass


def test_after_them():
    pass
"""


def test_a_hung_test_fails_within_its_timeout_and_the_tests_after_it_still_run(tmp_path: Path) -> None:
    # Given a test that waits forever on the worker's uvloop, and one that swallows the timeout
    (tmp_path / "test_hung.py").write_text(HUNG_TESTS)
    junit = tmp_path / "junit.xml"
    argv = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "tests.timeouts"]
    argv += ["-n", "1", "--timeout", str(TIMEOUT_S), "--rootdir", str(tmp_path), "-c", os.devnull]
    argv += [f"--junitxml={junit}", str(tmp_path / "test_hung.py")]

    # When pytest runs them on one xdist worker with a short timeout
    child = subprocess.Popen(
        argv, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True
    )
    try:
        out = child.communicate(timeout=60)[0].decode(errors="replace")
    except subprocess.TimeoutExpired:
        os.killpg(child.pid, signal.SIGKILL)
        raise AssertionError(
            f"the run with hung tests was still going after 60 s: {child.communicate()[0]!r}"
        ) from None

    # Then the first failed at its timeout, the worker running the second was ended and replaced,
    # and the test after them ran
    cases = {case.get("name"): case for case in ET.parse(junit).getroot().iter("testcase")}
    first = cases["test_a_wait_on_the_worker_loop_with_no_deadline"]
    failure = first.find("failure")
    assert failure is not None and "TimedOut: Timeout (>1.0s)" in failure.get("message", ""), out
    assert float(first.get("time", "inf")) < TIMEOUT_S + 5, out
    assert (
        "worker 'gw0' crashed while running 'test_hung.py::test_a_wait_that_swallows_every_exception'" in out
    )
    assert "2 failed, 1 passed" in out, out
