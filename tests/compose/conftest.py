"""The stack for the container tests: built and brought up once per module, always torn down."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.compose.stack import Stack


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """compose.yaml's images built and its services up (running, healthy where checked).

    Whatever happens, the project's containers, networks and volumes are removed afterwards, and
    the teardown fails the run if any is left.
    """
    workdir: Path = tmp_path_factory.mktemp("compose")
    s = Stack.create(workdir)
    s.teardown()  # what a run killed before its teardown left behind
    try:
        s.run("build", timeout=1800)
        s.up()
        yield s
    finally:
        left = s.teardown()
    assert not left, f"left behind after `down --volumes`: {left}"
