"""The ``tokenmill api`` command: OpenAI's Batch API (``/v1/files``, ``/v1/batches``,
``/v1/models``) over tokenmill, on loopback unless told otherwise.

Keys come from ``TOKENMILL_API_KEYS=k1,k2`` (never a flag, so they never appear on a command
line): when set, every request needs one as a bearer token, loopback included; binding beyond
loopback without them is refused. Files live in the result store (``TOKENMILL_RESULTS_URL``).
"""

from __future__ import annotations

import click

from producer import web_access
from tokenmill.url_secrets import redact_url

DEFAULT_PORT = 8090


@click.command()
@web_access.bind_options(DEFAULT_PORT, "TOKENMILL_API_KEYS")
@click.option("--redis-url", envvar="TOKENMILL_REDIS_URL", default=None, help="Redis URL (the ledger).")
def api(port: int, address: str, redis_url: str | None) -> None:
    """Serve OpenAI's Batch API (files, batches, models): a batch is a tokenmill run."""
    import logging

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
    auth = f"{len(keys_)} bearer keys" if keys_ else "no key: loopback only"
    about = f"{auth}; redis {redact_url(settings.redis_url)}; files in {store.shown}"
    app = make_app(client, settings, Files(client, store), keys_, hosts)
    try:
        web_access.serve(app, address, port, "api", "/v1", about)
    finally:
        client.close()
