"""The lighthouse deployment files (systemd unit, Kubernetes Deployment/Service) and ``lighthouse_args``.

The flags in both files are the ones ``lighthouse_args`` computes for the
documented job, and the real ``torchft_lighthouse`` accepts them and listens.
"""

from __future__ import annotations

import shlex
from pathlib import Path

import pytest

from spotguard.torchft.engine import lighthouse_args
from spotguard.torchft.launch import lighthouse_binary, start_lighthouse

REPO = Path(__file__).resolve().parents[2]
UNIT = REPO / "systemd" / "torchft-lighthouse.service"
K8S = REPO / "deploy" / "kubernetes" / "torchft-lighthouse" / "lighthouse.yaml"
DOCUMENTED = lighthouse_args(groups=3, step_seconds=1.0, notice_lead_seconds=30)


def _unit_flags() -> list[str]:
    line = next(x for x in UNIT.read_text().splitlines() if x.startswith("ExecStart="))
    argv = shlex.split(line.split("=", 1)[1])
    assert argv[1:3] == ["--bind", "[::]:29510"]
    return argv[3:]


def _k8s_docs() -> list[dict]:
    yaml = pytest.importorskip("yaml")
    return [d for d in yaml.safe_load_all(K8S.read_text()) if d]


def test_lighthouse_args_follow_the_step_time() -> None:
    fast = dict(zip(*[iter(lighthouse_args(groups=3, step_seconds=0.1))] * 2))
    slow = dict(zip(*[iter(lighthouse_args(groups=3, step_seconds=10.0, notice_lead_seconds=120))] * 2))
    assert fast["--join_timeout_ms"] == "200" and slow["--join_timeout_ms"] == "1000"
    assert int(fast["--quorum_tick_ms"]) <= int(fast["--join_timeout_ms"]) // 4
    assert slow["--heartbeat_timeout_ms"] == "5000"
    with pytest.raises(ValueError):
        lighthouse_args(groups=0, step_seconds=1.0)


def test_unit_and_deployment_carry_the_documented_flags() -> None:
    assert _unit_flags() == DOCUMENTED
    dep = next(d for d in _k8s_docs() if d["kind"] == "Deployment")
    (c,) = dep["spec"]["template"]["spec"]["containers"]
    assert c["command"] == ["torchft_lighthouse"]
    assert c["args"][:2] == ["--bind", "[::]:29510"] and c["args"][2:] == DOCUMENTED
    assert dep["spec"]["replicas"] == 1  # quorum state lives in one process
    svc = next(d for d in _k8s_docs() if d["kind"] == "Service")
    assert svc["spec"]["selector"] == dep["spec"]["selector"]["matchLabels"]
    assert svc["spec"]["ports"][0]["port"] == 29510


@pytest.mark.parametrize("version", ["1.29.0", "1.33.0"])
def test_kubernetes_objects_are_schema_valid(version: str) -> None:
    kv = pytest.importorskip("kubernetes_validate", reason="kubernetes-validate missing: `make deploy-tools`")
    for doc in _k8s_docs():
        kv.validate(doc, version, strict=True)


def test_the_real_lighthouse_accepts_the_flags(tmp_path: Path) -> None:
    if lighthouse_binary() is None:
        pytest.skip("torchft_lighthouse not installed: `make torchft-tools`")
    lh = start_lighthouse(_unit_flags(), tmp_path / "lh.log")
    try:
        assert lh.proc.poll() is None
    finally:
        lh.stop()


def test_unit_is_locked_down() -> None:
    import re
    import shutil
    import subprocess

    sa = shutil.which("systemd-analyze")
    if sa is None:
        pytest.skip("systemd-analyze not installed (`make deploy-tools` installs it as root)")
    out = subprocess.run([sa, "security", "--offline=yes", str(UNIT)], capture_output=True, text=True,
                         timeout=60).stdout
    m = re.search(r"Overall exposure level for \S+: ([0-9.]+)", out)
    assert m is not None, out[-500:]
    assert float(m.group(1)) <= 3.0
