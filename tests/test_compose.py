"""compose.yaml read as a specification: every command exists in the real CLI, Redis is durable
and password-protected, the server gets a GPU, and nothing is published beyond the host's loopback.

Docker is not needed: the file is parsed with PyYAML, ``${VAR:-default}`` is interpolated the way
compose does, and each ``tokenmill ...`` command is resolved and parsed through click. The stack
itself is built and run in Docker by tests/compose (``make test-compose``).
"""

from __future__ import annotations

import re
import tomllib
from pathlib import Path
from typing import Any

import click
import pytest
import yaml
from click.testing import CliRunner

from producer.web_access import is_loopback
from server_mgr.config import load_config
from tokenmill.cli import cli
from tokenmill.settings import Settings

ROOT = Path(__file__).resolve().parent.parent
COMPOSE = ROOT / "compose.yaml"
DOCKERFILE = ROOT / "docker" / "Dockerfile"
SERVER_TOML = ROOT / "docker" / "server.toml"
SIM_OVERRIDE = ROOT / "docker" / "compose.sim.yaml"
SIM_TOML = ROOT / "docker" / "server.sim.toml"
REDIS_OVERRIDE = ROOT / "docker" / "compose.redis-debian.yaml"
ENV = {
    "REDIS_PASSWORD": "s3cret",
    "FLOWER_BASIC_AUTH": "admin:pw",
    "API_KEYS": "k1,k2",
    "GRAFANA_ADMIN_PASSWORD": "gr4f",
    "HF_TOKEN": "hf_x",
}
REDIS_DOCKERFILE = ROOT / "docker" / "redis.Dockerfile"
# a variable or setting that holds a secret, by the words of its name
SECRET = re.compile(r"(^|_)(PASSWORD|SECRET|TOKEN|BASIC_AUTH|API_KEYS?)(_|$)")
_VAR = re.compile(r"\$\$|\$\{([A-Za-z_][A-Za-z0-9_]*)(?:(:?[-?])([^}]*))?\}")


def interpolate(value: Any, env: dict[str, str]) -> Any:
    """Compose's variable interpolation: ``${V}``, ``${V:-d}``, ``${V-d}``, ``${V:?e}``, ``$$``."""
    if isinstance(value, dict):
        return {k: interpolate(v, env) for k, v in value.items()}
    if isinstance(value, list):
        return [interpolate(v, env) for v in value]
    if not isinstance(value, str):
        return value

    def sub(m: re.Match[str]) -> str:
        if m.group(0) == "$$":
            return "$"
        name, op, arg = m.group(1), m.group(2), m.group(3)
        current = env.get(name)
        unset = current is None or (op is not None and op.startswith(":") and current == "")
        if op and op.endswith("?") and unset:
            raise AssertionError(f"compose would refuse to start: {name}: {arg}")
        if op and op.endswith("-") and unset:
            return arg
        return current or ""

    return _VAR.sub(sub, value)


class ComposeLoader(yaml.SafeLoader):
    """YAML with compose's merge tags: ``!reset`` and ``!override`` (read as tagged values)."""


for _tag in ("!reset", "!override"):
    ComposeLoader.add_constructor(
        _tag,
        lambda loader, node, tag=_tag: (
            tag,
            loader.construct_sequence(node)
            if isinstance(node, yaml.SequenceNode)
            else loader.construct_mapping(node)
            if isinstance(node, yaml.MappingNode)
            else loader.construct_scalar(node),
        ),
    )


def load(path: Path) -> dict[str, Any]:
    data: dict[str, Any] = yaml.load(path.read_text(), Loader=ComposeLoader)
    return data


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    return load(COMPOSE)


