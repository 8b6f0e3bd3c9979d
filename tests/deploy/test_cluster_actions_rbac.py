"""RBAC for --kubernetes-node-actions: the Kustomize overlay (kubectl kustomize) and the Helm chart
grant exactly nodes get/patch, pods get, events create to the daemon's ServiceAccount, mount its
token, and turn the action on; everything validates against the Kubernetes schemas. The same
rules drive the fake API server in tests/daemon/test_actions_kubernetes.py, so a missing verb
fails there as a 403."""

from __future__ import annotations

from pathlib import Path
from typing import Any


from .conftest import REPO, load_yaml_docs, require_tool, run
from .test_helm import helm_template
from .test_kubernetes import K8S_VERSIONS, validate

OVERLAY = REPO / "deploy" / "kubernetes" / "daemonset-node-actions"
LEAST_PRIVILEGE = {"get nodes", "patch nodes", "get pods", "create events"}


def verbs(role: dict[str, Any]) -> set[str]:
    out = set()
    for rule in role["rules"]:
        assert rule["apiGroups"] == [""], rule
        assert "resourceNames" not in rule and "nonResourceURLs" not in rule
        out |= {f"{v} {r}" for r in rule["resources"] for v in rule["verbs"]}
    return out


def check(docs: list[dict[str, Any]], namespace: str) -> None:
    by_kind = {d["kind"]: d for d in docs}
    assert sorted(by_kind) == ["ClusterRole", "ClusterRoleBinding", "DaemonSet", "ServiceAccount"]
    for doc in docs:
        for version in K8S_VERSIONS:
            validate(doc, version)
    role, binding, ds, sa = (by_kind[k] for k in ("ClusterRole", "ClusterRoleBinding", "DaemonSet", "ServiceAccount"))
    assert verbs(role) == LEAST_PRIVILEGE
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole",
                                  "name": role["metadata"]["name"]}
    spec = ds["spec"]["template"]["spec"]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": spec["serviceAccountName"],
                                    "namespace": namespace}]
    assert sa["metadata"]["name"] == spec["serviceAccountName"]
    assert spec["automountServiceAccountToken"] is True, "the action needs the service-account token"
    env = {e["name"]: e for e in next(c for c in spec["containers"] if c["name"] == "spotguard")["env"]}
    assert env["SPOTGUARD_KUBERNETES_NODE_ACTIONS"]["value"] == "1"
    assert env["SPOTGUARD_NODE"]["valueFrom"] == {"fieldRef": {"fieldPath": "spec.nodeName"}}


def test_kustomize_overlay_grants_least_privilege() -> None:
    kubectl = require_tool("kubectl")
    docs = load_yaml_docs(run([kubectl, "kustomize", str(OVERLAY)], timeout=60).stdout)
    check(docs, "kube-system")


def test_helm_chart_rbac_only_when_enabled(tmp_path: Path) -> None:
    docs = helm_template({"actions": {"kubernetesNodeActions": True}}, tmp_path)
    check(docs, "kube-system")
    off = helm_template(None, tmp_path)
    assert not any(d["kind"].startswith("ClusterRole") for d in off)
    ds = next(d for d in off if d["kind"] == "DaemonSet")
    assert ds["spec"]["template"]["spec"]["automountServiceAccountToken"] is False, "off by default: no token"


def manifest_rbac() -> set[str]:
    """The verbs deploy/kubernetes/daemonset-node-actions/rbac.yaml grants (used by the daemon tests)."""
    docs = load_yaml_docs((OVERLAY / "rbac.yaml").read_text())
    return verbs(next(d for d in docs if d["kind"] == "ClusterRole"))


def test_manifest_rbac_is_the_least_privilege_set() -> None:
    assert manifest_rbac() == LEAST_PRIVILEGE
