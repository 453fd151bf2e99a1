"""The secrets a URL may carry: hidden wherever a URL is shown, split out where one is used.

Every URL tokenmill shows (errors, logs, start lines, ``status``, reprs) and every server
identity it derives from one (Redis key names, a result's ``server``) goes through
:func:`redact_url`. It hides a userinfo's password (a Redis URL's user names an ACL user and
stays; any other scheme's whole userinfo is a credential: basic auth, an S3 key pair), the
values of the query options in :data:`SECRET_OPTIONS`, and does so on every host of a Sentinel
URL. A URL with no secret comes back unchanged, byte for byte, so a server's identity in keys
written before this function existed is the same.
"""

from __future__ import annotations

import base64
from urllib.parse import unquote, urlsplit, urlunsplit

HIDDEN = "***"
# query options whose value is a credential (compared without case): redis-py's, fsspec's
# (s3fs, gcsfs, adlfs) and the usual token names of HTTP services
SECRET_OPTIONS = frozenset(
    {
        "password",
        "sentinel_password",
        "ssl_password",
        "token",
        "access_token",
        "api_key",
        "apikey",
        "key",
        "secret",
        "client_secret",
        "secret_key",
        "access_key",
        "session_token",
        "account_key",
        "sas_token",
        "credential",
        "signature",
        "sig",
        "x-amz-signature",
        "x-amz-credential",
        "x-amz-security-token",
    }
)
_KEEPS_USER = frozenset({"redis", "rediss", "unix", "sentinel"})


def redact_url(url: str) -> str:
    """``url`` safe to show: passwords, credential userinfo and secret query values as ``***``."""
    if url.startswith("sentinel://") and ";" in url:
        return ";".join(redact_url(part) for part in url.split(";"))
    parts = urlsplit(url)
    netloc = _redact_userinfo(parts.scheme, parts.netloc)
    query = _redact_query(parts.query)
    if netloc == parts.netloc and query == parts.query:
        return url
    return urlunsplit(parts._replace(netloc=netloc, query=query))


def split_userinfo(url: str) -> tuple[str, str | None]:
    """``url`` without its ``user:password@``, and that userinfo as a basic ``Authorization``
    header value (None when there is none): what to connect to, and how to log in."""
    parts = urlsplit(url)
    userinfo, at, host = parts.netloc.rpartition("@")
    if not at:
        return url, None
    user, _, password = userinfo.partition(":")
    token = base64.b64encode(f"{unquote(user)}:{unquote(password)}".encode()).decode()
    return urlunsplit(parts._replace(netloc=host)), f"Basic {token}"


def _redact_userinfo(scheme: str, netloc: str) -> str:
    userinfo, at, host = netloc.rpartition("@")
    if not at:
        return netloc
    if scheme not in _KEEPS_USER:
        return f"{HIDDEN}@{host}"
    user, colon, _ = userinfo.partition(":")
    return f"{user}:{HIDDEN}@{host}" if colon else netloc


def _redact_query(query: str) -> str:
    pairs = []
    for pair in query.split("&"):
        name, eq, _ = pair.partition("=")
        pairs.append(f"{name}={HIDDEN}" if eq and unquote(name).lower() in SECRET_OPTIONS else pair)
    return "&".join(pairs)
