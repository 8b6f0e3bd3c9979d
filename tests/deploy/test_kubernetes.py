"""deploy/kubernetes: Kustomize renders (kubectl kustomize), the core objects validate
against the Kubernetes JSON schemas (kubernetes-validate, strict) for the versions the
docs state, the PyTorchJob CRD is checked structurally, and the security and sizing
rules hold for every spotguard container.
"""

from __future__ import annotations

import copy
from functools import lru_cache
from typing import Any

import pytest

from .conftest import REPO, load_yaml_docs, require_tool, run

KDIR = REPO / "deploy" / "kubernetes"
VARIANTS = ("sidecar", "daemonset", "pytorchjob")
#: docs/deploy.md: "Kubernetes 1.29 or newer" (native sidecars); checked at both ends.
K8S_VERSIONS = ("1.29.0", "1.33.0")
SPOTGUARD_UID = 10001
SOCKET_DIR = "/run/spotguard"
#: Idle VmRSS measured for `spotguard daemon` (docs/deploy.md, benchmarks/footprint.py): 45 MB.
MEASURED_RSS_MIB = 43
#: The same with every cluster action on (idle == at a notice: the clients are built at start): 101 MB.
MEASURED_ACTIONS_RSS_MIB = 97
#: One exec probe's peak RSS, a second Python process in the container's cgroup: --check 24 MB, --live 13 MB.
PROBES_RSS_MIB = 23 + 13


@lru_cache(maxsize=None)
def _render_text(variant: str) -> str:
    kubectl = require_tool("kubectl")
    return run([kubectl, "kustomize", str(KDIR / variant)], timeout=60).stdout


def render(variant: str) -> list[dict[str, Any]]:
    return copy.deepcopy(load_yaml_docs(_render_text(variant)))


def validate(doc: dict[str, Any], version: str) -> None:
    kv = pytest.importorskip("kubernetes_validate", reason="kubernetes-validate missing: `make deploy-tools`")
    try:
        kv.validate(doc, version, strict=True)
    except kv.ValidationError as exc:  # pragma: no cover - message for the failure
        raise AssertionError(f"{doc.get('kind')}/{doc['metadata'].get('name')} invalid for Kubernetes {version}: "
                             f"{'.'.join(map(str, exc.path))}: {exc.message}") from None