@pytest.fixture(scope="module")
def services(compose: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Every service, interpolated with the variables a filled-in ``.env`` gives."""
    resolved: dict[str, dict[str, Any]] = interpolate(compose["services"], ENV)
    return resolved


def tokenmill_commands(services: dict[str, dict[str, Any]]) -> dict[str, list[str]]:
    return {
        name: svc["command"][1:]
        for name, svc in services.items()
        if isinstance(svc.get("command"), list) and svc["command"][:1] == ["tokenmill"]
    }


def parse(argv: list[str], stand_in: Path | None = None) -> click.Context:
    """Resolve ``argv`` through the CLI's groups and parse the leaf's arguments strictly (no run).

    With ``stand_in``, options that must name an existing file get that file instead (the
    container's paths do not exist here).
    """
    ctx = click.Context(cli, info_name="tokenmill")
    cmd: click.Command = cli
    name, rest, parent = "tokenmill", list(argv), ctx
    while isinstance(cmd, click.Group):
        assert rest, f"`tokenmill {' '.join(argv)}` stops at a group"
        name, *rest = rest
        sub = cmd.get_command(ctx, name)
        assert sub is not None, f"`tokenmill {' '.join(argv)}`: no such command {name!r}"
        parent, ctx, cmd = ctx, click.Context(sub, info_name=name, parent=ctx), sub
    if stand_in is not None:
        rest = with_existing_paths(cmd, rest, stand_in)
    return cmd.make_context(name, rest, parent=parent)


def with_existing_paths(cmd: click.Command, args: list[str], stand_in: Path) -> list[str]:
    """``args`` with the values of options that must name an existing file replaced by one that does."""
    must_exist = {
        opt
        for p in cmd.params
        if isinstance(p, click.Option) and isinstance(p.type, click.Path) and p.type.exists
        for opt in p.opts
    }
    out = list(args)
    for i, token in enumerate(out[:-1]):
        if token in must_exist:
            out[i + 1] = str(stand_in)
    return out


def test_every_service_runs_a_real_tokenmill_command_with_valid_options(
    services: dict[str, dict[str, Any]], tmp_path: Path
) -> None:
    commands = tokenmill_commands(services)
    assert set(commands) >= {"server", "worker-short", "worker-long", "flower", "metrics", "api", "producer"}
    stand_in = tmp_path / "stand-in.toml"
    stand_in.write_text("")
    runner = CliRunner()
    for service, argv in commands.items():
        # unknown subcommands and options fail here, as they would at `docker compose up`
        res = runner.invoke(cli, [*argv, "--help"])
        assert res.exit_code == 0, f"{service}: `tokenmill {' '.join(argv)}`:\n{res.output}"
        # and every value parses (choices, ranges) without running anything
        try:
            parse(argv, stand_in)
        except click.ClickException as exc:
            pytest.fail(f"{service}: `tokenmill {' '.join(argv)}`: {exc.format_message()}")


def test_a_misspelt_command_or_option_would_be_caught(tmp_path: Path) -> None:
    runner = CliRunner()
    assert runner.invoke(cli, ["worker", "--queue", "short", "--concurency", "4", "--help"]).exit_code != 0
    assert runner.invoke(cli, ["server", "upp", "--help"]).exit_code != 0
    with pytest.raises(click.BadParameter):
        parse(["worker", "--queue", "medium"])
    with pytest.raises(click.BadParameter):
        parse(["worker", "--queue", "short", "--concurrency", "lots"])


def test_redis_is_durable_never_evicts_and_requires_a_password(services: dict[str, dict[str, Any]]) -> None:
    redis = services["redis"]
    assert redis["image"].startswith("redis:7")
    command = " ".join(redis["command"])
    assert "--appendonly yes" in command and "--appendfsync everysec" in command
    assert "--maxmemory-policy noeviction" in command
    assert "requirepass" in command and "$REDIS_PASSWORD" in command
    assert redis["environment"]["REDIS_PASSWORD"] == ENV["REDIS_PASSWORD"]
    assert any(v.endswith(":/data") for v in redis["volumes"]), "the AOF must live on a volume"
    # without a password, compose refuses to start rather than run an open Redis
    with pytest.raises(AssertionError, match="REDIS_PASSWORD"):
        interpolate(yaml.safe_load(COMPOSE.read_text())["services"]["redis"], {})


def test_every_tokenmill_service_is_wired_to_redis_and_the_server_by_environment(
    services: dict[str, dict[str, Any]],
) -> None:
    for name in tokenmill_commands(services):
        env = services[name]["environment"]
        assert env["TOKENMILL_REDIS_URL"] == f"redis://:{ENV['REDIS_PASSWORD']}@redis:6379/0", name
        assert env["TOKENMILL_SERVER_URL"] == "http://server:30000", name
        settings = Settings.load(env=env)  # the URLs are valid settings
        assert settings.server_urls == ("http://server:30000",)


def test_the_server_reserves_gpus_and_runs_the_server_manager_on_a_valid_config(
    services: dict[str, dict[str, Any]],
) -> None:
    server = services["server"]
    devices = server["deploy"]["resources"]["reservations"]["devices"]
    assert any(d["driver"] == "nvidia" and "gpu" in d["capabilities"] for d in devices)
    assert server["command"][:3] == ["tokenmill", "server", "up"]
    assert (
        server["build"]["target"] == "server" and "lmsysorg/sglang" in server["build"]["args"]["SGLANG_IMAGE"]
    )
    mount = next(v for v in server["volumes"] if v.split(":")[1] == "/etc/tokenmill/server.toml")
    assert (ROOT / mount.split(":")[0]).resolve() == SERVER_TOML
    (config,) = load_config(SERVER_TOML, env={})
    assert config.engine == "sglang" and config.port == 30000 and config.host == "0.0.0.0"
    assert config.public_url == server["environment"]["TOKENMILL_SERVER_URL"]
    assert config.model_name == server["environment"]["TOKENMILL_MODEL"]


def test_images_are_built_from_targets_the_dockerfile_defines(services: dict[str, dict[str, Any]]) -> None:
    text = DOCKERFILE.read_text()
    # every package setuptools installs is copied into both images
    copied = {
        src for line in re.findall(r"^COPY (?!--)(.+)$", text, re.MULTILINE) for src in line.split()[:-1]
    }
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    packages = {p.rstrip("*") for p in project["tool"]["setuptools"]["packages"]["find"]["include"]}
    assert copied >= {"pyproject.toml", project["project"]["readme"], *packages}
    assert all((ROOT / src).exists() for src in copied), copied
    targets = set(re.findall(r"^FROM\s+\S+\s+AS\s+(\S+)", text, re.MULTILINE | re.IGNORECASE))
    for name, svc in services.items():
        if "build" in svc:
            assert svc["build"]["dockerfile"] == "docker/Dockerfile", name
            assert svc["build"]["target"] in targets, name


def test_ports_are_published_on_loopback_only_and_flower_and_the_api_beyond_it_need_auth(
    services: dict[str, dict[str, Any]],
) -> None:
    for name, svc in services.items():
        for port in svc.get("ports", []):
            spec = port if isinstance(port, str) else f"{port.get('host_ip', '')}:{port.get('published')}"
            assert spec.startswith("127.0.0.1:"), f"{name} publishes {spec!r} beyond the host's loopback"
    flower = services["flower"]
    address = flower["command"][flower["command"].index("--address") + 1]
    assert not is_loopback(address)  # it must listen on the container's network...
    assert flower["environment"]["TOKENMILL_FLOWER_BASIC_AUTH"] == ENV["FLOWER_BASIC_AUTH"]  # ...with auth
    api = services["api"]
    assert not is_loopback(api["command"][api["command"].index("--address") + 1])
    assert Settings.load(env=api["environment"]).api_keys == ENV["API_KEYS"]
    # without keys compose refuses to start rather than run the API beyond loopback without them
    with pytest.raises(AssertionError, match="API_KEYS"):
        interpolate(yaml.safe_load(COMPOSE.read_text())["services"]["api"], {**ENV, "API_KEYS": ""})


def test_workers_scale_and_the_producer_is_a_one_shot_profile(services: dict[str, dict[str, Any]]) -> None:
    for name in ("worker-short", "worker-long"):
        svc = services[name]
        assert "container_name" not in svc and not svc.get("ports"), f"{name} could not be --scale'd"
    assert services["worker-short"]["command"][1:5] == ["worker", "--queue", "short", "--concurrency"]
    assert services["worker-long"]["command"][1:4] == ["worker", "--queue", "long"]
    producer = services["producer"]
    assert producer["profiles"] == ["producer"] and producer["restart"] == "no"


def test_the_public_defaults_build_from_public_images_and_the_package_index(
    services: dict[str, dict[str, Any]],
) -> None:
    for name, svc in services.items():
        if "build" in svc:
            args = svc["build"]["args"]
            assert args["PYTHON_IMAGE"] == "python:3.11-slim", name
            assert args["INSTALL_FROM"] == "index", name
    assert services["redis"]["image"] == "redis:7.4"
    text = DOCKERFILE.read_text()
    assert "ARG PYTHON_IMAGE=python:3.11-slim" in text and "FROM ${PYTHON_IMAGE} AS tokenmill" in text
    # a `# syntax=` directive would make every build fetch a frontend image from Docker Hub
    assert not re.search(r"^#\s*syntax\s*=", text, re.MULTILINE | re.IGNORECASE)


def test_air_gapped_builds_take_every_base_image_and_package_from_the_site(
    compose: dict[str, Any],
) -> None:
    site = "registry.internal"
    env = {**ENV, "PYTHON_IMAGE": f"{site}/python:3.11-slim", "INSTALL_FROM": "wheelhouse",
           "REDIS_IMAGE": f"{site}/redis:7.4", "SGLANG_IMAGE": f"{site}/sglang:v1"}  # fmt: skip
    services = interpolate(compose["services"], env)
    for name, svc in services.items():
        if "build" in svc:
            assert svc["build"]["args"]["PYTHON_IMAGE"] == env["PYTHON_IMAGE"], name
            assert svc["build"]["args"]["INSTALL_FROM"] == "wheelhouse", name
    assert services["server"]["build"]["args"]["SGLANG_IMAGE"] == env["SGLANG_IMAGE"]
    assert services["redis"]["image"] == env["REDIS_IMAGE"]
    text = DOCKERFILE.read_text()
    assert "--no-index --find-links /wheelhouse" in text
    assert "source=docker/wheelhouse" in text and (ROOT / "docker" / "wheelhouse").is_dir()


def test_processes_run_under_an_init_and_volumes_are_mounted_where_the_image_owns_the_folder(
    services: dict[str, dict[str, Any]],
) -> None:
    text = DOCKERFILE.read_text()
    tokenmill_stage = text.split("AS tokenmill", 1)[1].split("\nFROM ", 1)[0]
    assert "USER tokenmill" in tokenmill_stage
    owned = set(
        re.findall(r"(/[\w/]+)", tokenmill_stage.split("chown tokenmill:tokenmill", 1)[1].split("\n")[0])
    )
    for name, svc in services.items():
        if name != "redis":
            assert svc.get("init") is True, f"{name}: no init, compose's SIGTERM would meet PID 1"
        if svc.get("image") != "tokenmill:local":
            continue
        for volume in svc.get("volumes", []):
            source, target = volume.split(":")[:2]
            if not source.startswith((".", "/", "~")) and not target.endswith(":ro"):
                assert target in owned, f"{name}: volume {source} on {target}, which the image does not own"
    assert services["redis"]["user"] == "redis"


def test_the_sim_override_changes_only_the_server_and_keeps_its_address(compose: dict[str, Any]) -> None:
    override = load(SIM_OVERRIDE)
    assert set(override["services"]) == {"server"}
    server = override["services"]["server"]
    assert server["image"] == compose["x-tokenmill"]["image"] and server["build"] == {"target": "tokenmill"}
    assert server["deploy"][0] == "!reset"  # no GPU reservation
    tag, volumes = server["volumes"]
    assert tag == "!override"
    mount = next(v for v in volumes if v.split(":")[1] == "/etc/tokenmill/server.toml")
    assert (ROOT / mount.split(":")[0]).resolve() == SIM_TOML
    (sim,) = load_config(SIM_TOML, env={})
    (gpu,) = load_config(SERVER_TOML, env={})
    assert sim.engine == "sim"
    assert (sim.host, sim.port, sim.public_url, sim.model_name, sim.log_dir) == (
        gpu.host, gpu.port, gpu.public_url, gpu.model_name, gpu.log_dir)  # fmt: skip


def test_the_debian_redis_override_builds_debians_redis_server_with_the_official_images_contract() -> None:
    redis = load(REDIS_OVERRIDE)["services"]["redis"]
    assert set(load(REDIS_OVERRIDE)["services"]) == {"redis"}
    dockerfile = ROOT / redis["build"]["dockerfile"]
    text = dockerfile.read_text()
    assert redis["build"]["context"] == "." and "BASE_IMAGE" in redis["build"]["args"]
    assert "apt-get install" in text and "redis-server" in text
    assert "chown redis:redis /data" in text and "USER redis" in text


def test_the_build_context_leaves_out_the_virtualenv_git_and_secrets() -> None:
    ignored = (ROOT / ".dockerignore").read_text().split()
    assert {"**/.venv", "**/.git", ".env"} <= set(ignored)
    assert not any(p.startswith("docker") for p in ignored), "the wheelhouse must reach the build"


def image_refs(compose: dict[str, Any]) -> dict[str, str]:
    """Every image the stack pulls, by where it is named: a service's ``image`` (unless compose
    builds it), a build argument ``*_IMAGE``, the Dockerfiles' ``ARG *_IMAGE`` defaults and
    literal ``FROM`` lines; with the defaults a filled-in ``.env`` leaves."""
    refs: dict[str, str] = {}
    for path in (COMPOSE, SIM_OVERRIDE, REDIS_OVERRIDE):
        for name, svc in interpolate(load(path)["services"], ENV).items():
            if svc.get("image") and "build" not in svc:
                refs[f"{path.name}: {name}.image"] = svc["image"]
            for arg, value in (svc.get("build") or {}).get("args", {}).items():
                if arg.endswith("IMAGE"):
                    refs[f"{path.name}: {name}.build.args.{arg}"] = value
    for path in (DOCKERFILE, REDIS_DOCKERFILE):
        text = path.read_text()
        for arg, value in re.findall(r"^ARG (\w*IMAGE)=(\S+)", text, re.MULTILINE):
            refs[f"{path.name}: ARG {arg}"] = value
        for value in re.findall(r"^FROM (?!\$)(\S+)", text, re.MULTILINE):
            refs[f"{path.name}: FROM {value}"] = value
    return refs


def is_pinned(ref: str) -> bool:
    """Whether an image reference names a digest, or a tag that is not ``latest`` (nor a variant
    of it, such as ``latest-runtime``); ``registry:5000/name`` has no tag."""
    repository, _, tag = ref.rpartition(":")
    return "@sha256:" in ref or (bool(repository) and "/" not in tag and not tag.startswith("latest"))


def test_no_secret_has_a_default_and_grafana_needs_its_password_from_env(compose: dict[str, Any]) -> None:
    # Every variable of .env that holds a secret is required, or empty unless given (an empty one
    # is refused by what reads it: the dashboard's basic auth beyond loopback)...
    for var, op, default in _VAR.findall(COMPOSE.read_text()):
        assert not (SECRET.search(var) and op.endswith("-") and default), (
            f"${{{var}}} defaults to {default!r}"
        )
    # ...and every secret a service is given is such a variable, never a value written in the file
    services = compose["services"]
    for name, svc in services.items():
        for key, value in (svc.get("environment") or {}).items():
            if SECRET.search(key):
                assert re.fullmatch(r"\$\{[^}]+\}", str(value)), f"{name}: {key} is {value!r}, not from .env"
    # and Grafana's admin password in particular is required: without it compose refuses to start
    grafana = services["grafana"]["environment"]
    assert interpolate(grafana, ENV)["GF_SECURITY_ADMIN_PASSWORD"] == ENV["GRAFANA_ADMIN_PASSWORD"]
    with pytest.raises(
        AssertionError, match=re.escape("GRAFANA_ADMIN_PASSWORD: set GRAFANA_ADMIN_PASSWORD in .env")
    ):
        interpolate(grafana, {})


def test_every_image_is_pinned_to_a_version_and_sglang_to_the_tested_release(compose: dict[str, Any]) -> None:
    refs = image_refs(compose)
    assert len(refs) >= 8, refs  # redis, prometheus, grafana, the base images of both Dockerfiles
    for where, ref in refs.items():
        assert is_pinned(ref), f"{where}: {ref!r} is not pinned to a version"
    sglang = {ref for where, ref in refs.items() if "SGLANG_IMAGE" in where}
    assert sglang == {"lmsysorg/sglang:v0.5.23"}, sglang
