"""Key formats: every key under tm:{run}: or tm:_:, built in tokenmill/keys.py."""

import pytest

from tokenmill import keys
from tokenmill.errors import ConfigError


def test_run_keys_have_one_shape() -> None:
    k = keys.RunKeys("synth")
    assert k.job("B1:7") == "tm:synth:job:B1:7"
    assert k.jobs("B1") == "tm:synth:jobs:B1"
    assert k.partitions() == "tm:synth:partitions"
    assert k.counts() == "tm:synth:counts"
    assert k.leases() == "tm:synth:leases"
    assert k.delayed() == "tm:synth:delayed"
    assert k.backlog("long") == "tm:synth:backlog:long"
    assert k.failures() == "tm:synth:failures"
    assert k.stats() == "tm:synth:stats"
    assert k.throughput() == "tm:synth:tput"
    assert k.lengths() == "tm:synth:lengths"
    assert k.unsealed("B1") == "tm:synth:unsealed:B1"
    assert k.seal_since() == "tm:synth:seal_since"
    assert k.shard("mx3-ab12") == "tm:synth:shard:mx3-ab12"
    assert k.shards("B1") == "tm:synth:shards:B1"
    assert k.seals_pending() == "tm:synth:seals_pending"
    assert k.sealed() == "tm:synth:sealed"
    assert k.results_store() == "tm:synth:results"
    assert k.outputs() == "tm:synth:outputs"
    assert k.recent("B1") == "tm:synth:recent:B1"
    assert k.quality_worst("repetition") == "tm:synth:qworst:repetition"
    assert k.quality() == "tm:synth:quality"
    assert k.quality_window("B1") == "tm:synth:qwin:B1"
    assert k.quality_window_counts() == "tm:synth:qwinc"
    assert k.quality_rules() == "tm:synth:qrules"
    assert k.quality_reference() == "tm:synth:qref"
    assert k.paused() == "tm:synth:paused"
    assert k.series() == "tm:synth:series"


def test_shared_keys_live_under_the_shared_prefix() -> None:
    for key in (
        keys.runs(),
        keys.servers(),
        keys.server("a"),
        keys.server_events("a"),
        keys.admission("a"),
        keys.upkeep_lock(),
        keys.seal_lock(),
        keys.worker_control(),
        keys.server_series("a"),
        keys.server_states("a"),
        keys.series_servers(),
        keys.dead_letters(),
        keys.dead_letters_count(),
    ):
        assert key.startswith("tm:_:")
    assert keys.broker_queue("short") == "short"
    assert keys.server_series("a") == "tm:_:server:a:series"
    assert keys.server_states("a") == "tm:_:server:a:states"
    assert keys.server_idle("127.0.0.1:30000") == "tm:_:idle:127.0.0.1:30000"
    assert (keys.dead_letters(), keys.dead_letters_count()) == ("tm:_:dead", "tm:_:dead:count")


def test_broker_keys_are_kombus_own() -> None:
    from kombu.transport.redis import Channel

    assert keys.broker_unacked() == Channel.unacked_key


def test_count_fields_round_trip() -> None:
    assert keys.count_field("done", "B 1") == "done|B 1"
    assert keys.split_count_field("done|B 1") == ("done", "B 1")


@pytest.mark.parametrize("bad", ["", "a:b", "a b", "x" * 101, "-lead", "a|b", "a/b", "a*"])
def test_run_names_that_would_break_keys_are_refused(bad: str) -> None:
    with pytest.raises(ConfigError, match="not a valid run name"):
        keys.check_run(bad)


@pytest.mark.parametrize("bad", ["", "a|b", "a/b", ".hidden", " x", "x "])
def test_partition_names_that_would_break_keys_or_files_are_refused(bad: str) -> None:
    with pytest.raises(ConfigError, match="not a valid name"):
        keys.check_partition(bad)