def pod_spec(doc: dict[str, Any]) -> dict[str, Any]:
    kind = doc["kind"]
    if kind in ("Job", "DaemonSet", "Deployment", "StatefulSet"):
        return doc["spec"]["template"]["spec"]
    if kind == "PyTorchJob":
        return doc["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]
    raise KeyError(kind)


def mib(q: str) -> float:
    units = {"Ki": 1 / 1024, "Mi": 1, "Gi": 1024, "M": 1e6 / 2**20, "G": 1e9 / 2**20}
    for suffix, factor in units.items():
        if q.endswith(suffix):
            return float(q[: -len(suffix)]) * factor
    return float(q) / 2**20


def millicores(q: str) -> float:
    return float(q[:-1]) if q.endswith("m") else float(q) * 1000


def env_of(container: dict[str, Any]) -> dict[str, str]:
    return {e["name"]: e.get("value", "") for e in container.get("env", [])}


def spotguard_container(spec: dict[str, Any]) -> dict[str, Any]:
    found = [c for c in spec.get("initContainers", []) + spec["containers"] if c["name"] == "spotguard"]
    assert len(found) == 1, "exactly one spotguard container per pod"
    return found[0]


# ---------------------------------------------------------------- rendering + schemas


@pytest.mark.parametrize("variant", VARIANTS)
def test_kustomize_renders(variant: str) -> None:
    docs = render(variant)
    assert docs, f"{variant} rendered nothing"
    images = [c["image"] for d in docs if d["kind"] != "ServiceAccount"
              for c in pod_spec(d).get("initContainers", []) + pod_spec(d)["containers"]]
    assert all(":" in i.rsplit("/", 1)[-1] for i in images), f"untagged images: {images}"
    if variant != "pytorchjob":  # its workers use the node's DaemonSet
        assert any(i.rsplit("/", 1)[-1].startswith("spotguard:") for i in images)


@pytest.mark.parametrize("version", K8S_VERSIONS)
@pytest.mark.parametrize("variant", ("sidecar", "daemonset"))
def test_schema_valid(variant: str, version: str) -> None:
    for doc in render(variant):
        validate(doc, version)


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_pytorchjob_pod_template_schema_valid(version: str) -> None:
    """The CRD's pod template is a core PodTemplateSpec: validate it as a v1 PodTemplate."""
    (job,) = render("pytorchjob")
    for rtype, rspec in job["spec"]["pytorchReplicaSpecs"].items():
        wrapper = {"apiVersion": "v1", "kind": "PodTemplate",
                   "metadata": {"name": f"{job['metadata']['name']}-{rtype.lower()}"},
                   "template": rspec["template"]}
        validate(wrapper, version)


def test_schema_validation_is_really_validating() -> None:
    """Guard: strict validation rejects an unknown field, and a native sidecar before 1.28."""
    kv = pytest.importorskip("kubernetes_validate")
    (job,) = render("sidecar")
    bad = copy.deepcopy(job)
    bad["spec"]["template"]["spec"]["containers"][0]["bogusField"] = 1
    with pytest.raises(kv.ValidationError):
        kv.validate(bad, K8S_VERSIONS[0], strict=True)
    with pytest.raises(kv.ValidationError):
        kv.validate(job, "1.27.0", strict=True)


# ---------------------------------------------------------------- the contract


@pytest.mark.parametrize("variant", ("sidecar", "daemonset"))
def test_spotguard_container_is_locked_down_and_sized(variant: str) -> None:
    for doc in render(variant):
        if doc["kind"] == "ServiceAccount":
            continue
        spec = pod_spec(doc)
        c = spotguard_container(spec)
        sc = c["securityContext"]
        assert sc["runAsNonRoot"] is True and sc["runAsUser"] == SPOTGUARD_UID
        assert sc["readOnlyRootFilesystem"] is True
        assert sc["allowPrivilegeEscalation"] is False
        assert sc["capabilities"] == {"drop": ["ALL"]}
        assert "privileged" not in sc or sc["privileged"] is False
        seccomp = sc.get("seccompProfile") or spec.get("securityContext", {}).get("seccompProfile")
        assert seccomp == {"type": "RuntimeDefault"}
        # From the measured footprint, with headroom for the exec probe's second Python process.
        req, lim = c["resources"]["requests"], c["resources"]["limits"]
        assert MEASURED_RSS_MIB < mib(req["memory"]) <= mib(lim["memory"]) <= 4 * MEASURED_RSS_MIB
        assert 1 <= millicores(req["cpu"]) <= 100 and millicores(lim["cpu"]) >= 100
        assert mib(lim["memory"]) >= 1.5 * (MEASURED_RSS_MIB + PROBES_RSS_MIB), "50 % above daemon + both probes"
        check_probes(c, variant)
        # SIGTERM is a clean stop: no variant may turn it into a notice (a rollout would stop training).
        assert env_of(c).get("SPOTGUARD_SIGTERM_NOTICE", "0") in ("0", "false", "")
        assert env_of(c)["SPOTGUARD_SOCKET"] == f"{SOCKET_DIR}/spotguard.sock"
        assert {"name": "spotguard-run", "mountPath": SOCKET_DIR} in c["volumeMounts"]
        # No other container in the pod is privileged or may escalate.
        for other in spec.get("initContainers", []) + spec["containers"]:
            osc = other.get("securityContext", {})
            assert not osc.get("privileged") and osc.get("allowPrivilegeEscalation") is False, other["name"]


def check_probes(c: dict[str, Any], variant: str) -> None:
    """Liveness = serving the socket (`status --live`): a blind metadata path never restarts the daemon
    (issue 24: CrashLoopBackOff, no daemon at all). Readiness = "I can see notices" (`status --check`)."""
    assert c["livenessProbe"]["exec"]["command"][:3] == ["spotguard", "status", "--live"]
    assert c["readinessProbe"]["exec"]["command"][:3] == ["spotguard", "status", "--check"]
    start = c["startupProbe"]
    if variant == "sidecar":  # gates the trainer until the daemon sees notices; Azure's 2-minute first answer
        assert start["exec"]["command"][:3] == ["spotguard", "status", "--check"]
        assert start["periodSeconds"] * start["failureThreshold"] >= 150
    else:  # a blind node's daemon stays up and NotReady (alerted), it does not crash-loop at start
        assert start["exec"]["command"][:3] == ["spotguard", "status", "--live"]


def test_node_actions_overlay_is_sized_for_every_action_and_the_probes() -> None:
    docs = load_yaml_docs(run([require_tool("kubectl"), "kustomize", str(KDIR / "daemonset-node-actions")],
                              timeout=60).stdout)
    c = spotguard_container(pod_spec(next(d for d in docs if d["kind"] == "DaemonSet")))
    req, lim = c["resources"]["requests"], c["resources"]["limits"]
    assert MEASURED_ACTIONS_RSS_MIB < mib(req["memory"]) <= mib(lim["memory"])
    assert mib(lim["memory"]) >= 1.3 * (MEASURED_ACTIONS_RSS_MIB + PROBES_RSS_MIB), "30 % above daemon + probes"
    check_probes(c, "daemonset")


@pytest.mark.parametrize("variant", ("sidecar",))
def test_native_sidecar_shares_socket_with_trainer(variant: str) -> None:
    (doc,) = render(variant)
    spec = pod_spec(doc)
    sidecar = spotguard_container(spec)
    assert sidecar in spec["initContainers"] and sidecar.get("restartPolicy") == "Always", "native sidecar expected"
    vols = {v["name"]: v for v in spec["volumes"]}
    assert "emptyDir" in vols["spotguard-run"]
    trainer = [c for c in spec["containers"] if c["name"] != "spotguard"]
    assert len(trainer) == 1
    t = trainer[0]
    assert {"name": "spotguard-run", "mountPath": SOCKET_DIR} in t["volumeMounts"]
    e = env_of(t)
    assert e["SPOTGUARD_SOCKET"] == env_of(sidecar)["SPOTGUARD_SOCKET"]
    assert e["SPOTGUARD_STORAGE"].split("://")[0] in ("s3", "gs", "az", "file")
    # Socket mode 0660, group 10001: the trainer must carry that group.
    psc = spec["securityContext"]
    assert psc.get("fsGroup") == SPOTGUARD_UID or SPOTGUARD_UID in psc.get("supplementalGroups", [])
    # Sized to the notice: longer than the 25 s a GCP/Azure checkpoint may take, within AWS's 120 s.
    assert 25 <= spec["terminationGracePeriodSeconds"] <= 120
    assert_trainer_termination_ordering(spec, t)


def assert_trainer_termination_ordering(spec: dict[str, Any], trainer: dict[str, Any]) -> None:
    """preStop waits for the active notice's checkpoint within the grace period; the hook's SIGTERM
    grace fits both the pod's grace period and torchrun's 30 s."""
    cmd = trainer["lifecycle"]["preStop"]["exec"]["command"]
    assert cmd[:2] == ["spotguard", "wait-checkpoint"]
    assert float(cmd[cmd.index("--timeout") + 1]) < spec["terminationGracePeriodSeconds"]
    grace = float(env_of(trainer)["SPOTGUARD_SIGNAL_GRACE"])
    assert 0 < grace <= min(30, spec["terminationGracePeriodSeconds"])


def test_pytorchjob_uses_the_node_daemonset() -> None:
    """The recommended Kubernetes mode (docs/deploy.md): workers share the DaemonSet's hostPath socket."""
    (job,) = render("pytorchjob")
    spec = pod_spec(job)
    assert not [c for c in spec.get("initContainers", []) + spec["containers"] if c["name"] == "spotguard"]
    vols = {v["name"]: v for v in spec["volumes"]}
    ds_spec = pod_spec(next(d for d in render("daemonset") if d["kind"] == "DaemonSet"))
    ds_vol = {v["name"]: v for v in ds_spec["volumes"]}["spotguard-run"]["hostPath"]["path"]
    assert vols["spotguard-run"]["hostPath"] == {"path": ds_vol, "type": "Directory"}
    assert SPOTGUARD_UID in spec["securityContext"]["supplementalGroups"]
    (worker,) = [c for c in spec["containers"] if c["name"] == "pytorch"]
    assert env_of(worker)["SPOTGUARD_SOCKET"] == f"{SOCKET_DIR}/spotguard.sock"
    assert {"name": "spotguard-run", "mountPath": SOCKET_DIR} in worker["volumeMounts"]
    # GKE: 15 s at node shutdown.
    assert spec["terminationGracePeriodSeconds"] == 15 and env_of(worker)["SPOTGUARD_SIGNAL_GRACE"] == "15"
    assert_trainer_termination_ordering(spec, worker)


def test_job_restarts_after_preemption() -> None:
    (job,) = render("sidecar")
    assert job["spec"]["template"]["spec"]["restartPolicy"] == "Never"  # required by podFailurePolicy
    rules = job["spec"]["podFailurePolicy"]["rules"]
    assert any(r["action"] == "Ignore" and r.get("onPodConditions", [{}])[0].get("type") == "DisruptionTarget" for r in rules)
    assert any(r["action"] == "Ignore" and 143 in r.get("onExitCodes", {}).get("values", []) for r in rules)
    assert job["spec"]["backoffLimit"] >= 3


def test_daemonset_host_network_and_host_socket() -> None:
    docs = {d["kind"]: d for d in render("daemonset")}
    ds = docs["DaemonSet"]
    spec = pod_spec(ds)
    assert ds["metadata"]["namespace"] == "kube-system"
    assert spec["hostNetwork"] is True and spec["dnsPolicy"] == "ClusterFirstWithHostNet"
    assert spec["priorityClassName"] == "system-node-critical"
    assert spec["automountServiceAccountToken"] is False
    assert docs["ServiceAccount"]["automountServiceAccountToken"] is False
    vols = {v["name"]: v for v in spec["volumes"]}
    assert vols["spotguard-run"]["hostPath"]["path"] == SOCKET_DIR
    assert any(t.get("operator") == "Exists" for t in spec["tolerations"])
    # The one root step: chown of the hostPath directory, with CHOWN/FOWNER only.
    (init,) = spec["initContainers"]
    isc = init["securityContext"]
    assert isc["capabilities"] == {"drop": ["ALL"], "add": ["CHOWN", "FOWNER"]}
    assert isc["readOnlyRootFilesystem"] is True and isc["allowPrivilegeEscalation"] is False
    assert f"{SPOTGUARD_UID}:{SPOTGUARD_UID}" in " ".join(init["command"])
    # A drain waits for the trainers' checkpoint within the grace period; a rollout does not wait.
    cmd = spotguard_container(spec)["lifecycle"]["preStop"]["exec"]["command"]
    assert cmd[:2] == ["spotguard", "wait-checkpoint"]
    assert float(cmd[cmd.index("--timeout") + 1]) < spec["terminationGracePeriodSeconds"]
    sel = ds["spec"]["selector"]["matchLabels"]
    assert sel.items() <= ds["spec"]["template"]["metadata"]["labels"].items()


# ---------------------------------------------------------------- PyTorchJob (CRD)


def test_pytorchjob_structure() -> None:
    """What the Kubeflow training operator's admission webhook and controller require."""
    (job,) = render("pytorchjob")
    assert job["apiVersion"] == "kubeflow.org/v1" and job["kind"] == "PyTorchJob"
    name = job["metadata"]["name"]
    assert len(name) <= 63 and name[0].isalpha() and all(ch.isalnum() or ch == "-" for ch in name) and name == name.lower()
    spec = job["spec"]
    assert set(spec) <= {"elasticPolicy", "nprocPerNode", "runPolicy", "pytorchReplicaSpecs"}
    ep = spec["elasticPolicy"]
    assert set(ep) <= {"minReplicas", "maxReplicas", "rdzvBackend", "rdzvPort", "rdzvHost", "rdzvId",
                       "rdzvConf", "standalone", "maxRestarts", "metrics", "nProcPerNode"}
    assert "nProcPerNode" not in ep, "deprecated: use spec.nprocPerNode"
    assert ep["rdzvBackend"] == "c10d"
    assert isinstance(ep["minReplicas"], int) and isinstance(ep["maxReplicas"], int)
    assert 1 <= ep["minReplicas"] < ep["maxReplicas"], "elastic: MIN < MAX"
    assert isinstance(ep["maxRestarts"], int) and ep["maxRestarts"] >= 1
    assert isinstance(spec["nprocPerNode"], str)
    rs = spec["pytorchReplicaSpecs"]
    assert set(rs) <= {"Master", "Worker"} and "Worker" in rs, "elastic policy needs Worker replicas"
    worker = rs["Worker"]
    assert ep["minReplicas"] <= worker["replicas"] <= ep["maxReplicas"]
    assert worker["restartPolicy"] in ("Always", "OnFailure", "ExitCode", "Never")
    assert worker["restartPolicy"] in ("OnFailure", "ExitCode"), "a preempted worker must be restarted"
    containers = worker["template"]["spec"]["containers"]
    assert any(c["name"] == "pytorch" for c in containers), "the operator needs a container named pytorch"
    assert all(c.get("image") for c in containers)
    pytorch = next(c for c in containers if c["name"] == "pytorch")
    assert pytorch["command"][0] == "torchrun"
    rp = spec["runPolicy"]
    assert rp["cleanPodPolicy"] in ("None", "Running", "All") and rp["backoffLimit"] >= ep["maxRestarts"] // 2
