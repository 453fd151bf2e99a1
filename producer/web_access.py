"""Who may reach a web UI tokenmill serves (Flower, the dashboard, the API): loopback by default,
and beyond it only behind HTTP basic auth (the API: bearer keys); which ``Host`` names the
dashboard and the API answer to, so that a web page cannot read them through a name of its own
rebound to this host (DNS rebinding); and how the dashboard and the API are served.

Credentials come as ``user:password[,user2:password2]`` (from an environment variable, so they
never appear on a command line); an entry that is not well formed is refused naming its
position, never its secret.
"""

from __future__ import annotations

import base64
import binascii
import hmac
import ipaddress
import re
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

import click

from tokenmill.errors import ConfigError

if TYPE_CHECKING:
    from aiohttp import web

Command = TypeVar("Command", bound=Callable[..., Any])
LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "::1")
_HOST_HEADER = re.compile(r"(?:\[(?P<v6>[^\]]+)\]|(?P<name>[^:\[\]]+))(?::[0-9]*)?")
_HOST_NAME = re.compile(r"[a-z0-9_]([a-z0-9_-]*[a-z0-9_])?(\.[a-z0-9_]([a-z0-9_-]*[a-z0-9_])?)*")


def bind_options(port: int, needs: str) -> Callable[[Command], Command]:
    """A command's ``--port`` (``port`` by default) and ``--address`` (loopback by default;
    beyond it ``needs`` is required)."""
    port_option = click.option("--port", type=click.IntRange(1, 65535), default=port, show_default=True)
    address_option = click.option(
        "--address",
        default="127.0.0.1",
        show_default=True,
        help=f"Address to bind; anything beyond loopback requires {needs}.",
    )
    return lambda command: port_option(address_option(command))


def is_loopback(address: str) -> bool:
    """Whether ``address`` only accepts connections from this host (``""`` means every interface)."""
    if address == "localhost":
        return True
    try:
        return ipaddress.ip_address(address.strip("[]")).is_loopback
    except ValueError:
        return False  # a hostname other than localhost may resolve anywhere


def parse_basic_auth(value: str | None, source: str) -> list[str]:
    """``user:password[,user2:password2]`` as a list of entries; raises naming the entry and
    ``source`` (where the value came from), not the secret."""
    if not value:
        return []
    entries = [e.strip() for e in value.split(",") if e.strip()]
    for i, entry in enumerate(entries, 1):
        user, sep, password = entry.partition(":")
        if not (user and sep and password):
            # name the user only when there is a colon: without one the entry may be a bare password
            who = f" (user {user!r})" if sep and user else ""
            raise ConfigError(
                f"basic auth entry {i}{who} must be user:password with both non-empty ({source})"
            )
    return entries


def check_exposure(address: str, credentials: list[str], service: str, how: str) -> None:
    """Refuse to serve ``service`` beyond loopback without authentication; ``how`` says how to
    give credentials."""
    if not credentials and not is_loopback(address):
        shown = address or "every interface"
        raise ConfigError(
            f"refusing to bind {service} to {shown} without authentication: set {how}, or bind to 127.0.0.1"
        )


def authorized(header: str | None, credentials: list[str], scheme: str = "basic") -> bool:
    """Whether an ``Authorization`` header carries one of ``credentials`` (``basic`` auth, or
    ``bearer`` keys; compared in constant time). With no credentials configured, every request is."""
    if not credentials:
        return True
    given, _, token = (header or "").partition(" ")
    if given.lower() != scheme or not token:
        return False
    secret = token.strip().encode()
    if scheme == "basic":
        try:
            secret = base64.b64decode(secret, validate=True)
        except (binascii.Error, ValueError):
            return False
    # every entry is compared, so the time taken does not tell which one came close
    return sum(hmac.compare_digest(secret, entry.encode()) for entry in credentials) > 0


def allowed_hosts(address: str, extra: str, source: str) -> frozenset[str]:
    """The names a server bound to ``address`` answers to in a request's ``Host``: loopback's,
    ``address`` itself unless it means every interface, and ``extra`` (host names or IP
    addresses, comma-separated, from ``source``); an entry that is neither is refused naming it."""
    names = set(LOOPBACK_HOSTS)
    if (bound := host_name(address)) not in ("", "0.0.0.0", "::"):
        names.add(bound)
    for entry in filter(None, (e.strip() for e in extra.split(","))):
        if not (name := host_name(entry)):
            raise ConfigError(
                f"{source}: {entry!r} is not a host name or an IP address "
                "(give it without scheme, port or path)"
            )
        names.add(name)
    return frozenset(names)


def host_allowed(header: str | None, allowed: frozenset[str]) -> bool:
    """Whether a ``Host`` header (``name``, ``name:port``, ``[v6]`` or ``[v6]:port``) names one of
    ``allowed``, whatever the port; a missing or malformed one does not."""
    match = _HOST_HEADER.fullmatch((header or "").strip())
    return match is not None and host_name(match["v6"] or match["name"]) in allowed


def host_name(value: str) -> str:
    """``value`` as a canonical host name or IP address (lower case, no brackets, no final dot),
    or ``""`` when it is neither."""
    name = value.strip().lower().removeprefix("[").removesuffix("]").rstrip(".")
    try:
        return ipaddress.ip_address(name).compressed
    except ValueError:
        return name if _HOST_NAME.fullmatch(name) else ""


def serve(app: web.Application, address: str, port: int, name: str, path: str, about: str) -> None:
    """Say that ``tokenmill {name}`` serves at ``address:port`` and ``path`` (``about`` in
    brackets), and serve ``app`` there until stopped; a port it cannot listen on is refused
    naming it."""
    from aiohttp import web

    shown = f"[{address}]" if ":" in address else address
    click.echo(f"tokenmill {name} on http://{shown}:{port}{path} ({about})", err=True)
    try:
        web.run_app(app, host=address, port=port, print=None, access_log=None)
    except OSError as exc:
        why = exc.strerror or exc
        raise ConfigError(f"--port {port}: cannot listen on {address}:{port} ({why})") from None
