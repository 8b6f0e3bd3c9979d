"""deploy/prometheus alert rules and deploy/grafana dashboard, checked against a real daemon.

* ``promtool check rules`` and ``promtool test rules`` (the shipped unit tests with synthetic series);
* the rules evaluated by promtool over *scrapes of a real ``spotguard daemon``* taken before and
  after what should fire them (trainers vanish without a notice; a checkpoint fails);
* every ``spotguard_*`` metric that the rules and the dashboard reference is in a real daemon's
  ``/metrics``, and every dashboard expression parses (promtool).

promtool comes from Debian's ``prometheus`` package (``make deploy-tools`` installs it as root).
"""

from __future__ import annotations

import json
import re
import shutil
import socket
import subprocess
import time
import urllib.request
from pathlib import Path
from typing import Any, Callable

import pytest
import yaml

from spotguard.daemon.client import Subscription, request
from spotguard.protocol import Drill, DrillOk

from .conftest import REPO, DaemonProc

RULES = Path(REPO) / "deploy" / "prometheus" / "spotguard-alerts.yaml"
RULES_TEST = Path(REPO) / "deploy" / "prometheus" / "spotguard-alerts.test.yaml"
DASHBOARD = Path(REPO) / "deploy" / "grafana" / "spotguard-dashboard.json"
METRIC = re.compile(r"\bspotguard_[a-z_]+\b")
GRAFANA_VARS = {"$__rate_interval": "1m", "$__range": "1h", "$__interval": "1m", "$instance": ".*"}


def promtool() -> str:
    path = shutil.which("promtool")
    if path is None:
        pytest.skip("promtool is not installed: `make deploy-tools` installs Debian's prometheus package as root "
                    "(apt-get install prometheus)")
    return path


def run(cmd: list[str], cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=60, cwd=cwd)
    assert proc.returncode == 0, f"{' '.join(cmd)}:\n{proc.stdout}\n{proc.stderr}"
    return proc


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        return r.read().decode()


def exposed_names(text: str) -> set[str]:
    """Every series name the exposition can yield, also for labelled families with no sample yet."""
    from prometheus_client.parser import text_string_to_metric_families

    names: set[str] = set()
    for fam in text_string_to_metric_families(text):
        names.add(fam.name)
        names.update(s.name for s in fam.samples)
        suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "summary": ("_sum", "_count")}
        names.update(fam.name + s for s in suffixes.get(fam.type, ()))
    return names


def samples(text: str) -> dict[str, float]:
    """``series selector -> value`` of a scrape, with the labels a Prometheus scrape would add."""
    from prometheus_client.parser import text_string_to_metric_families

    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name.endswith("_created"):
                continue
            labels = {**s.labels, "instance": "real-node", "job": "spotguard"}
            sel = ", ".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
            out[f"{s.name}{{{sel}}}"] = s.value
    return out


def expressions() -> list[str]:
    groups = yaml.safe_load(RULES.read_text())["groups"]
    rules = [r["expr"] for g in groups for r in g["rules"]]
    dash = json.loads(DASHBOARD.read_text())
    rules += [t["expr"] for p in dash["panels"] for t in p["targets"]]
    rules += [a["expr"] for a in dash["annotations"]["list"] if "expr" in a]
    return rules


def test_promtool_checks_and_unit_tests_the_rules() -> None:
    tool = promtool()
    out = run([tool, "check", "rules", str(RULES)]).stdout
    assert "SUCCESS: 7 rules found" in out
    run([tool, "test", "rules", RULES_TEST.name], cwd=RULES_TEST.parent)


def test_alerts_use_the_healthz_signal_and_cover_a_down_or_absent_daemon() -> None:
    """Issue 24: the blind alert read spotguard_watcher_healthy (the last poll), not what /healthz and
    `status --check` use; nothing fired for a daemon that is down or not there at all."""
    rules = {r["alert"]: r["expr"] for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"]}
    assert "spotguard_watcher_seeing_notices" in rules["SpotguardWatcherBlind"]
    assert "spotguard_watcher_healthy" not in rules["SpotguardWatcherBlind"]
    assert rules["SpotguardDown"].startswith("up{") and rules["SpotguardAbsent"].startswith("absent(up{")


def test_shipped_scrape_config_is_valid_and_scrapes_the_daemonsets_port() -> None:
    """The loopback-only metrics need a node-local scraper: the shipped config checks with promtool, its
    job is the one the down/absent alerts select, and it scrapes the DaemonSet's metrics port."""
    tool = promtool()
    cfg_path = RULES.parent / "scrape-config.yaml"
    run([tool, "check", "config", str(cfg_path)])
    cfg = yaml.safe_load(cfg_path.read_text())
    (job,) = cfg["scrape_configs"]
    assert re.fullmatch(r"(.+/)?spotguard", job["job_name"])
    assert 'job=~"(.+/)?spotguard"' in RULES.read_text()
    ds = next(d for d in yaml.safe_load_all((Path(REPO) / "deploy" / "kubernetes" / "daemonset" /
                                             "daemonset.yaml").read_text()) if d and d["kind"] == "DaemonSet")
    env = {e["name"]: e.get("value") for c in ds["spec"]["template"]["spec"]["containers"] for e in c["env"]}
    assert job["static_configs"][0]["targets"] == [f"127.0.0.1:{env['SPOTGUARD_METRICS_PORT']}"]


def test_dashboard_shape_and_every_expression_parses(tmp_path: Path) -> None:
    dash = json.loads(DASHBOARD.read_text())
    assert dash["uid"] and dash["title"] == "spotguard" and dash["schemaVersion"] >= 36
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids)) and all(p["targets"] and p["gridPos"]["w"] > 0 for p in dash["panels"])
    assert {v["name"] for v in dash["templating"]["list"]} == {"datasource", "instance"}
    tool = promtool()
    exprs = [e for e in expressions()]
    rules = []
    for i, expr in enumerate(exprs):
        for var, value in GRAFANA_VARS.items():
            expr = expr.replace(var, value)
        rules.append({"record": f"spotguard:check_{i}", "expr": expr})
    path = tmp_path / "exprs.yaml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    run([tool, "check", "rules", str(path)])


