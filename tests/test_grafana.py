"""The Grafana dashboard in docker/grafana, read as a specification: a well-formed dashboard whose
every query names metrics (and labels) that ``tokenmill metrics`` exports, provisioned with the
Prometheus that compose's ``grafana`` profile runs, scraping the compose ``metrics`` service and
evaluating the alert rules of alerts.yml (well-formed, on exported metrics, and, where Debian's
``promtool`` is installed, firing when they should)."""

from __future__ import annotations

import itertools
import json
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import redis
import yaml
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from producer.metrics import registry_for
from server_mgr.logparse import FIELD_NAMES
from tests.test_compose import ENV, interpolate
from tokenmill import Client, keys, servers
from tokenmill import transitions as t
from tokenmill.ledger import Ledger
from tokenmill.quality import RATE_NAMES, RULE_NAMES
from tokenmill.transitions import Claim, JobError

ROOT = Path(__file__).resolve().parent.parent
GRAFANA = ROOT / "docker" / "grafana"
DASHBOARD = GRAFANA / "dashboards" / "tokenmill.json"
ALERTS = GRAFANA / "alerts.yml"
_METRIC = re.compile(r"\btokenmill_[a-z_]+\b")
_SELECTOR = re.compile(r"\b(tokenmill_[a-z_]+)\{([^}]*)\}")
_MATCHER = re.compile(r'(\w+)\s*(=~|!~|!=|=)\s*"([^"]*)"')
_BY = re.compile(r"\b(?:by|without|on|ignoring)\s*\(([^)]*)\)")
FIGURES = set(FIELD_NAMES.values()) | {"retractions"}  # the manager's live figures


@pytest.fixture(scope="module")
def dashboard() -> dict[str, Any]:
    doc: dict[str, Any] = json.loads(DASHBOARD.read_text())
    return doc


def queries(dashboard: dict[str, Any]) -> list[tuple[str, str]]:
    """(panel title, expression) of every query, the run variable's included."""
    out = [(p["title"], t["expr"]) for p in dashboard["panels"] for t in p.get("targets", [])]
    out += [(f"variable {v['name']}", v["definition"]) for v in dashboard["templating"]["list"]]
    return out


