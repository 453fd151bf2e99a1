"""``tokenmill dashboard`` without a browser: who may bind it and reach it (its password, the
``Host`` names it answers to, the headers every answer carries), what its API answers, what the page
loads (tests/test_dashboard_browser.py looks at the page itself in Chromium)."""

from __future__ import annotations

import base64
import fnmatch
import re
import sys
import tomllib
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from email.message import Message
from pathlib import Path
from typing import Any

import orjson
import pytest
import redis

from producer.dashboard.server import HOSTS_SETTING, SECURITY_HEADERS, static_dir
from producer.web_access import allowed_hosts, host_allowed
from tests.finishing import finish_jobs
from tests.pipeline import cli
from tests.procs import ROOT, Proc, http_status, spawn, wait_for
from tokenmill import Client, keys
from tokenmill.errors import ConfigError
from tokenmill.local_redis import free_port
from tokenmill.quality import REPETITION, SIGNALS

AUTH = "TOKENMILL_DASHBOARD_BASIC_AUTH"
NO_AUTH = {AUTH: "", HOSTS_SETTING: ""}


def start_dashboard(
    workdir: Path,
    redis_url: str,
    port: int | None = None,
    env: dict[str, str] | None = None,
) -> tuple[Proc, str]:
    """``tokenmill dashboard`` on loopback, listening (what it answers is for the test to say)."""
    port = port or free_port()
    env = {**NO_AUTH, "TOKENMILL_REDIS_URL": redis_url, **(env or {})}
    proc = spawn(
        [sys.executable, "-m", "tokenmill.cli", "dashboard", "--port", str(port)],
        workdir / f"dashboard-{port}.log",
        env=env,
    )
    url = f"http://127.0.0.1:{port}"
    wait_for(lambda: http_status(url) != 0 or not proc.alive(), 30, "the dashboard")
    assert proc.alive(), proc.output()
    return proc, url


def fetch(
    url: str, host: str | None = None, method: str = "GET", auth: str | None = None
) -> tuple[int, Message, str]:
    """One request, with the ``Host`` and basic auth given: (status, headers, body)."""
    req = urllib.request.Request(url, method=method)
    if host is not None:
        req.add_header("Host", host)
    if auth is not None:
        req.add_header("Authorization", "Basic " + base64.b64encode(auth.encode()).decode())
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            return resp.status, resp.headers, resp.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.headers, exc.read().decode()


def get(url: str) -> tuple[int, Any]:
    try:
        with urllib.request.urlopen(url, timeout=10) as resp:
            body = resp.read()
            kind = resp.headers.get("Content-Type", "")
            return resp.status, orjson.loads(body) if kind.startswith("application/json") else body
    except urllib.error.HTTPError as exc:
        return exc.code, orjson.loads(exc.read())


@pytest.fixture
def dashboard(tmp_path: Path, redis_url: str, procs: list[Proc]) -> Iterator[str]:
    proc, url = start_dashboard(tmp_path, redis_url)
    procs.append(proc)
    yield url


def test_binding_beyond_loopback_needs_a_password_and_a_bad_one_is_named_not_shown(redis_url: str) -> None:
    env = {**NO_AUTH, "TOKENMILL_REDIS_URL": redis_url}
    res = cli("dashboard", "--address", "0.0.0.0", env=env, check=False)
    assert res.returncode == 2
    assert "refusing to bind the dashboard to 0.0.0.0 without authentication" in res.stderr
    assert "TOKENMILL_DASHBOARD_BASIC_AUTH=user:password" in res.stderr
    res = cli("dashboard", env={**env, "TOKENMILL_DASHBOARD_BASIC_AUTH": "ops:pw,hunter2"}, check=False)
    assert res.returncode == 2 and "basic auth entry 2" in res.stderr and "hunter2" not in res.stderr


