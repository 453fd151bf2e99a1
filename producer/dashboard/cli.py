"""The ``tokenmill dashboard`` command: serve a run's live page, on loopback unless told otherwise.

Credentials come from ``TOKENMILL_DASHBOARD_BASIC_AUTH=user:password[,...]`` (as ``tokenmill
flower`` takes its own), so they never appear on a command line; binding beyond loopback
without them is refused. It answers only requests whose ``Host`` names loopback, the bound
address or a name of ``TOKENMILL_DASHBOARD_ALLOWED_HOSTS``.
"""

from __future__ import annotations

import click

from producer import web_access
from tokenmill.errors import ConfigError
from tokenmill.url_secrets import redact_url

DEFAULT_PORT = 9650
AUTH_ENVVAR = "TOKENMILL_DASHBOARD_BASIC_AUTH"


@click.command()
@click.option("--port", type=click.IntRange(1, 65535), default=DEFAULT_PORT, show_default=True)
@click.option(
    "--address",
    default="127.0.0.1",
    show_default=True,
    help=f"Address to bind; anything beyond loopback requires {AUTH_ENVVAR}.",
)
@click.option(
    "--basic-auth",
    envvar=AUTH_ENVVAR,
    show_envvar=True,
    default=None,
    metavar="USER:PASSWORD[,...]",
    help="HTTP basic auth for the page and its API (prefer the environment variable to the flag).",
)
@click.option("--redis-url", envvar="TOKENMILL_REDIS_URL", default=None, help="Redis URL (the ledger).")
def dashboard(port: int, address: str, basic_auth: str | None, redis_url: str | None) -> None:
    """Serve a live page of a run: progress, throughput, servers, failures, outputs, samples."""
    from aiohttp import web

    from producer.client import Client
    from producer.dashboard.server import HOSTS_SETTING, make_app
    from tokenmill.settings import Settings

    credentials = web_access.parse_basic_auth(basic_auth, f"--basic-auth or {AUTH_ENVVAR}")
    web_access.check_exposure(address, credentials, "the dashboard", f"{AUTH_ENVVAR}=user:password")
    settings = Settings.load(redis_url=redis_url)
    hosts = web_access.allowed_hosts(address, settings.dashboard_allowed_hosts, HOSTS_SETTING)
    client = Client(redis_url=settings.redis_url)
    shown = f"[{address}]" if ":" in address else address
    auth = "basic auth" if credentials else "no auth: loopback only"
    click.echo(
        f"tokenmill dashboard on http://{shown}:{port}/ ({auth}; redis {redact_url(settings.redis_url)})",
        err=True,
    )
    try:
        web.run_app(
            make_app(client, credentials, hosts), host=address, port=port, print=None, access_log=None
        )
    except OSError as exc:
        why = exc.strerror or exc
        raise ConfigError(f"--port {port}: cannot listen on {address}:{port} ({why})") from None
    finally:
        client.close()
