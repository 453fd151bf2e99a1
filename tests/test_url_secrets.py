"""One redaction for every URL shown: passwords, credential userinfo and secret options hidden."""

from __future__ import annotations

import base64

import pytest

from tokenmill.servers import name_of
from tokenmill.url_secrets import redact_url, split_userinfo

HIDDEN = [
    ("redis://:pw@h:6379/0", "redis://:***@h:6379/0"),
    ("redis://alice:pw@h:6379/0", "redis://alice:***@h:6379/0"),
    ("rediss://:p%40ss@h:6380/1?ssl_cert_reqs=none", "rediss://:***@h:6380/1?ssl_cert_reqs=none"),
    ("redis://h:6379/0?password=pw", "redis://h:6379/0?password=***"),
    ("rediss://h/0?ssl_keyfile=/k.pem&ssl_password=pw", "rediss://h/0?ssl_keyfile=/k.pem&ssl_password=***"),
    (
        "redis://h/0?socket_timeout=5&Password=pw&client_name=c",
        "redis://h/0?socket_timeout=5&Password=***&client_name=c",
    ),
    ("unix://:pw@/run/redis.sock?db=2", "unix://:***@/run/redis.sock?db=2"),
    (
        "sentinel://:pw@h1:26379;sentinel://:pw@h2:26379/0?master_name=m",
        "sentinel://:***@h1:26379;sentinel://:***@h2:26379/0?master_name=m",
    ),
    (
        "sentinel://h1:26379?sentinel_password=sp;sentinel://u:pw@h2/0?master_name=m",
        "sentinel://h1:26379?sentinel_password=***;sentinel://u:***@h2/0?master_name=m",
    ),
    ("http://user:pw@10.0.0.1:30000", "http://***@10.0.0.1:30000"),
    ("https://tok@gpu.example:443/v1", "https://***@gpu.example:443/v1"),
    ("http://h:30000/?api_key=k&token=t&key=x", "http://h:30000/?api_key=***&token=***&key=***"),
    ("s3://AKIA:sec%2Fret@bucket/results", "s3://***@bucket/results"),
    (
        "s3://bucket/results?secret=s&key=k&endpoint_url=http://m",
        "s3://bucket/results?secret=***&key=***&endpoint_url=http://m",
    ),
    ("gs://bucket/r?token=t", "gs://bucket/r?token=***"),
]
UNCHANGED = [
    "redis://127.0.0.1:6379/0",
    "redis://alice@h:6379/0",
    "rediss://h:6380/0?ssl_cert_reqs=required",
    "sentinel://h1:26379;sentinel://h2:26379/0?master_name=m",
    "http://127.0.0.1:30000",
    "https://gpu.example/v1/?monkey=1&keys=2",
    "s3://bucket/results",
    "/var/lib/tokenmill/results",
    "",
]


@pytest.mark.parametrize(("url", "shown"), HIDDEN)
def test_every_kind_of_secret_in_a_url_is_hidden_and_the_rest_is_kept(url: str, shown: str) -> None:
    # Given a URL carrying a credential; When it is redacted; Then only the credential changed
    assert redact_url(url) == shown


@pytest.mark.parametrize("url", UNCHANGED)
def test_a_url_without_secrets_is_shown_and_named_byte_for_byte_as_before(url: str) -> None:
    # Given a URL with nothing secret; Then it is shown, and a server so named keeps its keys
    assert redact_url(url) == url
    assert name_of(url) == url


def test_a_server_urls_userinfo_becomes_basic_auth_on_a_url_without_it() -> None:
    # Given a server URL with user:password@ (a password with an escaped '@')
    bare, auth = split_userinfo("http://u:p%40ss@127.0.0.1:30000/health")
    # Then the request goes to the host alone, and logs in with the userinfo
    assert bare == "http://127.0.0.1:30000/health"
    assert auth == "Basic " + base64.b64encode(b"u:p@ss").decode()
    assert split_userinfo("http://127.0.0.1:30000") == ("http://127.0.0.1:30000", None)
