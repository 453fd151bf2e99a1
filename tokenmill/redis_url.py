"""Redis URLs as tokenmill accepts them: redis-py's forms (``redis://``, ``rediss://``,
``unix://``) and Sentinel's, in the form Celery's broker takes:
``sentinel://[:PASSWORD@]HOST:26379[/DB]?master_name=NAME;sentinel://HOST2:26379;...``.

The sentinels are asked where the primary named ``master_name`` is; the password is the
primary's (the sentinels themselves are reached without one, as kombu does). Redis Cluster is
refused: Celery's Redis transport cannot use it (its queues are lists moved between keys in one
``MULTI``, which a cluster splits across nodes).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any
from urllib.parse import parse_qs, parse_qsl, quote, unquote, urlencode, urlsplit, urlunsplit

from tokenmill.errors import ConfigError
from tokenmill.url_secrets import redact_url

if TYPE_CHECKING:
    import ssl

SCHEMES = ("redis", "rediss", "unix", "sentinel")
# redis-py's URL options the worker's event-loop client (tokenmill/redis_async.py) honours; the
# moot ones concern a pool of connections or redis-py's own retries, and mean nothing (or what
# that client does anyway) for its one pipelined connection. Any other option is refused.
HONOURED = (
    "socket_timeout",
    "socket_connect_timeout",
    "socket_keepalive",
    "health_check_interval",
    "client_name",
)
SSL_OPTIONS = ("ssl_cert_reqs", "ssl_ca_certs", "ssl_certfile", "ssl_keyfile", "ssl_check_hostname")
MOOT = ("max_connections", "retry_on_timeout", "retry_on_error", "socket_read_size", "timeout", "protocol")
_FALSE = ("0", "F", "FALSE", "N", "NO")  # redis-py's to_bool
_CERT_REQS = ("none", "optional", "required")
# the options a Sentinel URL may carry, besides master_name (each client honours them), and the
# field of the primary's Endpoint each sets
SENTINEL_OPTIONS = {"socket_timeout": "socket_timeout_s", "socket_connect_timeout": "connect_timeout_s"}


@dataclass(frozen=True, slots=True)
class SentinelURL:
    """A parsed ``sentinel://`` URL: where the sentinels are, what to ask them for, and how to
    reach the primary they name (``primary``: its database, login and deadlines)."""

    hosts: tuple[tuple[str, int], ...]
    master_name: str
    primary: Endpoint


def is_sentinel(url: str) -> bool:
    return url.startswith("sentinel://")


def check(url: str, what: str = "TOKENMILL_REDIS_URL") -> None:
    """Raise a :class:`ConfigError` naming ``what`` if tokenmill cannot use ``url``."""
    scheme = urlsplit(url).scheme
    _refuse_cluster(scheme, what)
    if scheme not in SCHEMES:
        raise ConfigError(f"{what} must start with redis://, rediss://, unix:// or sentinel://")
    (parse_sentinel if scheme == "sentinel" else endpoint)(url, what)


def _refuse_cluster(scheme: str, what: str) -> None:
    if "cluster" in scheme:  # redis+cluster, rediss+cluster, cluster, redis-cluster, ...
        raise ConfigError(
            f"{what}: Redis Cluster ({scheme}://) is not supported: Celery's Redis transport cannot "
            "use a cluster (a queue's messages move between keys in one MULTI, which a cluster "
            "splits across nodes). Use one primary, with replicas and Sentinel for failover "
            "(sentinel://HOST:26379?master_name=NAME)"
        )


@dataclass(frozen=True, slots=True)
class Endpoint:
    """A parsed ``redis://``, ``rediss://`` or ``unix://`` URL, as redis-py reads it: what every
    hand-written client of tokenmill connects by (one parser, one TLS context)."""

    host: str = "localhost"
    port: int = 6379
    path: str | None = None  # a unix socket
    db: int = 0
    username: str | None = None
    password: str | None = field(default=None, repr=False)
    tls: dict[str, str] | None = None  # the ssl_* options of a rediss:// URL
    socket_timeout_s: float | None = 5.0
    connect_timeout_s: float = 5.0
    keepalive: bool = True
    health_check_s: float = 0.0
    client_name: str | None = None

    def tls_context(self) -> ssl.SSLContext | None:
        """The context redis-py builds for the URL's ``ssl_*`` options (None: no TLS)."""
        if self.tls is None:
            return None
        import ssl

        reqs = {"none": ssl.CERT_NONE, "optional": ssl.CERT_OPTIONAL, "required": ssl.CERT_REQUIRED}
        verify = reqs[self.tls.get("ssl_cert_reqs", "required").lower()]
        ctx = ssl.create_default_context(cafile=self.tls.get("ssl_ca_certs"))
        check = self.tls.get("ssl_check_hostname", "true").upper() not in _FALSE
        ctx.check_hostname = check and verify != ssl.CERT_NONE
        ctx.verify_mode = verify
        if self.tls.get("ssl_certfile"):
            ctx.load_cert_chain(self.tls["ssl_certfile"], self.tls.get("ssl_keyfile"))
        return ctx

    def hello(self, name: str | None = None) -> list[tuple[Any, ...]]:
        """What a new connection sends first, as redis-py does: AUTH, SELECT, CLIENT SETNAME
        (``name``, else the URL's ``client_name``)."""
        hello: list[tuple[Any, ...]] = []
        if self.password is not None:
            hello.append(("AUTH", self.username, self.password) if self.username else ("AUTH", self.password))
        if self.db:
            hello.append(("SELECT", self.db))
        if name or self.client_name:
            hello.append(("CLIENT", "SETNAME", name or self.client_name))
        return hello


