"""The dashboard in a real browser: headless Chromium on a live demo-like run.

One run is shared by the module (tests/dashboard_stack.py): the page is opened while every job is
still queued, then the workers start, so the first test watches the page follow the run without a
reload; the others look at the finished, sealed run. Tests run in file order.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import shutil
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest

from tests.dashboard_stack import RUN, TOO_LONG, USER, Stack, basic_auth, chromium
from tests.pipeline import cli, read_export
from tests.procs import RedisServer, wait_for
from tokenmill import keys
from tokenmill.quality import REPETITION

TOTAL = 200 + TOO_LONG
# every chart the page draws for this run (a managed server: its state chart too)
CHARTS = {"throughput", "jobs", "failures", "hist-completion", "hist-reasoning"}
SERVER_CHARTS = {"requests", "kv", "state"}
PAGE_NUMBERS = """
return [...document.querySelectorAll('[data-path]')].map(
  e => [JSON.parse(e.dataset.path), JSON.parse(e.dataset.value)]);
"""
HISTOGRAM_LABELS = """
const u = window.tm.charts[arguments[0]], axis = u.axes[0];
return {legend: u.series[0].value(u, 0), ticks: axis.values(u, axis.splits(u, 0))};
"""
CHART_POINTS = """
return Object.fromEntries(Object.entries(window.tm.charts).map(
  ([k, u]) => [k, u.data.slice(1).map(s => s.filter(v => v !== null && v !== undefined).length)]));
