"""The ``tokenmill dashboard`` command: serve a run's live page, on loopback unless told otherwise.

Credentials come from ``TOKENMILL_DASHBOARD_BASIC_AUTH=user:password[,...]`` (as ``tokenmill
flower`` takes its own), so they never appear on a command line; binding beyond loopback
without them is refused. It answers only requests whose ``Host`` names loopback, the bound
address or a name of ``TOKENMILL_DASHBOARD_ALLOWED_HOSTS``.
"""

from __future__ import annotations

import click

from producer import web_access
from tokenmill.url_secrets import redact_url

DEFAULT_PORT = 9650
AUTH_ENVVAR = "TOKENMILL_DASHBOARD_BASIC_AUTH"


@click.command()
@web_access.bind_options(DEFAULT_PORT, AUTH_ENVVAR)
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
    from producer.client import Client
    from producer.dashboard.server import HOSTS_SETTING, make_app
    from tokenmill.settings import Settings

    credentials = web_access.parse_basic_auth(basic_auth, f"--basic-auth or {AUTH_ENVVAR}")
    web_access.check_exposure(address, credentials, "the dashboard", f"{AUTH_ENVVAR}=user:password")
    settings = Settings.load(redis_url=redis_url)
    hosts = web_access.allowed_hosts(address, settings.dashboard_allowed_hosts, HOSTS_SETTING)
    client = Client(redis_url=settings.redis_url)
    auth = "basic auth" if credentials else "no auth: loopback only"
    about = f"{auth}; redis {redact_url(settings.redis_url)}"
    try:
        web_access.serve(make_app(client, credentials, hosts), address, port, "dashboard", "/", about)
    finally:
        client.close()
