"""A managed server's API key reaches it in a private file, never on its command line (``ps``)."""

from __future__ import annotations

import stat
import sys
from pathlib import Path

import orjson

from server_mgr.command import launch_argv, write_key_file
from server_mgr.config import load_config
from tests.procs import http_status
from tests.server_fixtures import Up, sim_server, write_config
from tokenmill import keys, servers
from tokenmill.capacity import get_bytes
from tokenmill.local_redis import free_port

KEY = "sk-launch-secret-8"


def test_the_api_key_goes_to_sglang_as_a_private_options_file_not_as_a_flag(tmp_path: Path) -> None:
    # Given an SGLang server with an API key
    table = {"name": "g", "port": 30000, "model_path": "m", "api_key": KEY, "log_dir": str(tmp_path)}
    config = load_config(write_config(tmp_path / "servers.toml", table))[0]
    # When its launch is prepared
    key_file = write_key_file(config)
    argv = launch_argv(config, key_file=key_file)
    # Then the argv names the file, the key is in no argument, and only its owner reads the file
    assert key_file is not None and argv[-2:] == ["--config", str(key_file)]
    assert not [a for a in argv if KEY in a] and "--api-key" not in argv
    assert stat.S_IMODE(key_file.stat().st_mode) == 0o600
    assert orjson.loads(key_file.read_bytes()) == {"api-key": KEY}
    # and with a --config of its own in extra_args (SGLang takes one), the key stays a flag
    own = load_config(write_config(tmp_path / "own.toml", {**table, "extra_args": ["--config", "o.yaml"]}))[0]
    assert write_key_file(own) is None and launch_argv(own)[-4:] == ["--api-key", KEY, "--config", "o.yaml"]


def test_a_managed_servers_api_key_is_in_no_command_line_and_still_guards_it(
    tmp_path: Path, redis_url: str
) -> None:
    # Given a managed sim with an API key
    table = sim_server(tmp_path, api_key=KEY)
    with Up(write_config(tmp_path / "servers.toml", table), redis_url) as up:
        # When it is up
        pid = up.wait_state(servers.READY).pid
        # Then its process's command line holds no key, and the key still guards it
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().decode()
        assert KEY not in cmdline and "--config" in cmdline, cmdline
        url = f"http://127.0.0.1:{table['port']}/v1/models"
        assert http_status(url) == 401 and orjson.loads(get_bytes(url, KEY, 5))["data"]
        # and neither the manager's output, nor the command it published, nor the log holds it
        published = up.client.hgetall(keys.server("s1"))
        assert b"--config" in published[b"command"] and KEY.encode() not in b"".join(published.values())
        assert KEY not in up.output() and KEY not in (Path(table["log_dir"]) / "s1.log").read_text()


# SGLang logs its options at start (``server_args=ServerArgs(... api_key='…')``); this launcher does
# the same with the key it reads from its --config file, then dies
_LOGS_ITS_KEY = (
    "import json, sys; key = json.load(open(sys.argv[sys.argv.index('--config') + 1]))['api-key']; "
    "print('CUDA driver not found'); print(f\"server_args=ServerArgs(api_key='{key}')\"); raise SystemExit(3)"
)


def test_a_crash_whose_log_holds_the_api_key_is_reported_without_it(tmp_path: Path, redis_url: str) -> None:
    # Given a managed server with an API key whose log prints its options, the key among them
    table = {
        "name": "s1",
        "port": free_port(),
        "model_path": "m",
        "api_key": KEY,
        "log_dir": str(tmp_path / "logs"),
        "launcher": [sys.executable, "-c", _LOGS_ITS_KEY],
        "max_restarts": 0,
    }
    with Up(write_config(tmp_path / "s.toml", table), redis_url) as up:
        # When it crashes at start
        failed = up.wait_state(servers.FAILED)
        # Then the log held the key, but neither last_error nor any event nor the output shows it
        assert KEY in (tmp_path / "logs" / "s1.log").read_text()
        events = str(up.events())
        assert "api_key='***'" in failed.last_error and KEY not in failed.last_error
        assert KEY not in events and KEY not in up.output()
