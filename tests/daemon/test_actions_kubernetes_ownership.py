"""Cordon ownership (issue 24): spotguard annotates what it did to the Node, undoes only that, at start, on
expiry and on cancel, and never while another notice is active; Node Events like NTH's. Against the fake
API server (tests/daemon/fake_kube.py), written from the documented API."""

from __future__ import annotations

import asyncio
import dataclasses
import re
from pathlib import Path
from typing import Any

import pytest
import structlog

pytest.importorskip("kubernetes_asyncio", reason="kubernetes_asyncio missing: `make setup` (requirements-dev.txt)")

from spotguard.daemon.actions import Outcome, SubscriberOutcome  # noqa: E402
from spotguard.daemon.actions import kubernetes as k8s  # noqa: E402
from spotguard.daemon.actions.kubernetes import TAINT_KEY, KubernetesAction  # noqa: E402
from spotguard.daemon.book import Entry  # noqa: E402
from spotguard.notice import Cancel, Notice  # noqa: E402

from .conftest import FakeWatcher, eventually, make_notice, running_daemon  # noqa: E402
from .fake_kube import FakeKube, kubeconfig_env  # noqa: E402,F401  (a fixture)

NODE = "node-a"
REPO = Path(__file__).resolve().parents[2]


def ours(kube: FakeKube) -> list[dict[str, Any]]:
    return [t for t in kube.node["spec"].get("taints", []) if t["key"] == TAINT_KEY]


def cordoned(kube: FakeKube) -> bool:
    return kube.node["spec"].get("unschedulable") is True


def keyed(nid: str, **kw: Any) -> Notice:
    """A watcher notice with a content key: persisted next to the socket, restored after a restart."""
    return dataclasses.replace(make_notice(nid, **kw), key=f"key-{nid}")


def test_rbac_fix_names_a_file_that_exists() -> None:
    paths = re.findall(r"deploy/[\w./-]+\.yaml", k8s.RBAC_FIX)
    assert paths and all((REPO / p).is_file() for p in paths), k8s.RBAC_FIX


async def test_taint_already_present_is_not_patched_again(kubeconfig_env) -> None:
    """The API server adds ``timeAdded`` to the taint: the idempotence check must not compare it."""
    async with FakeKube(node_name=NODE) as kube:
        kubeconfig_env(kube)
        act = KubernetesAction(NODE)
        await act.start()
        try:
            entry = Entry(notice=make_notice("aws-idem", kind="termination"))
            assert await act.on_notice(entry, NODE) is True
            assert await act.on_notice(entry, NODE) is True
        finally:
            await act.close()
        assert [m for m, *_ in kube.log if m == "PATCH"] == ["PATCH"], kube.log


async def test_node_events_for_cordon_outcome_and_uncordon(kubeconfig_env) -> None:
    async with FakeKube(node_name=NODE, allowed={"get nodes", "patch nodes", "create events"}) as kube:
        kubeconfig_env(kube)
        act = KubernetesAction(NODE)
        await act.start()
        try:
            notice = make_notice("gcp-ev", source="gcp", kind="termination")
            assert await act.on_notice(Entry(notice=notice), NODE) is True
            outcome = Outcome(notice, NODE, "reported", (SubscriberOutcome(client=1, state="checkpoint_done", step=7),))
            assert await act.on_outcome(outcome) is True
            assert await act.reconcile("expired") is True
        finally:
            await act.close()
    assert [e["reason"] for e in kube.events] == ["SpotguardCordon", "SpotNotice", "SpotguardUncordon"]
    for e in kube.events:
        assert e["metadata"]["namespace"] == "default"
        assert e["involvedObject"] == {"apiVersion": "v1", "kind": "Node", "name": NODE, "uid": "uid-node"}
    assert [e["type"] for e in kube.events] == ["Warning", "Normal", "Normal"]
    assert "checkpoint committed at step 7" in kube.events[1]["message"]
    assert not cordoned(kube) and ours(kube) == []


async def test_administrators_cordon_is_kept_when_the_notice_is_withdrawn(sock_path: str, kubeconfig_env) -> None:
    async with FakeKube(node_name=NODE) as kube:
        kube.node["spec"]["unschedulable"] = True  # `kubectl cordon` by an administrator, before the notice
        kubeconfig_env(kube)
        w = FakeWatcher("aws")
        async with running_daemon(sock_path, [w], node=NODE, kubernetes_node_actions=True):
            await w.push(make_notice("aws-adm", kind="termination"))
            await kube.wait_for(lambda: len(ours(kube)) == 1, what="taint")
            await kube.wait_for(lambda: any(e["reason"] == "SpotguardCordon" for e in kube.events), what="event")
            await w.push(Cancel(id="aws-adm", source="aws"))
            await kube.wait_for(lambda: ours(kube) == [], what="taint removed")
        assert cordoned(kube), "spotguard cleared a cordon it did not make"
        cordon_events = [e["message"] for e in kube.events if e["reason"] == "SpotguardCordon"]
        assert len(cordon_events) == 1 and "tainted the node (already cordoned)" in cordon_events[0]
        assert kube.node["metadata"].get("annotations", {}) == {}