def test_a_host_is_compared_by_name_whatever_its_port_case_or_brackets() -> None:
    hosts = allowed_hosts("0.0.0.0", "Dash.Internal, 10.1.2.3", HOSTS_SETTING)
    assert hosts == {"localhost", "127.0.0.1", "::1", "dash.internal", "10.1.2.3"}  # not 0.0.0.0
    for host in ("127.0.0.1:9650", "LOCALHOST.", "[::1]:9650", "[0:0:0:0:0:0:0:1]", "dash.internal:80"):
        assert host_allowed(host, hosts), host
    for host in (None, "", "evil.example", "::1", "[::1", "127.0.0.1:x", "localhost:1:2", "127.0.0.1@evil"):
        assert not host_allowed(host, hosts), host
    assert "dash.lan" in allowed_hosts("dash.lan", "", HOSTS_SETTING)  # the bound name
    for entry in ("http://dash.internal", "dash.internal:9650", "*"):
        with pytest.raises(ConfigError, match=re.escape(f"{HOSTS_SETTING}: {entry!r} is not a host name")):
            allowed_hosts("127.0.0.1", f"dash.internal,{entry}", HOSTS_SETTING)


def test_a_request_naming_a_foreign_host_is_refused_and_loopbacks_names_are_served(dashboard: str) -> None:
    # Given a dashboard on loopback without a password, which any local browser's page can reach
    port = dashboard.rsplit(":", 1)[1]
    # When a page asks for it through a name of its own rebound to 127.0.0.1 (DNS rebinding)
    for path in ("/", "/api/runs"):
        for host in ("evil.example", f"evil.example:{port}"):
            status, _, body = fetch(dashboard + path, host)
            # Then it is refused, naming the Host and the setting that would allow it
            assert status == 421 and f"Host {host!r}" in body and HOSTS_SETTING in body, (path, body)
    # And loopback's names are served, with the port or without
    for host in (f"127.0.0.1:{port}", f"localhost:{port}", f"[::1]:{port}", "localhost"):
        assert fetch(f"{dashboard}/api/runs", host)[0] == 200, host


def test_a_name_given_in_the_setting_is_served_and_a_malformed_one_is_refused_at_start(
    tmp_path: Path, redis_url: str, procs: list[Proc]
) -> None:
    # Given a dashboard told to answer to dash.internal as well
    proc, url = start_dashboard(tmp_path, redis_url, env={HOSTS_SETTING: "dash.internal"})
    procs.append(proc)
    port = url.rsplit(":", 1)[1]
    # Then a request naming it is served, and one naming another name still refused
    assert fetch(f"{url}/api/runs", f"dash.internal:{port}")[0] == 200
    assert fetch(f"{url}/api/runs", f"other.internal:{port}")[0] == 421
    # And a name given with its scheme and port is refused before anything listens, naming it
    env = {**NO_AUTH, "TOKENMILL_REDIS_URL": redis_url, HOSTS_SETTING: "http://dash.internal:9650"}
    res = cli("dashboard", "--port", str(free_port()), env=env, check=False, timeout=30)
    assert res.returncode == 2 and f"{HOSTS_SETTING}: 'http://dash.internal:9650'" in res.stderr, res.stderr


def test_every_answer_carries_the_security_headers_errors_and_refusals_included(dashboard: str) -> None:
    # Given a dashboard, and requests it serves, refuses, cannot route or does not allow
    local = f"127.0.0.1:{dashboard.rsplit(':', 1)[1]}"
    cases = [
        ("GET", "/", local, 200),
        ("GET", "/api/runs", local, 200),
        ("GET", "/static/dashboard.js", local, 200),
        ("GET", "/api/status", local, 400),
        ("GET", "/nowhere", local, 404),
        ("POST", "/api/runs", local, 405),
        ("GET", "/api/runs", "evil.example", 421),
    ]
    for method, path, host, code in cases:
        status, headers, _ = fetch(dashboard + path, host, method)
        assert status == code, (method, path)
        # Then each answer carries every security header, errors and refusals included
        wrong = {
            name: headers.get(name) for name, value in SECURITY_HEADERS.items() if headers.get(name) != value
        }
        assert not wrong, (method, path, status, wrong)
        # every answer but the static files' is never cached
        assert path.startswith("/static/") or headers.get("Cache-Control") == "no-store", (method, path)


def test_with_basic_auth_a_request_without_the_password_is_refused(
    tmp_path: Path, redis_url: str, procs: list[Proc]
) -> None:
    # Given a dashboard behind basic auth
    proc, url = start_dashboard(tmp_path, redis_url, env={AUTH: "ops:correct-horse"})
    procs.append(proc)
    # When a request comes without credentials, with a wrong password or as another user
    for auth in (None, "ops:wrong", "nobody:correct-horse"):
        status, headers, _ = fetch(f"{url}/api/runs", auth=auth)
        # Then it is refused with a challenge (and the security headers)
        assert status == 401 and headers["WWW-Authenticate"].startswith("Basic realm="), auth
        assert headers["Content-Security-Policy"] == SECURITY_HEADERS["Content-Security-Policy"]
    # And with the password it is served
    assert fetch(f"{url}/api/runs", auth="ops:correct-horse")[0] == 200


