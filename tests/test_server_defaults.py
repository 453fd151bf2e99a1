"""Server config defaults a user expects: SGLang's port, and logs beside the config file."""

from __future__ import annotations

from pathlib import Path

import pytest

from server_mgr.command import launch_argv
from server_mgr.config import load_config
from tests.server_fixtures import Up, sim_server, write_config
from tokenmill.errors import ConfigError


def test_a_server_without_a_port_listens_on_sglangs_default(tmp_path: Path) -> None:
    config = load_config(write_config(tmp_path / "s.toml", {"name": "gpu0", "model_path": "m"}))[0]
    assert config.port == 30000
    argv = launch_argv(config)
    assert argv[argv.index("--port") + 1] == "30000"


def test_two_servers_without_ports_on_one_host_are_refused_saying_so(tmp_path: Path) -> None:
    path = write_config(
        tmp_path / "s.toml", {"name": "a", "model_path": "m"}, {"name": "b", "model_path": "m"}
    )
    with pytest.raises(ConfigError) as err:
        load_config(path)
    assert str(err.value) == (
        f"{path}: servers 'a', 'b' have no 'port', so each would listen on the default 30000 on this "
        "host: give each server its own port"
    )
    # one without a port beside one with its own is fine
    write_config(path, {"name": "a", "model_path": "m"}, {"name": "b", "model_path": "m", "port": 30001})
    assert [c.port for c in load_config(path)] == [30000, 30001]


def test_log_dir_is_relative_to_the_config_file_not_the_current_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    conf = tmp_path / "conf"
    conf.mkdir()
    monkeypatch.chdir(tmp_path)
    default = load_config(write_config(conf / "a.toml", {"name": "a", "model_path": "m"}))[0]
    assert default.log_dir == str(conf / "tokenmill-logs")
    relative = load_config(write_config(conf / "b.toml", {"name": "a", "model_path": "m", "log_dir": "l"}))
    assert relative[0].log_dir == str(conf / "l")
    absolute = load_config(
        write_config(conf / "c.toml", {"name": "a", "model_path": "m", "log_dir": str(tmp_path / "x")})
    )
    assert absolute[0].log_dir == str(tmp_path / "x")


def test_server_up_writes_its_logs_beside_the_config(
    tmp_path: Path, redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given a config without log_dir, and `server up` started from another directory
    conf, elsewhere = tmp_path / "conf", tmp_path / "elsewhere"
    conf.mkdir()
    elsewhere.mkdir()
    table = sim_server(tmp_path)
    del table["log_dir"]
    path = write_config(conf / "servers.toml", table)
    monkeypatch.chdir(elsewhere)
    with Up(path, redis_url) as up:
        up.wait_state("ready")
    # Then the manager's and the server's logs are beside the config file, none where it ran
    logs = conf / "tokenmill-logs"
    assert "ready" in (logs / "manager.log").read_text()
    assert (logs / "s1.log").stat().st_size > 0
    assert list(elsewhere.iterdir()) == []