def _alert_test(before: dict[str, float], after: dict[str, float], minutes_before: int, minutes_after: int,
                expect: dict[str, list[dict[str, str]]]) -> dict[str, Any]:
    """A promtool unit test whose input is two real scrapes: ``before`` for some minutes, then ``after``."""
    series = []
    for sel in sorted(set(before) | set(after)):
        a = [f"{before[sel]:g}" if sel in before else "_"] * minutes_before
        b = [f"{after[sel]:g}" if sel in after else "_"] * minutes_after
        series.append({"series": sel, "values": " ".join(a + b)})
    eval_time = f"{minutes_before + minutes_after - 1}m"
    return {"interval": "1m", "input_series": series,
            "alert_rule_test": [{"eval_time": eval_time, "alertname": name,
                                 "exp_alerts": [{"exp_labels": labels} for labels in alerts]}
                                for name, alerts in expect.items()]}


def _promtool_rules_test(tmp_path: Path, tests: list[dict[str, Any]]) -> subprocess.CompletedProcess[str]:
    tool = promtool()
    rules = tmp_path / "rules.yaml"
    # Annotations are the shipped unit tests' concern; here: which alerts fire, with which labels.
    doc = yaml.safe_load(RULES.read_text())
    for g in doc["groups"]:
        for r in g["rules"]:
            r.pop("annotations", None)
    rules.write_text(yaml.safe_dump(doc))
    spec = tmp_path / "real.test.yaml"
    spec.write_text(yaml.safe_dump({"rule_files": [rules.name], "evaluation_interval": "1m", "tests": tests}))
    return run([tool, "test", "rules", spec.name], cwd=tmp_path)


def wait(cond: Callable[[], bool], what: str, timeout: float = 10.0) -> None:
    end = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > end:
            raise AssertionError(f"timed out: {what}")
        time.sleep(0.05)


async def test_rules_fire_on_scrapes_of_a_real_daemon(spawn_daemon: Callable[..., DaemonProc], tmp_path: Path) -> None:
    promtool()
    port = free_port()
    d = spawn_daemon("--metrics-port", str(port))
    names = exposed_names(scrape(port))

    # 1. Trainers subscribed, then gone without any notice: SubscribersGone.
    sub = await Subscription(d.sock, rank=0).open()
    training = scrape(port)
    await sub.close()
    wait(lambda: "spotguard_subscribers 0.0" in scrape(port), "subscribers back to 0")
    crashed = scrape(port)

    # 2. Trainers subscribed, a preemption, a failed checkpoint, then gone: CheckpointFailed only.
    sub = await Subscription(d.sock, rank=0).open()
    before = scrape(port)
    reply = await request(d.sock, Drill(kind="preemption", deadline_in=60))
    assert isinstance(reply, DrillOk)
    await sub.next_notice(timeout=5)
    await sub.checkpoint_failed(reply.id, "bucket said 403")
    await sub.close()
    wait(lambda: "spotguard_checkpoint_failures_total 1.0" in scrape(port) and
         "spotguard_subscribers 0.0" in scrape(port), "failure counted, subscriber gone")
    failed = scrape(port)
    names |= exposed_names(failed)

    real = {"instance": "real-node", "job": "spotguard"}
    _promtool_rules_test(tmp_path, [
        _alert_test(samples(training), samples(crashed), 3, 9, {
            "SpotguardSubscribersGone": [{**real, "severity": "warning"}],
            "SpotguardCheckpointFailed": [],
            "SpotguardWatcherBlind": [],  # --cloud none: only the signal watcher, never "blind"
        }),
        _alert_test(samples(before), samples(failed), 3, 9, {
            "SpotguardCheckpointFailed": [{**real, "severity": "critical"}],
            "SpotguardSubscribersGone": [],  # a preemption explains the exit
            "SpotguardClusterActionFailed": [],
        }),
    ])

    # Every metric the rules and the dashboard use exists in the real daemon's exposition.
    used = {m for e in expressions() for m in METRIC.findall(e)}
    assert used and used <= names, f"not exposed by the daemon: {sorted(used - names)}"