def test_an_unreachable_redis_or_a_busy_port_is_an_error_naming_it(
    tmp_path: Path, redis_url: str, procs: list[Proc]
) -> None:
    res = cli("dashboard", env={**NO_AUTH, "TOKENMILL_REDIS_URL": "redis://127.0.0.1:1/0"}, check=False)
    assert res.returncode == 2 and "redis://127.0.0.1:1/0" in res.stderr
    proc, url = start_dashboard(tmp_path, redis_url)
    procs.append(proc)
    port = url.rsplit(":", 1)[1]
    res = cli("dashboard", "--port", port, env={**NO_AUTH, "TOKENMILL_REDIS_URL": redis_url}, check=False)
    assert res.returncode == 2 and f"--port {port}: cannot listen" in res.stderr


def test_the_api_answers_the_documents_of_status_runs_history_and_samples(
    dashboard: str, redis_url: str, rclient: redis.Redis
) -> None:
    # Given a run with jobs done and queued
    tm = Client(redis_url=redis_url)
    tm.enqueue([{"prompt": f"question {i}"} for i in range(12)], run="r", partition="A")
    tm.enqueue([{"prompt": f"other {i}"} for i in range(3)], run="r", partition="B")
    done = [x.decode() for x in rclient.lrange("tm:r:jobs:A", 0, 9)]
    finish_jobs(rclient, "r", done, mean_output_tokens=20)
    env = {"TOKENMILL_REDIS_URL": redis_url}
    # tokens/s counts the whole seconds of the last minute: once the commits' second is over, two
    # reads a moment apart count the same tokens
    last = max(int(s) for s in rclient.hkeys("tm:r:tput"))
    wait_for(lambda: rclient.time()[0] > last, 5, "the commits' second to pass")

    # Then api/status is `status --json` (read a moment apart: the time it was read differs)
    status, doc = get(f"{dashboard}/api/status?run=r")
    printed = orjson.loads(cli("status", "--run", "r", "--json", env=env).stdout)
    assert status == 200
    doc.pop("at"), printed.pop("at")
    assert doc == printed and doc["totals"]["done"] == 10
    # api/runs is `runs --json`; api/samples and api/history the Python API's answers
    assert get(f"{dashboard}/api/runs") == (200, orjson.loads(cli("runs", "--json", env=env).stdout))
    status, samples = get(f"{dashboard}/api/samples?run=r&n=2")
    assert status == 200 and samples == tm.samples("r", 2) and len(samples) == 2
    status, hist = get(f"{dashboard}/api/history?run=r")
    assert status == 200 and set(hist) >= {"cursor", "series", "servers", "states"}
    status, later = get(f"{dashboard}/api/history?run=r&since={hist['cursor']}")
    assert status == 200 and later["since"] == hist["cursor"]