def exported(rclient: redis.Redis, redis_url: str) -> dict[str, set[str]]:
    """Every metric name ``tokenmill metrics`` exports (as Prometheus sees it, ``_total`` and all)
    and its labels, scraped from the real collector over a ledger with one of everything: a run
    with jobs done and failed and quality judged (the ledger's keys as issue 56's design defines
    them), paused; a managed server with its live figures, admission on it."""
    tm = Client(redis_url=redis_url)
    tm.enqueue([{"prompt": f"q{i}"} for i in range(3)], run="g", partition="A")
    ledger = Ledger(rclient, "g")
    job_ids = [x.decode() for x in rclient.lrange(keys.RunKeys("g").jobs("A"), 0, -1)]
    claims = [ledger.call(t.claim(ledger.k, j, "w", 30)) for j in job_ids[:2]]
    assert all(isinstance(c, Claim) for c in claims)
    result = {"content": "x", "finish_reason": "length", "usage": {"completion_tokens": 4}}
    ledger.call(t.commit(ledger.k, claims[0], result, 4))
    ledger.call(t.fail(ledger.k, claims[1], JobError("context_length", "too long")))
    k = keys.RunKeys("g")
    flags = {f"A|{flag}": 1 for flag in RATE_NAMES.values()}
    rclient.hset(k.quality(), mapping={"A|judged": 2, **flags})
    rclient.hset(k.quality_window_counts(), mapping={"A|n": 2, **flags})
    rclient.lpush(k.quality_window("A"), 2 ** len(RATE_NAMES) - 1, 0)  # every flag, none
    rclient.hset(k.paused(), mapping={"reason": "by hand", "at_ms": 1, "by": "person"})
    reference = {"url": "http://ref:30000", "sample": "0.1", "min": "2", "error": "refused", "A|sampled": 1}
    rclient.hset(k.quality_reference(), mapping=reference)  # a reference that fails to score
    live = {"running_req": 3, "queue_req": 1, "token_usage": 0.5, "retractions": 2, "gen_throughput": 9}
    servers.publish(rclient, servers.ServerRecord("gpu0", "http://h:30000", "ready", "sglang", live=live))
    fields = {"total": 10, "budget": 100, "n": 2, "window": 4, "admitted": 5, "refused": 1, "short": 10}
    rclient.hset(keys.admission_used("gpu0"), mapping={**fields, "cap:short": 75})
    text = generate_latest(registry_for(rclient)).decode()
    names: dict[str, set[str]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            names.setdefault(sample.name, set()).update(sample.labels)
    return names


def test_the_dashboard_is_well_formed(dashboard: dict[str, Any]) -> None:
    assert dashboard["uid"] == "tokenmill" and dashboard["title"] and dashboard["schemaVersion"] >= 36
    panels = dashboard["panels"]
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    datasource = yaml.safe_load((GRAFANA / "provisioning/datasources/prometheus.yaml").read_text())
    (source,) = datasource["datasources"]
    boxes = []
    for p in panels:
        g = p["gridPos"]
        assert g["x"] >= 0 and g["w"] > 0 and g["x"] + g["w"] <= 24 and g["h"] > 0, p["title"]
        boxes.append((p["title"], g["x"], g["x"] + g["w"], g["y"], g["y"] + g["h"]))
        if p["type"] == "row":
            continue
        assert p["type"] in {"stat", "timeseries", "bargauge", "state-timeline"}, p["title"]
        assert p["datasource"]["uid"] == source["uid"] and p["targets"], p["title"]
        refs = [t["refId"] for t in p["targets"]]
        assert len(refs) == len(set(refs)) and all(t["expr"].strip() for t in p["targets"]), p["title"]
        assert all(t["datasource"]["uid"] == source["uid"] for t in p["targets"]), p["title"]
    for a, b in itertools.combinations(boxes, 2):  # no panel hides another
        overlap = a[1] < b[2] and b[1] < a[2] and a[3] < b[4] and b[3] < a[4]
        assert not overlap, f"panels {a[0]!r} and {b[0]!r} overlap"
    for _, expr in queries(dashboard):
        assert expr.count("(") == expr.count(")") and expr.count("{") == expr.count("}"), expr
    (run,) = dashboard["templating"]["list"]
    assert run["name"] == "run" and run["datasource"]["uid"] == source["uid"]


def test_every_metric_and_label_it_queries_is_one_tokenmill_metrics_exports(
    dashboard: dict[str, Any], rclient: redis.Redis, redis_url: str
) -> None:
    metrics = exported(rclient, redis_url)
    used = set()
    for title, expr in queries(dashboard):
        used |= check_expr(title, expr, metrics)
    # the dashboard shows runs, servers, admission, failures and quality
    assert {"tokenmill_jobs", "tokenmill_completion_tokens_total", "tokenmill_job_failures_total"} <= used
    assert {"tokenmill_server_state", "tokenmill_server_restarts_total", "tokenmill_admission_window"} <= used
    assert {"tokenmill_quality_rate", "tokenmill_run_paused"} <= used


def check_expr(title: str, expr: str, metrics: dict[str, set[str]]) -> set[str]:
    """Assert that ``expr`` queries only exported metrics, by their labels and known label values;
    return the metrics it names."""
    names = set(_METRIC.findall(expr))
    assert names, f"{title}: {expr} queries no tokenmill metric"
    for name in names:
        assert name in metrics, f"{title}: {name} is not exported by `tokenmill metrics`"
    for name, matchers in _SELECTOR.findall(expr):
        for label, _, value in _MATCHER.findall(matchers):
            assert label in metrics[name], f"{title}: {name} has no label {label!r}"
            if label == "figure":
                assert value in FIGURES, f"{title}: no live figure is called {value!r}"
            if label == "signal" and re.fullmatch(r"\w+", value):
                assert value in RULE_NAMES, f"{title}: no quality signal is called {value!r}"
    labels = set().union(*(metrics[n] for n in names))
    for group in _BY.findall(expr):
        for label in filter(None, (x.strip() for x in group.split(","))):
            assert label in labels, f"{title}: grouped by {label!r}, which {names} do not carry"
    return names


def alert_rules() -> list[dict[str, Any]]:
    return [rule for group in yaml.safe_load(ALERTS.read_text())["groups"] for rule in group["rules"]]


def test_the_alert_rules_are_well_formed_and_watch_every_quality_signal_on_exported_metrics(
    rclient: redis.Redis, redis_url: str
) -> None:
    metrics = exported(rclient, redis_url)
    rules = alert_rules()
    names = [rule["alert"] for rule in rules]
    assert len(names) == len(set(names)) and "TokenmillRunPaused" in names, names
    for rule in rules:
        name = rule["alert"]
        assert set(rule) == {"alert", "expr", "for", "labels", "annotations"}, name
        assert re.fullmatch(r"Tokenmill[A-Z]\w+", name) and re.fullmatch(r"\d+[smh]", rule["for"]), name
        assert rule["labels"]["severity"] in {"warning", "critical"}, name
        assert {"summary", "description"} <= set(rule["annotations"]), name
        check_expr(name, rule["expr"], metrics)
    # every quality signal has an alert on its rate
    watched = {s for rule in rules for s in re.findall(r'signal="(\w+)"', rule["expr"])}
    assert watched == set(RULE_NAMES), watched


def test_compose_runs_prometheus_on_the_metrics_service_and_grafana_on_it_as_a_profile() -> None:
    compose = interpolate(yaml.safe_load((ROOT / "compose.yaml").read_text())["services"], ENV)
    prometheus, grafana, metrics = compose["prometheus"], compose["grafana"], compose["metrics"]
    assert prometheus["profiles"] == ["grafana"] and grafana["profiles"] == ["grafana"]
    assert "profiles" not in metrics  # the exporter runs in the default set

    def mounts(service: dict[str, Any]) -> dict[str, Path]:
        return {v.split(":")[1]: ROOT / v.split(":")[0] for v in service["volumes"] if v.startswith("./")}

    scrape_config = mounts(prometheus)["/etc/prometheus/prometheus.yml"]
    assert scrape_config == GRAFANA / "prometheus.yml"
    config = yaml.safe_load(scrape_config.read_text())
    assert [mounts(prometheus)[path] for path in config["rule_files"]] == [ALERTS]
    (job,) = config["scrape_configs"]
    port = metrics["command"][metrics["command"].index("--port") + 1]
    assert job["static_configs"][0]["targets"] == [f"metrics:{port}"]
    grafana_mounts = mounts(grafana)
    assert grafana_mounts["/etc/grafana/provisioning"] == GRAFANA / "provisioning"
    assert grafana_mounts["/var/lib/grafana/dashboards"] == DASHBOARD.parent
    provider = yaml.safe_load((GRAFANA / "provisioning/dashboards/tokenmill.yaml").read_text())
    assert provider["providers"][0]["options"]["path"] == "/var/lib/grafana/dashboards"
    datasources = yaml.safe_load((GRAFANA / "provisioning/datasources/prometheus.yaml").read_text())
    (source,) = datasources["datasources"]
    assert source["url"] == "http://prometheus:9090" and "9090:9090" in prometheus["ports"][0]


def test_each_alert_fires_after_its_delay_on_a_moving_run_and_not_on_a_finished_one(tmp_path: Path) -> None:
    # promtool evaluates the rules over synthetic series (Debian's `prometheus` package has it)
    promtool = shutil.which("promtool")
    assert promtool, "promtool is not installed: `make browser-env` installs it (Debian's prometheus)"
    series = {
        'tokenmill_run_paused{run="r"}': "0 0 1x40",
        'tokenmill_run_paused{run="done"}': "0x42",
    }
    cases = []
    for rule in alert_rules():
        if rule["alert"] == "TokenmillRunPaused":
            cases.append(
                {"eval_time": "3m", "alertname": rule["alert"], "exp_alerts": [_fired(rule, 1, run="r")]}
            )
            continue
        if rule["alert"] == "TokenmillReferenceDown":
            delay = int(rule["for"][:-1])
            series['tokenmill_quality_reference_up{run="r",partition="A"}'] = "1 1 0x40"
            series['tokenmill_jobs{run="r",partition="A",state="queued"}'] = "5x42"
            fired = [_fired(rule, 0, run="r", partition="A")]
            for minutes, alerts in ((delay, []), (delay + 3, fired)):  # down from minute 2
                cases.append({"eval_time": f"{minutes}m", "alertname": rule["alert"], "exp_alerts": alerts})
            continue
        match = re.search(r'signal="(\w+)"\}\s*>\s*([\d.]+)', rule["expr"])
        assert match, rule["alert"]
        signal, threshold = match.groups()
        delay, value = int(rule["for"][:-1]), float(threshold) * 1.5
        for run, queued in (("r", 5), ("done", 0)):  # a run with jobs queued, and a finished one
            labels = f'run="{run}",partition="A"'
            series[f'tokenmill_quality_rate{{{labels},signal="{signal}"}}'] = f"{value}x42"
            series[f"tokenmill_quality_judged_total{{{labels}}}"] = "100x42"
            series[f'tokenmill_jobs{{{labels},state="queued"}}'] = f"{queued}x42"
        alert = _fired(rule, value, run="r", partition="A", signal=signal)
        for minutes, fired in ((delay - 1, []), (delay + 1, [alert])):
            cases.append({"eval_time": f"{minutes}m", "alertname": rule["alert"], "exp_alerts": fired})
    spec = {
        "rule_files": [str(ALERTS)],
        "evaluation_interval": "1m",
        "tests": [
            {
                "interval": "1m",
                "input_series": [{"series": k, "values": v} for k, v in series.items()],
                "alert_rule_test": cases,
            }
        ],
    }
    path = tmp_path / "alerts_test.yml"
    path.write_text(yaml.safe_dump(spec))
    res = subprocess.run([promtool, "test", "rules", str(path)], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stdout + res.stderr


def _fired(rule: dict[str, Any], value: float, **labels: str) -> dict[str, Any]:
    """The alert ``rule`` raises on a series of ``labels`` at ``value``, its annotations rendered
    as Prometheus renders the templates they use."""

    def render(template: str) -> str:
        text = template.replace("{{ $value | humanizePercentage }}", f"{value * 100:.4g}%")
        text = text.replace("{{ $value }}", f"{value:.4g}")
        return re.sub(r"\{\{ \$labels\.(\w+) \}\}", lambda m: labels[m.group(1)], text)

    annotations = {k: render(v) for k, v in rule["annotations"].items()}
    return {"exp_labels": {**rule["labels"], **labels}, "exp_annotations": annotations}
