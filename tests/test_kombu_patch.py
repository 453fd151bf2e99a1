"""``tokenmill/kombu_patch.py`` replaces five private methods of kombu's Redis transport, written
against kombu 5.7. pyproject.toml bounds kombu to the versions it was written for; this test
fails the day those methods change (a new kombu inside the bound, or a widened bound), so that
the patch is read again against the new code instead of silently wrapping something else."""

from __future__ import annotations

import hashlib
import inspect

import kombu
import pytest
from kombu.transport import redis as kombu_redis

from tokenmill import kombu_patch

# the source of each method as kombu 5.7.0 has it (sha256 of inspect.getsource, first 16 hex)
WRITTEN_AGAINST = {
    "QoS.restore_unacked": "8954efef014d546e",
    "Channel._connparams": "e9a4295085a8fb90",
    "Channel._create_client": "dae92bc4075dafb9",
    "Channel._brpop_read": "c42518699709f2df",
    "Transport._deliver": "799e242f3ec53863",  # virtual.Transport's, which the Redis transport inherits
}
ORIGINALS = {
    "QoS.restore_unacked": kombu_patch._original_restore,
    "Channel._connparams": kombu_patch._original_connparams,
    "Channel._create_client": kombu_patch._original_create_client,
    "Channel._brpop_read": kombu_patch._original_brpop_read,
    "Transport._deliver": kombu_patch._original_deliver,
}


@pytest.mark.parametrize("name", sorted(WRITTEN_AGAINST))
def test_the_kombu_methods_the_patch_replaces_are_the_ones_it_was_written_against(name: str) -> None:
    source = inspect.getsource(ORIGINALS[name])
    digest = hashlib.sha256(source.encode()).hexdigest()[:16]
    assert digest == WRITTEN_AGAINST[name], (
        f"kombu {kombu.__version__} changed {name}, which tokenmill/kombu_patch.py replaces: read the "
        f"patch against the new code, then record the new digest {digest} here\n{source}"
    )


def test_the_patch_is_what_kombu_runs_and_kombu_is_within_the_bound() -> None:
    kombu_patch.apply()
    assert kombu_redis.QoS.restore_unacked is kombu_patch._restore_unacked
    assert kombu_redis.Channel._connparams is kombu_patch._connparams
    assert kombu_redis.Channel._create_client is kombu_patch._create_client
    assert kombu_redis.Channel._brpop_read is kombu_patch._brpop_read
    assert kombu_redis.Transport._deliver is kombu_patch._deliver
    major, minor = (int(x) for x in kombu.__version__.split(".")[:2])
    assert (major, minor) == (5, 7), f"kombu {kombu.__version__}: pyproject.toml bounds kombu to 5.7.x"