"""


@pytest.fixture(scope="module")
def live(redis_server: RedisServer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """The stack, the run enqueued, the page open on it; then the workers started."""
    if not redis_server.ping():
        redis_server.start()
    redis_server.client().flushall()
    workdir = tmp_path_factory.mktemp("dashboard")
    stack = Stack(workdir, redis_server.url)
    try:
        stack.start_server()
        stack.start_dashboard()
        stack.enqueue()
        with chromium(basic_auth()) as driver:
            driver.get(f"{stack.dashboard_url}/?run={RUN}")
            wait_for(lambda: driver.execute_script("return window.tm.ticks"), 30, "the page's first update")
            driver.execute_script("window.loadedOnce = true")  # gone if the page were reloaded
            first = driver.execute_script("return window.tm.status.totals")
            stack.start_workers()
            yield {"stack": stack, "driver": driver, "first": first, "console": []}
    finally:
        stack.close()


def console_errors(live: dict[str, Any]) -> list[dict[str, Any]]:
    """Every severe console entry the page logged so far (the log is read once, so kept)."""
    live["console"] += live["driver"].get_log("browser")
    return [e for e in live["console"] if e["level"] == "SEVERE"]


def status_json(stack: Stack) -> dict[str, Any]:
    doc: dict[str, Any] = orjson.loads(cli("status", "--run", RUN, "--json", env=stack.env).stdout)
    return doc


def finished_and_sealed(stack: Stack) -> dict[str, Any] | None:
    doc = status_json(stack)
    t = doc["totals"]
    sealed = sum(doc["results"]["sealed"].values())
    return doc if t["done"] + t["failed"] == TOTAL and sealed == t["done"] else None


def resolve(doc: Any, path: list[Any]) -> Any:
    for part in path:
        doc = doc[part]
    return doc


def test_the_page_follows_the_live_run_without_a_reload(live: dict[str, Any]) -> None:
    driver = live["driver"]
    # Given the page opened while every job was queued
    assert live["first"]["queued"] + live["first"]["running"] == TOTAL and live["first"]["done"] == 0

    # Then, without a reload, it shows jobs done, then the run finished
    def shown_done() -> int:
        return int(driver.execute_script("return window.tm.status.totals.done"))

    wait_for(lambda: 0 < shown_done() < 200, 60, "the page to show the run under way")
    wait_for(lambda: shown_done() == 200, 120, "the page to show every job done")
    assert driver.execute_script("return window.loadedOnce") is True, "the page was reloaded"
    card = driver.execute_script(
        """return document.querySelector('[data-path=\\'["totals","done"]\\']').textContent"""
    )
    assert card == "200"


def test_the_sample_viewer_shows_real_completions(live: dict[str, Any], tmp_path: Path) -> None:
    stack, driver = live["stack"], live["driver"]
    wait_for(lambda: finished_and_sealed(stack), 120, "the run to finish and be sealed")
    cli("export", "--run", RUN, "--out", str(tmp_path), "--include-truncated", env=stack.env)
    exported = {(row["partition"], row["id"]): row for rows in read_export(tmp_path).values() for row in rows}

    # When the samples are refreshed on demand
    driver.execute_script("window.tm.samples = null; document.getElementById('refresh-samples').click()")
    wait_for(lambda: driver.execute_script("return (window.tm.samples || []).length"), 30, "the samples")
    cards = driver.execute_script("""
      return [...document.querySelectorAll('#samples .sample')].map(c => ({
        partition: c.dataset.partition,
        meta: c.querySelector('.meta').textContent,
        prompt: c.querySelector('pre.prompt') && c.querySelector('pre.prompt').textContent,
        reasoning: c.querySelector('pre.reasoning') && c.querySelector('pre.reasoning').textContent,
        answer: c.querySelector('pre.answer') && c.querySelector('pre.answer').textContent}))""")

    # Then each partition that has completions shows the latest three, as the export has them
    assert sorted(c["partition"] for c in cards) == ["B1"] * 3 + ["B2"] * 3
    for c in cards:
        row_id = c["meta"].split(" · id ")[1].split(" · ")[0]
        row = exported[(c["partition"], row_id)]
        assistant = row["messages"][-1]
        assert c["answer"] == assistant["content"] and c["answer"].strip()
        assert c["reasoning"] == assistant.get("reasoning_content")
        assert c["prompt"] == row["messages"][-2]["content"]
        assert f"{row['usage']['completion_tokens']} completion tokens" in c["meta"]
        assert "from its shard" in c["meta"]  # sealed: read back from the result store


def test_the_finished_run_matches_status_json_every_chart_has_points_and_nothing_errs(
    live: dict[str, Any], tmp_path: Path
) -> None:
    stack, driver = live["stack"], live["driver"]
    wait_for(lambda: finished_and_sealed(stack), 120, "the run to finish and be sealed")

    # Then every number the page shows from the status document is the CLI's
    mismatches: list[Any] = []

    def page_matches_cli() -> bool:
        doc = status_json(stack)
        shown = driver.execute_script(PAGE_NUMBERS)
        # tokens/s is over the minute before each read: the two reads differ by their seconds
        mismatches[:] = [(p, v, resolve(doc, p)) for p, v in shown if p != ["tokens_per_s"]]
        mismatches[:] = [m for m in mismatches if m[1] != m[2]]
        return len(shown) > 30 and not mismatches

    try:
        wait_for(page_matches_cli, 30, "the page to match status --json")
    except AssertionError as exc:
        pytest.fail(f"{exc}; (path, page, status --json) that differ: {mismatches}")
    doc = status_json(stack)
    assert doc["failures"] == {"context_length": TOO_LONG}
    assert doc["servers"][0]["restarts"] >= 1 and doc["servers"][0]["state"] == "ready"

    # and every chart has data points: the run's, each server's, the outputs'
    points = driver.execute_script(CHART_POINTS)
    names = {"sim-1"}
    want = CHARTS | {f"server:{n}:{c}" for n in names for c in SERVER_CHARTS}
    assert want <= set(points), points
    empty = {k: v for k, v in points.items() if not v or min(v) == 0}
    assert not empty, f"charts without data points: {empty}"
    assert min(points["jobs"]) >= 10, points  # a point a second over the run
    # and the histograms label their bins (drawn on a canvas: read through the chart's own labels)
    for key, field in (("hist-completion", "completion_tokens"), ("hist-reasoning", "reasoning_tokens")):
        labels = driver.execute_script(HISTOGRAM_LABELS, key)
        lo, hi, _ = doc["outputs"][field][0]
        assert labels["legend"] == f"{lo}\u2013{hi - 1}" and labels["ticks"][0] == str(lo), (key, labels)

    # and the page logged no error
    assert console_errors(live) == []

    # and a screenshot of the whole page is taken
    height = driver.execute_script("return document.body.scrollHeight")
    driver.set_window_size(1400, height + 40)
    shot = tmp_path / "dashboard.png"
    assert driver.save_screenshot(str(shot))
    assert shot.stat().st_size > 50_000, "the screenshot looks blank"
    if os.environ.get("TOKENMILL_SCREENSHOT_DIR"):  # docs/dashboard.png is made this way
        shutil.copy(shot, Path(os.environ["TOKENMILL_SCREENSHOT_DIR"]) / "dashboard.png")


QUALITY_SHOWN = """
const q = document.getElementById('paused');
return {banner: q.hidden ? null : q.textContent,
  rows: [...document.querySelectorAll('#quality tr')].map(r => r.firstChild.textContent),
  buttons: [...document.querySelectorAll('#flagged button.job')].map(b => b.dataset.jobId),
  shares: window.tm.charts.quality ? window.tm.charts.quality.data.map(s => s[s.length - 1]) : null};