def test_the_api_answers_a_runs_quality_its_pause_and_its_flagged_jobs_samples(
    dashboard: str, redis_url: str, rclient: redis.Redis
) -> None:
    # Given a run with jobs done and judged, one in four of A's window looping, one flagged job
    # listed, and the run paused (the quality keys written as issue 56's design defines them)
    tm = Client(redis_url=redis_url)
    tm.enqueue([{"prompt": f"question {i}"} for i in range(4)], run="r", partition="A")
    job_ids = [x.decode() for x in rclient.lrange("tm:r:jobs:A", 0, -1)]
    finish_jobs(rclient, "r", job_ids[:2], mean_output_tokens=20)
    k = keys.RunKeys("r")
    rclient.hset(k.quality(), mapping={"A|judged": 40, "A|repetition": 10})
    rclient.lpush(k.quality_window("A"), *[REPETITION] * 10, *[0] * 30)
    rclient.hset(k.quality_window_counts(), mapping={"A|n": 40, "A|repetition": 10})
    rclient.lpush(k.quality_worst("repetition"), f"A|{job_ids[0]}")
    rclient.hset(
        k.paused(), mapping={"reason": "quality rule tripped", "at_ms": 1_700_000_000_000, "by": "rule"}
    )

    # Then api/status is `status --json`, with the quality rates and the pause
    status, doc = get(f"{dashboard}/api/status?run=r")
    printed = orjson.loads(
        cli("status", "--run", "r", "--json", env={"TOKENMILL_REDIS_URL": redis_url}).stdout
    )
    assert status == 200 and {**doc, "at": 0, "tokens_per_s": 0} == {**printed, "at": 0, "tokens_per_s": 0}
    assert doc["partitions"]["A"]["quality"]["repetition"] == 0.25 and doc["quality"]["judged"] == 40
    assert doc["paused"] == {"reason": "quality rule tripped", "at": 1_700_000_000.0, "by": "rule"}
    # api/flagged lists the latest flagged jobs of every flag
    status, flagged = get(f"{dashboard}/api/flagged?run=r")
    assert status == 200 and flagged == {f: [] for f in SIGNALS} | {
        "repetition": [{"partition": "A", "job_id": job_ids[0]}]
    }

    # and api/samples?partition=&job= is that job's sample, as the sample viewer shows the latest
    def sample(job_id: str) -> tuple[int, Any]:
        return get(f"{dashboard}/api/samples?run=r&partition=A&job={urllib.parse.quote(job_id)}")

    status, samples = sample(job_ids[0])
    assert status == 200 and samples == tm.samples("r", partition="A", job_id=job_ids[0])
    assert [s["job_id"] for s in samples] == [job_ids[0]]
    assert samples[0]["row"] == next(s["row"] for s in tm.samples("r", 2) if s["job_id"] == job_ids[0])
    # a job not done (or no job) has none
    assert sample(job_ids[3]) == sample("nope") == (200, [])


@pytest.mark.parametrize(
    ("query", "code", "says"),
    [
        ("status?run=nope", 404, "'nope': no run of that name"),
        ("status", 400, "the run parameter is required"),
        ("status?run=bad name", 404, "not a valid run name"),
        ("samples?run=r&n=0", 400, "n=0 is out of range"),
        ("samples?run=r&n=many", 400, "n='many' is not an integer"),
        ("samples?run=r&partition=Z", 404, "'Z': run 'r' has no partition of that name"),
        ("history?run=r&since=-4", 400, "since=-4 is out of range"),
        ("flagged?run=nope", 404, "'nope': no run of that name"),
        ("samples?run=r&job=x", 400, "job needs its partition"),
    ],
)
def test_a_bad_request_is_answered_with_an_error_naming_it(
    dashboard: str, redis_url: str, query: str, code: int, says: str
) -> None:
    Client(redis_url=redis_url).enqueue([{"prompt": "q"}], run="r", partition="A")
    status, body = get(f"{dashboard}/api/{query.replace(' ', '%20')}")
    assert status == code and says in body["error"], body


def test_the_page_loads_only_files_it_ships_and_the_package_ships_them_all(dashboard: str) -> None:
    # The page names only its own files, by relative URL, and each is served
    index = (static_dir() / "index.html").read_text()
    refs = re.findall(r'(?:src|href)="([^"]+)"', index)
    assert refs and all(not re.match(r"^[a-z]+://|^//", ref) for ref in refs), refs
    for ref in refs:
        if not ref.startswith("data:"):
            assert http_status(f"{dashboard}/{ref}") == 200, ref
    for name in ("index.html", "dashboard.js", "dashboard.css"):
        text = (static_dir() / name).read_text()
        assert not re.search(r"https?://", text), f"{name} names a URL elsewhere"
    # uPlot is vendored with its licence
    licence = (static_dir() / "vendor/uplot/LICENSE").read_text()
    assert "MIT License" in licence and "Leon Sorokin" in licence
    assert "uplot` 1.6.32" in (static_dir() / "vendor/uplot/SOURCE.md").read_text()
    # and every file of the page is package data (so an installed tokenmill serves it)
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    globs = project["tool"]["setuptools"]["package-data"]["producer.dashboard"]
    package = static_dir().parent
    files = {str(p.relative_to(package)) for p in static_dir().rglob("*") if p.is_file()}
    shipped = {f for f in files if any(fnmatch.fnmatch(f, g) and f.count("/") == g.count("/") for g in globs)}
    assert shipped == files, f"not package data: {files - shipped}"