async def test_no_uncordon_while_another_notice_is_active(sock_path: str, kubeconfig_env) -> None:
    async with FakeKube(node_name=NODE) as kube:
        kubeconfig_env(kube)
        w = FakeWatcher("aws")
        with structlog.testing.capture_logs() as logs:
            async with running_daemon(sock_path, [w], node=NODE, kubernetes_node_actions=True):
                await w.push(make_notice("aws-a", kind="preemption"))
                await kube.wait_for(lambda: [t["value"] for t in ours(kube)] == ["preemption"], what="cordon a")
                await w.push(make_notice("aws-b", kind="termination"))
                await kube.wait_for(lambda: [t["value"] for t in ours(kube)] == ["termination"], what="cordon b")
                seen = len(kube.log)
                await w.push(Cancel(id="aws-a", source="aws"))
                await kube.wait_for(lambda: len(kube.log) > seen, what="the reconcile after the cancel")
                await eventually(lambda: any(r["event"] in ("kubernetes.cordon_kept", "kubernetes.node_uncordoned")
                                             for r in logs), what="the reconcile's verdict")
                assert cordoned(kube) and ours(kube), "uncordoned while notice aws-b is still active"
                await w.push(Cancel(id="aws-b", source="aws"))
                await kube.wait_for(lambda: not cordoned(kube), what="uncordon once nothing is active")
        assert ours(kube) == [] and kube.node["spec"]["taints"][0]["key"] == "nvidia.com/gpu"


async def test_expiry_uncordons_a_node_that_outlived_its_notice(sock_path: str, kubeconfig_env) -> None:
    """GCP host maintenance done (or any notice whose VM lived on): the node is schedulable again."""
    async with FakeKube(node_name=NODE) as kube:
        kubeconfig_env(kube)
        w = FakeWatcher("gcp")
        async with running_daemon(sock_path, [w], node=NODE, kubernetes_node_actions=True, expire_margin=0.0,
                                  housekeeping_interval=0.05):
            await w.push(make_notice("gcp-m", source="gcp", kind="termination", in_seconds=1.0))
            await kube.wait_for(lambda: cordoned(kube), what="cordon")
            await kube.wait_for(lambda: not cordoned(kube), timeout=15, what="uncordon after the notice expired")
        assert ours(kube) == []


@pytest.mark.parametrize("source,kind", [("aws", "preemption"), ("gcp", "termination"), ("azure", "preemption")],
                         ids=["aws-stop-start", "gcp-maintenance", "azure-deallocate-start"])
async def test_vm_that_survived_is_uncordoned_at_restart(sock_path: str, kubeconfig_env, source: str,
                                                         kind: str) -> None:
    """The daemon stops with the VM (AWS spot stop/hibernate, Azure deallocate, GCP TERMINATE maintenance) and
    starts when the VM does, after the notice's deadline: the reconcile at start gives the node back."""
    async with FakeKube(node_name=NODE) as kube:
        kubeconfig_env(kube)
        w = FakeWatcher(source)
        notice = keyed(f"{source}-vm", source=source, kind=kind, in_seconds=0.5)
        async with running_daemon(sock_path, [w], node=NODE, kubernetes_node_actions=True,
                                  housekeeping_interval=3600):
            await w.push(notice)
            await kube.wait_for(lambda: cordoned(kube), what="cordon")
        assert cordoned(kube) and kube.node["metadata"]["annotations"]["spotguard.io/cordoned"] == "true"
        await asyncio.sleep(max(0.0, notice.seconds_left()) + 0.05)  # the VM is stopped past the deadline
        async with running_daemon(sock_path, [FakeWatcher(source)], node=NODE, kubernetes_node_actions=True,
                                  expire_margin=0.0, housekeeping_interval=3600):
            await kube.wait_for(lambda: not cordoned(kube), what="uncordon at start")
        assert ours(kube) == [] and "spotguard.io/notices" not in kube.node["metadata"].get("annotations", {})


async def test_restart_during_a_notice_keeps_the_cordon_until_it_expires(sock_path: str, kubeconfig_env) -> None:
    """A daemon restarted (rollout, OOM kill) mid-notice must not give the doomed node back; once the
    restored notice expires without being re-seen, it does."""
    async with FakeKube(node_name=NODE) as kube:
        kubeconfig_env(kube)
        w = FakeWatcher("aws")
        notice = keyed("aws-rs", in_seconds=2.0)
        async with running_daemon(sock_path, [w], node=NODE, kubernetes_node_actions=True,
                                  housekeeping_interval=3600):
            await w.push(notice)
            await kube.wait_for(lambda: cordoned(kube), what="cordon")
        with structlog.testing.capture_logs() as logs:
            async with running_daemon(sock_path, [FakeWatcher("aws")], node=NODE, kubernetes_node_actions=True,
                                      expire_margin=0.0, housekeeping_interval=3600):
                await eventually(lambda: any(r["event"] == "kubernetes.cordon_kept" for r in logs), timeout=10,
                                 what="the reconcile at start keeps the cordon")
                assert cordoned(kube) and ours(kube)
                await kube.wait_for(lambda: not cordoned(kube), timeout=15, what="uncordon once the notice expired")