"""


def test_the_quality_section_shows_rates_the_pause_and_opens_a_flagged_jobs_sample(
    live: dict[str, Any], redis_server: RedisServer, tmp_path: Path
) -> None:
    stack, driver = live["stack"], live["driver"]
    wait_for(lambda: finished_and_sealed(stack), 120, "the run to finish and be sealed")
    r = redis_server.client()
    k = keys.RunKeys(RUN)
    # Given B1's window of 200 judged jobs with 14 looping, one of them listed as flagged, 10 loops
    # among the run's next 100 judged jobs, and the run paused by the rule (the keys written as
    # issue 56's design defines them)
    job_id = r.lrange(k.recent("B1"), 0, 0)[0].decode()
    last = r.xrevrange(k.series(), count=1)[0][1]
    counts = {f.decode(): int(n) for f, n in r.hgetall(k.quality()).items()}  # what the upkeep's points sum
    judged = sum(n for f, n in counts.items() if f.endswith("|judged"))
    loops = sum(n for f, n in counts.items() if f.endswith("|repetition"))
    r.xadd(k.series(), {**last, b"judged": judged, b"q:repetition": loops})
    r.pipeline().hincrby(k.quality(), "B1|judged", 100).hincrby(k.quality(), "B1|repetition", 10).execute()
    r.xadd(k.series(), {**last, b"judged": judged + 100, b"q:repetition": loops + 10})
    r.delete(k.quality_window("B1"))
    r.lpush(k.quality_window("B1"), *[REPETITION] * 14, *[0] * 186)
    r.hset(k.quality_window_counts(), mapping={"B1|n": 200, "B1|repetition": 14})
    r.lpush(k.quality_worst("repetition"), f"B1|{job_id}")
    reason = "quality rule repetition>0.05@200 tripped on partition B1: 0.070 over 200 jobs"
    r.hset(k.paused(), mapping={"reason": reason, "at_ms": int(r.time()[0]) * 1000, "by": "rule"})

    # Then, without a reload, the page shows the pause with its reason, B1's rates and the
    # flagged job, and the chart the share of the last 100 judged jobs that looped
    page: dict[str, Any] = {}

    def shown() -> bool:
        page.update(driver.execute_script(QUALITY_SHOWN))
        return bool(page["banner"] and job_id in page["buttons"] and (page["shares"] or [0] * 4)[3] == 10)

    with contextlib.suppress(AssertionError):  # what it shows then is checked below
        wait_for(shown, 30, "the page to show the quality")
    assert page["banner"] and page["banner"].startswith("PAUSED since ") and reason in page["banner"], page
    assert job_id in page["buttons"], page["buttons"]
    assert {"all partitions", "B1", "B2"} <= set(page["rows"]), page["rows"]
    assert page["shares"][3] == 10.0, page["shares"]  # series 3: repetition, in % of judged jobs
    assert status_json(stack)["partitions"]["B1"]["quality"]["repetition"] == 0.07
    path = json.dumps(["partitions", "B1", "quality", "repetition"], separators=(",", ":"))
    rate = driver.execute_script(
        "return document.querySelector(arguments[0]).textContent", f"[data-path='{path}']"
    )
    assert rate == "7.0%"

    # When the flagged job is clicked
    driver.execute_script("window.tm.samples = null")
    driver.find_element("css selector", f'#flagged button.job[data-job-id="{job_id}"]').click()
    wait_for(lambda: driver.execute_script("return window.tm.samples"), 30, "the flagged job's sample")
    # Then the sample viewer shows that job's completion, as the export has it
    cli("export", "--run", RUN, "--out", str(tmp_path), "--include-truncated", env=stack.env)
    exported = {(row["partition"], row["id"]): row for rows in read_export(tmp_path).values() for row in rows}
    cards = driver.execute_script("""
      return [...document.querySelectorAll('#samples .sample')].map(c => ({job: c.dataset.jobId,
        meta: c.querySelector('.meta').textContent, answer: c.querySelector('pre.answer').textContent}))""")
    assert [c["job"] for c in cards] == [job_id], cards
    row_id = cards[0]["meta"].split(" · id ")[1].split(" · ")[0]
    assert cards[0]["answer"] == exported[("B1", row_id)]["messages"][-1]["content"]
    assert job_id in driver.find_element("id", "samples-note").text
    assert console_errors(live) == []

    # and a screenshot of the page with its Quality section is taken
    driver.set_window_size(1400, driver.execute_script("return document.body.scrollHeight") + 40)
    shot = tmp_path / "dashboard-quality.png"
    assert driver.save_screenshot(str(shot)) and shot.stat().st_size > 50_000
    if os.environ.get("TOKENMILL_SCREENSHOT_DIR"):
        shutil.copy(shot, Path(os.environ["TOKENMILL_SCREENSHOT_DIR"]) / "dashboard-quality.png")
    r.delete(k.paused())


def _get(url: str, authorization: str | None) -> tuple[int, dict[str, str]]:
    headers = {"Authorization": authorization} if authorization else {}
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=10) as resp:
            return resp.status, dict(resp.headers)
    except urllib.error.HTTPError as exc:
        return exc.code, dict(exc.headers)


def test_the_page_and_its_api_need_the_password(live: dict[str, Any]) -> None:
    stack = live["stack"]
    base = stack.dashboard_url
    wrong = "Basic " + base64.b64encode(f"{USER}:not-it".encode()).decode()
    paths = ("/", "/static/dashboard.js", "/static/vendor/uplot/uPlot.iife.min.js", f"/api/status?run={RUN}")
    for path in paths:
        status, headers = _get(base + path, None)
        assert status == 401 and headers["WWW-Authenticate"].startswith("Basic"), path
        assert _get(base + path, wrong)[0] == 401, path
        assert _get(base + path, basic_auth())[0] == 200, path

    # and a browser without the password gets the challenge, not the page
    with chromium() as driver:
        driver.get(f"{base}/?run={RUN}")
        answer = "return performance.getEntriesByType('navigation')[0].responseStatus"
        assert driver.execute_script(answer) == 401
        assert driver.execute_script("return typeof window.tm") == "undefined"
        assert driver.title != "tokenmill dashboard"
        # while the page's own browser, with it, reads the status document
    driver = live["driver"]
    driver.get(f"{base}/api/status?run={RUN}")
    doc = json.loads(driver.find_element("tag name", "body").text)
    assert doc["run"] == RUN and doc["totals"]["total"] == TOTAL
