"""The ``tokenmill api`` command: OpenAI's Batch API (``/v1/files``, ``/v1/batches``,
``/v1/models``) over tokenmill, on loopback unless told otherwise.

Keys come from ``TOKENMILL_API_KEYS=k1,k2`` (never a flag, so they never appear on a command
line): when set, every request needs one as a bearer token, loopback included; binding beyond
loopback without them is refused. Files live in the result store (``TOKENMILL_RESULTS_URL``).
"""

from __future__ import annotations

import click

from producer import web_access
from tokenmill.errors import ConfigError
from tokenmill.url_secrets import redact_url

DEFAULT_PORT = 8090


@click.command()
@click.option("--port", type=click.IntRange(1, 65535), default=DEFAULT_PORT, show_default=True)
@click.option(
    "--address",
    default="127.0.0.1",
    show_default=True,
    help="Address to bind; anything beyond loopback requires TOKENMILL_API_KEYS.",
)
@click.option("--redis-url", envvar="TOKENMILL_REDIS_URL", default=None, help="Redis URL (the ledger).")
def api(port: int, address: str, redis_url: str | None) -> None:
    """Serve OpenAI's Batch API (files, batches, models): a batch is a tokenmill run."""
    import logging

    from aiohttp import web

    from producer.api.files import Files
    from producer.api.server import HOSTS_SETTING, make_app
    from producer.result_store import ResultStore
    from tokenmill import redis_conn
    from tokenmill.settings import Settings

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    settings = Settings.load(redis_url=redis_url)
    keys_ = [k.strip() for k in settings.api_keys.split(",") if k.strip()]
    web_access.check_exposure(address, keys_, "the API", "TOKENMILL_API_KEYS=key1,key2")
    hosts = web_access.allowed_hosts(address, settings.api_allowed_hosts, HOSTS_SETTING)
    client = redis_conn.connect(settings, name="tokenmill-api")
    redis_conn.warn_durability(client, echo=lambda m: click.echo(m, err=True))
    store = ResultStore(settings.results_location)
    shown = f"[{address}]" if ":" in address else address
    auth = f"{len(keys_)} bearer keys" if keys_ else "no key: loopback only"
    click.echo(
        f"tokenmill api on http://{shown}:{port}/v1 ({auth}; redis {redact_url(settings.redis_url)}; "
        f"files in {store.shown})",
        err=True,
    )
    app = make_app(client, settings, Files(client, store), keys_, hosts)
    try:
        web.run_app(app, host=address, port=port, print=None, access_log=None)
    except OSError as exc:
        why = exc.strerror or exc
        raise ConfigError(f"--port {port}: cannot listen on {address}:{port} ({why})") from None
    finally:
        client.close()
