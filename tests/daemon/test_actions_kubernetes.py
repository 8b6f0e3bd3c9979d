"""Kubernetes node actions (kubernetes_asyncio) against a fake API server on loopback that answers as
the documented API does: taint + cordon at the notice, an Event per pod after the checkpoint."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import structlog

pytest.importorskip("kubernetes_asyncio", reason="kubernetes_asyncio missing: `make setup` (requirements-dev.txt)")

from spotguard.daemon.actions import Outcome, SubscriberOutcome  # noqa: E402
from spotguard.daemon.actions.kubernetes import EVENT_REASON, TAINT_KEY, KubernetesAction  # noqa: E402
from spotguard.daemon.app import StartupError  # noqa: E402
from spotguard.daemon.book import Entry  # noqa: E402
from spotguard.daemon.client import Subscription  # noqa: E402
from spotguard.notice import Cancel  # noqa: E402

from .conftest import FakeWatcher, make_notice, running_daemon  # noqa: E402
from .fake_kube import FakeKube, kubeconfig_env  # noqa: E402,F401  (a fixture)
from .loopback import assert_notices_prompt  # noqa: E402

NODE = "node-a"
RBAC = Path(__file__).resolve().parents[2] / "deploy" / "kubernetes" / "daemonset-node-actions" / "rbac.yaml"


def manifest_verbs() -> set[str]:
    """What the shipped ClusterRole grants: the fake API server allows exactly that, no more."""
    yaml = pytest.importorskip("yaml")
    role = next(d for d in yaml.safe_load_all(RBAC.read_text()) if d and d["kind"] == "ClusterRole")
    return {f"{v} {r}" for rule in role["rules"] for r in rule["resources"] for v in rule["verbs"]}


def pod_events(kube: FakeKube) -> list[dict]:
    return [e for e in kube.events if e["involvedObject"]["kind"] == "Pod"]


def node_events(kube: FakeKube) -> list[dict]:
    return [e for e in kube.events if e["involvedObject"]["kind"] == "Node"]


def our_taint(kube: FakeKube) -> list[dict]:
    return [t for t in kube.node["spec"].get("taints", []) if t["key"] == TAINT_KEY]


async def test_cordon_at_notice_and_event_after_checkpoint(sock_path: str, kubeconfig_env) -> None:
    async with FakeKube(node_name=NODE, allowed=manifest_verbs()) as kube:
        kube.add_pod("ml", "train-0")
        kubeconfig_env(kube)
        w = FakeWatcher("aws")
        async with running_daemon(sock_path, [w], node=NODE, kubernetes_node_actions=True) as d:
            a = await Subscription(sock_path, rank=0, pod="train-0", namespace="ml").open()
            b = await Subscription(sock_path, rank=1, pod="train-0", namespace="ml").open()
            await w.push(make_notice("aws-spot-k"))
            await a.next_notice(timeout=5)
            await b.next_notice(timeout=5)
            await kube.wait_for(lambda: kube.node["spec"].get("unschedulable") is True, what="cordon")
            (taint,) = our_taint(kube)
            assert (taint["value"], taint["effect"]) == ("preemption", "NoSchedule") and taint["timeAdded"].endswith("Z")
            assert {"key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule"} in kube.node["spec"]["taints"]
            patches = [e for e in kube.log if e[0] == "PATCH"]
            assert patches and all(p[3] == "application/strategic-merge-patch+json" for p in patches)
            await a.checkpoint_done("aws-spot-k", step=42)
            await a.status()
            await asyncio.sleep(0.2)
            assert pod_events(kube) == [], "an Event before every subscriber reported"
            await b.checkpoint_done("aws-spot-k", step=42)
            await kube.wait_for(lambda: len(pod_events(kube)) == 1, what="event")
            (ev,) = pod_events(kube)
            assert ev["reason"] == EVENT_REASON and ev["type"] == "Normal"
            assert ev["involvedObject"] == {"apiVersion": "v1", "kind": "Pod", "name": "train-0", "namespace": "ml",
                                            "uid": "uid-ml-train-0"}
            assert "checkpoint committed at step 42, exiting" in ev["message"] and ev["source"]["host"] == NODE
            await asyncio.sleep(0.2)
            assert len(pod_events(kube)) == 1, "one Event per pod, not per rank"
            await a.close()
            await b.close()
        assert d.metrics.actions.labels("kubernetes", "notice", "ok")._value.get() == 1
        assert d.metrics.actions.labels("kubernetes", "outcome", "ok")._value.get() == 1


async def test_stale_resource_version_conflict_is_reread_and_retried(sock_path: str, kubeconfig_env) -> None:
    async with FakeKube(node_name=NODE) as kube:
        kubeconfig_env(kube)
        w = FakeWatcher("gcp")
        with structlog.testing.capture_logs() as logs:
            async with running_daemon(sock_path, [w], node=NODE, kubernetes_node_actions=True):
                await kube.wait_for(lambda: len(kube.log) >= 1, what="the reconcile at start reads the node")
                kube.concurrent_writes = 2
                await w.push(make_notice("gcp-k", source="gcp"))
                await kube.wait_for(lambda: kube.node["spec"].get("unschedulable") is True, what="cordon")
        assert [s for m, _, s, _ in kube.log if m == "PATCH"] == [409, 409, 200]
        assert kube.node["metadata"]["labels"]["touched-by"] == "other-controller", "the other writer's change kept"
        assert len([r for r in logs if r["event"] == "kubernetes.conflict"]) == 2


async def test_missing_rbac_is_one_clear_line_and_not_retried(sock_path: str, kubeconfig_env) -> None:
    async with FakeKube(node_name=NODE, allowed={"get nodes", "get pods"}) as kube:
        kube.add_pod("ml", "train-0")
        kubeconfig_env(kube)
        w = FakeWatcher("azure")
        with structlog.testing.capture_logs() as logs:
            async with running_daemon(sock_path, [w], node=NODE, kubernetes_node_actions=True) as d:
                a = await Subscription(sock_path, pod="train-0", namespace="ml").open()
                await w.push(make_notice("az-k", source="azure"))
                await a.next_notice(timeout=5)
                await a.checkpoint_done("az-k", step=1)
                await kube.wait_for(lambda: any(s == 403 for m, p, s, _ in kube.log if p.endswith("/events")),
                                    what="event 403")
                await asyncio.sleep(0.3)
                await a.close()
        assert [s for m, _, s, _ in kube.log if m == "PATCH"] == [403]
        assert len([1 for m, p, s, _ in kube.log if p.endswith("/ml/events")]) == 1
        forbidden = [r for r in logs if r["event"] == "kubernetes.forbidden"]
        assert {r["missing"] for r in forbidden} == {"'patch nodes'", "'create events'"}
        assert all("rbac.yaml" in r["fix"] for r in forbidden)
        assert d.metrics.actions.labels("kubernetes", "notice", "failed")._value.get() == 1
        assert "unschedulable" not in kube.node["spec"]


async def test_no_event_for_a_pod_on_another_node_and_no_cordon_on_a_drill(sock_path: str, kubeconfig_env) -> None:
    async with FakeKube(node_name=NODE) as kube:
        kube.add_pod("ml", "elsewhere", node="node-b")
        kube.add_pod("ml", "here")
        kubeconfig_env(kube)
        w = FakeWatcher("aws")
        with structlog.testing.capture_logs() as logs:
            async with running_daemon(sock_path, [w], node=NODE, kubernetes_node_actions=True):
                a = await Subscription(sock_path, pod="elsewhere", namespace="ml").open()
                b = await Subscription(sock_path, pod="here", namespace="ml").open()
                await w.push(make_notice("drill-1", source="drill"))
                await a.next_notice(timeout=5)
                await b.next_notice(timeout=5)
                await a.checkpoint_done("drill-1", step=3)
                await b.checkpoint_failed("drill-1", "disk full")
                await kube.wait_for(lambda: len(kube.events) == 1, what="event")
                await asyncio.sleep(0.2)
                await a.close()
                await b.close()
        (ev,) = kube.events
        assert ev["involvedObject"]["name"] == "here" and ev["type"] == "Warning" and "FAILED (disk full)" in ev["message"]
        assert not any(m == "PATCH" for m, *_ in kube.log), "a drill must not cordon the node"
        assert any(r["event"] == "kubernetes.pod_elsewhere" and r["pod_node"] == "node-b" for r in logs)


async def test_a_withdrawn_notice_uncordons(sock_path: str, kubeconfig_env) -> None:
    async with FakeKube(node_name=NODE) as kube:
        kubeconfig_env(kube)
        w = FakeWatcher("aws")
        async with running_daemon(sock_path, [w], node=NODE, kubernetes_node_actions=True):
            await w.push(make_notice("aws-sched-1", kind="termination"))
            await kube.wait_for(lambda: kube.node["spec"].get("unschedulable") is True, what="cordon")
            await w.push(Cancel(id="aws-sched-1", source="aws"))
            await kube.wait_for(lambda: kube.node["spec"].get("unschedulable") is False, what="uncordon")
        assert our_taint(kube) == [] and kube.node["spec"]["taints"][0]["key"] == "nvidia.com/gpu"


async def test_in_cluster_service_account_over_tls(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The in-cluster path: KUBERNETES_SERVICE_HOST/PORT, the mounted token and CA, HTTPS."""
    async with FakeKube(node_name=NODE, tls_dir=tmp_path) as kube:
        kube.add_pod("ml", "p")
        monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "127.0.0.1")
        monkeypatch.setenv("KUBERNETES_SERVICE_PORT", str(kube.port))
        monkeypatch.delenv("KUBECONFIG", raising=False)
        act = KubernetesAction(NODE, service_account_dir=str(tmp_path))
        await act.start()
        try:
            notice = make_notice("gcp-tls", source="gcp", kind="termination")
            assert await act.on_notice(Entry(notice=notice), NODE) is True
            outcome = Outcome(notice, NODE, "reported",
                              (SubscriberOutcome(client=1, state="checkpoint_done", step=9, pod="p", namespace="ml"),))
            assert await act.on_outcome(outcome) is True
            assert await act.on_outcome(outcome) is True, "a repeat is 409 AlreadyExists: still fine"
        finally:
            await act.close()
        assert kube.node["spec"]["unschedulable"] is True and len(pod_events(kube)) == 1
        assert [s for m, p, s, _ in kube.log if p.endswith("/ml/events")] == [201, 409]


async def test_no_credentials_or_no_node_is_a_startup_error(sock_path: str, tmp_path: Path,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    monkeypatch.delenv("KUBECONFIG", raising=False)
    with pytest.raises(StartupError, match="no Kubernetes credentials"):
        async with running_daemon(sock_path, [], node=NODE, kubernetes_node_actions=True):
            pass
    with pytest.raises(StartupError, match="spec.nodeName"):
        async with running_daemon(sock_path, [], node="", kubernetes_node_actions=True):
            pass


async def test_hanging_api_server_never_delays_notices(sock_path: str, kubeconfig_env) -> None:
    async with FakeKube(node_name=NODE, hang=True) as kube:
        kubeconfig_env(kube)
        w = FakeWatcher("aws")
        async with running_daemon(sock_path, [w], node=NODE, kubernetes_node_actions=True):
            a = await Subscription(sock_path, pod="p", namespace="ml").open()
            await w.push(make_notice("aws-h0"))
            await a.next_notice(timeout=5)
            await a.checkpoint_done("aws-h0", step=1)
            await kube.wait_for(lambda: kube.arrivals >= 1, what="the cordon request, now hanging")
            await assert_notices_prompt(w.push, a, make_notice, "aws-hx")
            await a.close()
