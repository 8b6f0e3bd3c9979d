"""deploy/helm/spotguard: `helm lint` + `helm template` where helm is installed; otherwise
the chart is rendered by tests/deploy/gotemplate.py (the Go-template subset it uses).
Either way the output validates against the Kubernetes schemas and matches the
Kustomize DaemonSet's spotguard container.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from .conftest import REPO, find_tool, load_yaml_docs, require_tool, run
from .test_kubernetes import K8S_VERSIONS, render, validate

CHART = REPO / "deploy" / "helm" / "spotguard"


def helm_template(values: dict[str, Any] | None, tmp_path: Path) -> list[dict[str, Any]]:
    helm = find_tool("helm")
    if helm:
        args = [helm, "template", "spotguard", str(CHART), "--namespace", "kube-system"]
        if values:
            import yaml
            vf = tmp_path / "values.yaml"
            vf.write_text(yaml.safe_dump(values))
            args += ["-f", str(vf)]
        return load_yaml_docs(run(args).stdout)
    from .gotemplate import render_chart
    return [d for text in render_chart(CHART, values=values).values() for d in load_yaml_docs(text)]


def test_chart_metadata() -> None:
    import yaml
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    assert chart["apiVersion"] == "v2" and chart["name"] == "spotguard" and chart["type"] == "application"
    assert chart["version"].count(".") == 2
    pyproject = (REPO / "pyproject.toml").read_text()
    assert f'version = "{chart["appVersion"]}"' in pyproject, "appVersion follows the package version"
    assert "1.29" in chart["kubeVersion"]


def test_helm_lint() -> None:
    helm = find_tool("helm")
    if not helm:
        pytest.skip("helm is not installable here (no Debian, PyPI or npm package usable on this machine ships the binary); "
                    "test_chart_renders_valid covers the templates with tests/deploy/gotemplate.py")
    run([helm, "lint", "--strict", str(CHART)])


@pytest.mark.parametrize("values", [None, {"hostNetwork": False, "priorityClassName": "",
                                           "podAnnotations": {"a": "b"}, "nodeSelector": {"spot": "true"},
                                           "daemon": {"cloud": "aws", "logFormat": "console", "sigtermGrace": 20, "sigtermNotice": True,
                                                      "metricsPort": 0, "extraEnv": [{"name": "SPOTGUARD_POLL_INTERVAL", "value": "1"}]},
                                           "imagePullSecrets": [{"name": "regcred"}]}],
                         ids=["defaults", "overrides"])
def test_chart_renders_valid(values: dict[str, Any] | None, tmp_path: Path) -> None:
    docs = helm_template(values, tmp_path)
    kinds = sorted(d["kind"] for d in docs)
    assert kinds == ["DaemonSet", "ServiceAccount"]
    for doc in docs:
        for version in K8S_VERSIONS:
            validate(doc, version)
    ds = next(d for d in docs if d["kind"] == "DaemonSet")
    spec = ds["spec"]["template"]["spec"]
    assert ds["spec"]["selector"]["matchLabels"].items() <= ds["spec"]["template"]["metadata"]["labels"].items()
    if values:
        assert spec["hostNetwork"] is False and "dnsPolicy" not in spec and "priorityClassName" not in spec
        c = next(c for c in spec["containers"] if c["name"] == "spotguard")
        env = {e["name"]: e.get("value") for e in c["env"]}
        assert env["SPOTGUARD_POLL_INTERVAL"] == "1" and env["SPOTGUARD_METRICS_PORT"] == "0"
        assert env["SPOTGUARD_SIGTERM_NOTICE"] == "1" and env["SPOTGUARD_SIGTERM_GRACE"] == "20"
        assert c["args"] == ["daemon", "--cloud", "aws"]
    else:
        c = next(c for c in spec["containers"] if c["name"] == "spotguard")
        assert "SPOTGUARD_SIGTERM_NOTICE" not in {e["name"] for e in c["env"]}  # SIGTERM is a clean stop


def test_chart_with_node_actions_matches_the_overlay_resources(tmp_path: Path) -> None:
    chart_ds = next(d for d in helm_template({"actions": {"kubernetesNodeActions": True}}, tmp_path)
                    if d["kind"] == "DaemonSet")
    kust = load_yaml_docs(run([require_tool("kubectl"), "kustomize",
                               str(REPO / "deploy" / "kubernetes" / "daemonset-node-actions")], timeout=60).stdout)
    kust_ds = next(d for d in kust if d["kind"] == "DaemonSet")
    ca, cb = (next(c for c in d["spec"]["template"]["spec"]["containers"] if c["name"] == "spotguard")
              for d in (chart_ds, kust_ds))
    assert ca["resources"] == cb["resources"]
    assert ca["livenessProbe"] == cb["livenessProbe"] and ca["readinessProbe"] == cb["readinessProbe"]


def test_chart_matches_kustomize_daemonset(tmp_path: Path) -> None:
    chart_ds = next(d for d in helm_template(None, tmp_path) if d["kind"] == "DaemonSet")
    kust_ds = next(d for d in render("daemonset") if d["kind"] == "DaemonSet")
    a, b = chart_ds["spec"]["template"]["spec"], kust_ds["spec"]["template"]["spec"]
    for key in ("hostNetwork", "dnsPolicy", "priorityClassName", "terminationGracePeriodSeconds",
                "securityContext", "volumes", "tolerations", "automountServiceAccountToken"):
        assert a.get(key) == b.get(key), key
    for name in ("spotguard", "socket-dir"):
        ca = next(c for c in a["initContainers"] + a["containers"] if c["name"] == name)
        cb = next(c for c in b["initContainers"] + b["containers"] if c["name"] == name)
        for key in ("args", "command", "env", "volumeMounts", "startupProbe", "readinessProbe", "livenessProbe",
                    "lifecycle", "resources", "securityContext"):
            assert ca.get(key) == cb.get(key), f"{name}.{key}"
