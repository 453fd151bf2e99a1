"""Server configs: exact launch commands, and bad configs refused before anything starts."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from server_mgr.cli import server
from server_mgr.command import display_command, launch_argv
from server_mgr.config import load_config
from server_mgr.sim.cli import sim as sim_cli
from tests.server_fixtures import write_config
from tokenmill.errors import ConfigError, LossyKvCacheError

REALISTIC = {
    "name": "r1",
    "engine": "sglang",
    "host": "0.0.0.0",
    "port": 30000,
    "model_path": "deepseek-ai/DeepSeek-R1-0528",
    "served_model_name": "deepseek-r1",
    "tp_size": 8,
    "mem_fraction_static": 0.88,
    "enable_hierarchical_cache": True,
    "hicache_size": 48,
    "context_length": 65536,
    "max_running_requests": 192,
    "reasoning_parser": "deepseek-r1",
    "api_key": "sk-secret-123",
    "enable_metrics": True,
    "launcher": ["/opt/sglang/bin/python", "-m", "sglang.launch_server"],
    "extra_args": ["--schedule-policy", "lpm", "--cuda-graph-max-bs-decode", "160"],
    "env": {"CUDA_VISIBLE_DEVICES": "0,1,2,3,4,5,6,7"},
}


def one(tmp_path: Path, **table: Any) -> Any:
    return load_config(write_config(tmp_path / "servers.toml", table))[0]


def test_realistic_config_launch_argv_matches_exactly(tmp_path: Path) -> None:
    config = one(tmp_path, **REALISTIC)
    assert launch_argv(config) == [
        "/opt/sglang/bin/python",
        "-m",
        "sglang.launch_server",
        "--model-path",
        "deepseek-ai/DeepSeek-R1-0528",
        "--served-model-name",
        "deepseek-r1",
        "--host",
        "0.0.0.0",
        "--port",
        "30000",
        "--tp-size",
        "8",
        "--mem-fraction-static",
        "0.88",
        "--enable-hierarchical-cache",
        "--hicache-size",
        "48",
        "--context-length",
        "65536",
        "--max-running-requests",
        "192",
        "--reasoning-parser",
        "deepseek-r1",
        "--enable-metrics",
        "--api-key",
        "sk-secret-123",
        "--schedule-policy",
        "lpm",
        "--cuda-graph-max-bs-decode",
        "160",
    ]


def test_no_cuda_graphs_emits_0_5_23s_backend_flags_not_the_deprecated_one(tmp_path: Path) -> None:
    argv = launch_argv(one(tmp_path, **REALISTIC, cuda_graphs=False))
    sim = launch_argv(one(tmp_path, name="s", engine="sim", port=30001, cuda_graphs=False))

    assert argv[argv.index("--enable-metrics") + 1 : argv.index("--api-key")] == [
        "--cuda-graph-backend-decode",
        "disabled",
        "--cuda-graph-backend-prefill",
        "disabled",
    ]
    assert "--disable-cuda-graph" not in argv and "--cuda-graph-backend-decode" not in sim
    with pytest.raises(
        ConfigError, match="'--cuda-graph-backend-decode' is set by the config key cuda_graphs"
    ):
        one(tmp_path, **{**REALISTIC, "extra_args": ["--cuda-graph-backend-decode", "disabled"]})


def test_server_command_prints_one_line_per_server_with_the_api_key_hidden(tmp_path: Path) -> None:
    path = write_config(
        tmp_path / "servers.toml",
        REALISTIC,
        {"name": "sim0", "engine": "sim", "port": 30001, "api_key": "k2"},
    )
    result = CliRunner().invoke(server, ["command", "--config", str(path)])
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert len(lines) == 2
    assert "sk-secret-123" not in result.output and "k2" not in result.output
    assert lines[0].startswith("CUDA_VISIBLE_DEVICES=0,1,2,3,4,5,6,7 /opt/sglang/bin/python -m sglang")
    assert "--api-key '***'" in lines[0]
    shown = CliRunner().invoke(server, ["command", "--config", str(path), "--show-secrets"])
    assert "--api-key sk-secret-123" in shown.output.splitlines()[0]


def test_default_launcher_is_python_m_sglang_launch_server(tmp_path: Path) -> None:
    config = one(tmp_path, name="a", port=30000, model_path="Qwen/Qwen3-8B")
    assert launch_argv(config) == [
        "python",
        "-m",
        "sglang.launch_server",
        "--model-path",
        "Qwen/Qwen3-8B",
        "--host",
        "127.0.0.1",
        "--port",
        "30000",
        "--tp-size",
        "1",
    ]


def test_secret_env_values_are_hidden_in_the_printed_command(tmp_path: Path) -> None:
    config = one(tmp_path, name="a", port=1, model_path="m", env={"HF_TOKEN": "hf_abc", "X": 1})
    assert "hf_abc" not in display_command(config)
    assert "HF_TOKEN=hf_abc" in display_command(config, show_secrets=True)


def test_sim_command_is_this_python_running_the_sim_with_its_knobs(tmp_path: Path) -> None:
    config = one(
        tmp_path,
        name="s",
        engine="sim",
        port=31000,
        tp_size=2,
        kv_cache_dtype="bf16",
        mem_fraction_static=0.9,
        sim={"oom_above": 0.85, "perturb": 0.05, "seed": 7},
    )
    assert launch_argv(config) == [
        sys.executable,
        "-m",
        "server_mgr.sim",
        "--host",
        "127.0.0.1",
        "--port",
        "31000",
        "--tp-size",
        "2",
        "--mem-fraction-static",
        "0.9",
        "--sim-oom-above",
        "0.85",
        "--sim-perturb",
        "0.05",
        "--sim-seed",
        "7",
    ]


def test_every_flag_of_a_sim_command_is_accepted_by_the_sim_parser(tmp_path: Path) -> None:
    knobs = {
        "startup_delay_s": 0.1,
        "warmup_s": 0.1,
        "health_latency_s": 0.1,
        "health_timeout_s": 2.0,
        "drain_poll_s": 0.1,
        "step_ms": 1.0,
        "step_ms_per_req": 0.1,
        "prefill_tokens_per_ms": 100.0,
        "mean_output_tokens": 10,
        "crash_after_requests": 3,
        "error_every": 5,
        "stall_every": 7,
        "oom_above": 0.9,
        "oom_below": 0.5,
        "perturb": 0.1,
        "seed": 1,
    }
    config = one(
        tmp_path,
        name="s",
        engine="sim",
        port=31000,
        model_path="m",
        served_model_name="n",
        tp_size=2,
        dp_size=2,
        mem_fraction_static=0.8,
        context_length=4096,
        max_running_requests=8,
        reasoning_parser="qwen3",
        tool_call_parser="qwen25",
        api_key="k",
        enable_metrics=True,
        enable_hierarchical_cache=True,
        hicache_size=4,
        extra_args=["--max-total-tokens", "9000"],
        sim=knobs,
    )
    ctx = sim_cli.make_context("sim", launch_argv(config)[3:])
    assert ctx.params["mem_fraction_static"] == 0.8 and ctx.params["perturb"] == 0.1


@pytest.mark.parametrize(
    ("table", "key", "words"),
    [
        ({"colour": "red"}, "colour", "unknown key"),
        ({"served_model_name": "org:model"}, "served_model_name", "may not contain ':'"),
        ({"extra_args": ["--tp", "8"]}, "extra_args", "--tp-size"),
        ({"extra_args": ["--cuda-graph-max-bs", "16"]}, "extra_args", "removed in sglang 0.5.23"),
        ({"extra_args": ["--mem-fraction-static", "0.8"]}, "extra_args", "mem_fraction_static"),
        ({"extra_args": ["--mem-frac", "0.8"]}, "extra_args", "abbreviation"),
        ({"port": -1}, "port", "between 1 and 65535"),
        ({"port": "30000"}, "port", "must be an integer"),
        ({"kv_cache_dtype": "fp4_e2m1"}, "kv_cache_dtype", "0.5.23's choices"),
        ({"reasoning_parser": "o1"}, "reasoning_parser", "must be one of"),
        ({"tool_call_parser": "qwen2.5"}, "tool_call_parser", "must be one of"),
        ({"hicache_size": 48}, "hicache_size", "enable_hierarchical_cache"),
        ({"tp_size": 0}, "tp_size", "at least 1"),
        ({"mem_fraction_static": 0.97}, "mem_fraction_static", "mem_fraction_bounds"),
        ({"mem_fraction_bounds": [0.9, 0.8]}, "mem_fraction_bounds", "low < high"),
        ({"api_key": "a", "api_key_env": "B"}, "api_key_env", "not both"),
        ({"api_key_env": "TOKENMILL_TEST_UNSET_KEY"}, "api_key_env", "is not set"),
        ({"sim": {"perturb": 0.1}}, "sim", "only for engine"),
        ({"env": {"A-B": "1"}}, "env.A-B", "environment variable name"),
        ({"model_path": ""}, "model_path", "required"),
    ],
)
def test_bad_config_is_refused_naming_the_key_and_the_file(
    tmp_path: Path, table: dict[str, Any], key: str, words: str
) -> None:
    path = write_config(tmp_path / "bad.toml", {"name": "gpu0", "port": 30000, "model_path": "m", **table})
    with pytest.raises(ConfigError) as info:
        load_config(path, env={})
    message = str(info.value)
    assert str(path) in message and f"key {key!r}" in message and words in message, message


def test_unknown_sim_knob_and_duplicate_names_are_refused(tmp_path: Path) -> None:
    path = write_config(
        tmp_path / "a.toml", {"name": "s", "engine": "sim", "port": 1, "sim": {"warp_speed": 9}}
    )
    with pytest.raises(ConfigError, match=r"key 'sim.warp_speed': unknown key"):
        load_config(path)
    path = write_config(
        tmp_path / "b.toml",
        {"name": "s", "engine": "sim", "port": 1},
        {"name": "s", "engine": "sim", "port": 2},
    )
    with pytest.raises(ConfigError, match=r"#2 \('s'\): key 'name'"):
        load_config(path)


def test_a_file_without_server_tables_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "empty.toml"
    path.write_text("[servers]\nname = 'x'\n")
    with pytest.raises(ConfigError, match="unknown top-level key 'servers'"):
        load_config(path)


def test_api_key_env_is_read_at_load_and_never_printed(tmp_path: Path) -> None:
    path = write_config(
        tmp_path / "a.toml", {"name": "a", "port": 1, "model_path": "m", "api_key_env": "MY_KEY"}
    )
    config = load_config(path, env={"MY_KEY": "s3cret"})[0]
    assert config.api_key == "s3cret"
    assert "s3cret" not in repr(config) and "s3cret" not in display_command(config)


@pytest.mark.parametrize("dtype", ["fp8_e4m3", "fp8_e5m2", "mxfp8", "nvfp4", "fp4_mx_block16"])
def test_lossy_kv_cache_is_refused_with_the_reason(tmp_path: Path, dtype: str) -> None:
    with pytest.raises(LossyKvCacheError) as info:
        one(tmp_path, name="a", port=1, model_path="m", kv_cache_dtype=dtype)
    assert "degrades output quality" in str(info.value)
    assert "allow_lossy_kv_cache = true" in str(info.value)


def test_lossy_kv_cache_is_accepted_when_allowed_explicitly(tmp_path: Path) -> None:
    config = one(
        tmp_path, name="a", port=1, model_path="m", kv_cache_dtype="fp8_e4m3", allow_lossy_kv_cache=True
    )
    assert launch_argv(config)[-2:] == ["--kv-cache-dtype", "fp8_e4m3"]


def test_server_help_works_without_importing_the_sim() -> None:
    script = (
        "import sys; from click.testing import CliRunner; from server_mgr.cli import server; "
        "out = CliRunner().invoke(server, ['--help']).output; "
        "assert 'server_mgr.sim' not in sys.modules; print(out)"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    for name in ("up", "status", "stop", "command", "check-quality", "sim"):
        assert f"  {name} " in result.stdout


def test_the_example_config_of_the_gpu_server_guide_is_valid(tmp_path: Path) -> None:
    guide = Path(__file__).resolve().parent.parent / "docs" / "gpu-server.md"
    example = re.search(r"```toml\n(.*?)```", guide.read_text(), re.S)
    assert example is not None
    path = tmp_path / "guide.toml"
    path.write_text(example[1])
    config = load_config(path, env={"SGLANG_API_KEY": "k"})[0]
    assert launch_argv(config)[:3] == ["/opt/sglang/bin/python", "-m", "sglang.launch_server"]