def endpoint(url: str, what: str = "TOKENMILL_REDIS_URL") -> Endpoint:
    """``url`` parsed as redis-py parses it; a :class:`ConfigError` naming ``what`` and the option
    for anything tokenmill's clients cannot honour."""
    parts = urlsplit(url)
    _refuse_cluster(parts.scheme, what)
    if parts.scheme not in ("redis", "rediss", "unix"):
        raise ConfigError(f"{what} must start with redis://, rediss:// or unix:// here")
    query = {k: v[-1] for k, v in parse_qs(parts.query).items()}
    unknown = sorted(set(query) - {"db", "username", "password", *HONOURED, *MOOT, *SSL_OPTIONS})
    if unknown:
        raise ConfigError(
            f"{what}: the option(s) {', '.join(unknown)} are not supported (tokenmill honours "
            f"{', '.join(HONOURED)}, the ssl_* options {', '.join(SSL_OPTIONS)}, and accepts "
            f"{', '.join(MOOT)})"
        )
    tls = {k: v for k, v in query.items() if k in SSL_OPTIONS}
    if tls.get("ssl_cert_reqs", "required").lower() not in _CERT_REQS:
        raise ConfigError(f"{what}: ssl_cert_reqs must be one of {', '.join(_CERT_REQS)}")
    db = query.get("db") or (parts.path.strip("/") if parts.scheme != "unix" else "") or "0"
    try:
        numbers = {name: float(query[name]) for name in _NUMBERS if name in query}
        return Endpoint(
            host=unquote(parts.hostname or "localhost"),
            port=parts.port or 6379,
            path=unquote(parts.path) if parts.scheme == "unix" else None,
            db=int(db),
            username=unquote(parts.username) if parts.username else query.get("username"),
            password=unquote(parts.password) if parts.password is not None else query.get("password"),
            tls=tls if parts.scheme == "rediss" else None,
            socket_timeout_s=numbers.get("socket_timeout", 5.0),
            connect_timeout_s=numbers.get("socket_connect_timeout", 5.0),
            keepalive=query.get("socket_keepalive", "true").upper() not in _FALSE,
            health_check_s=numbers.get("health_check_interval", 0.0),
            client_name=query.get("client_name"),
        )
    except ValueError as exc:
        raise ConfigError(f"{what}: {exc}") from None


_NUMBERS = ("socket_timeout", "socket_connect_timeout", "health_check_interval")


def parse_sentinel(url: str, what: str = "TOKENMILL_REDIS_URL") -> SentinelURL:
    """The sentinels, master name, database and password of a ``sentinel://`` URL (hosts
    separated by ``;``, each in URL form; options may sit on any of them)."""
    hosts: list[tuple[str, int]] = []
    options: dict[str, Any] = {}
    master_name = username = password = None
    db = 0
    for part in (p.strip() for p in url.split(";")):
        if not part:
            continue
        parts = urlsplit(part)
        if parts.scheme != "sentinel" or not parts.hostname:
            raise ConfigError(f"{what}: {redact_url(part)!r} is not a sentinel://HOST:PORT address")
        hosts.append((parts.hostname, parts.port or 26379))
        username = username or (unquote(parts.username) if parts.username else None)
        password = password or (unquote(parts.password) if parts.password else None)
        if parts.path.strip("/"):
            try:
                db = int(parts.path.strip("/"))
            except ValueError:
                raise ConfigError(f"{what}: the database in {parts.path!r} is not a number") from None
        for name, values in parse_qs(parts.query).items():
            if name == "master_name":
                master_name = values[-1]
            elif name in SENTINEL_OPTIONS:
                try:
                    options[SENTINEL_OPTIONS[name]] = float(values[-1])
                except ValueError:
                    raise ConfigError(f"{what}: {name}={values[-1]!r} is not a number") from None
            else:
                known = ", ".join(["master_name", *SENTINEL_OPTIONS])
                raise ConfigError(f"{what}: the option {name!r} is not supported in a Sentinel URL ({known})")
    if not master_name:
        raise ConfigError(f"{what}: a Sentinel URL needs ?master_name=NAME (the primary's name in Sentinel)")
    primary = Endpoint(db=db, username=username, password=password, **options)
    return SentinelURL(tuple(hosts), master_name, primary)


def broker_url(url: str) -> str:
    """The URL Celery's broker is given: a Sentinel URL without its options (kombu reads
    ``master_name`` from the transport options, :func:`broker_transport_options`); a
    ``?username=``/``?password=`` (redis-py's options) moved into the userinfo, the one place
    kombu reads them from (an option of the same name fails its URL parser with a TypeError)."""
    if not is_sentinel(url):
        return _login_in_userinfo(url)
    return ";".join(p.strip().split("?", 1)[0] for p in url.split(";") if p.strip())


def _login_in_userinfo(url: str) -> str:
    parts = urlsplit(url)
    query = parse_qsl(parts.query, keep_blank_values=True)
    login = {k: v for k, v in query if k in ("username", "password")}
    if not login:
        return url
    user = quote(login.get("username") or unquote(parts.username or ""), safe="")
    password = quote(login.get("password") or unquote(parts.password or ""), safe="")
    rest = urlencode([(k, v) for k, v in query if k not in login])
    return urlunsplit(
        parts._replace(netloc=f"{user}:{password}@{parts.netloc.rpartition('@')[2]}", query=rest)
    )


def broker_transport_options(url: str) -> dict[str, Any]:
    """What kombu's Sentinel transport needs besides the URL (nothing for a plain Redis URL)."""
    if not is_sentinel(url):
        return {}
    s = parse_sentinel(url)
    return {"master_name": s.master_name, "sentinel_kwargs": {"socket_timeout": s.primary.socket_timeout_s}}
