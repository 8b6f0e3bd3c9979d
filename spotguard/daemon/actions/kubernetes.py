"""Kubernetes node actions: taint + cordon the node at the notice, an Event on each trainer's pod after it.

Why ``kubernetes_asyncio``: it is the official generated client (every type and
endpoint, maintained with each Kubernetes release) on aiohttp, which the daemon
already runs on; so no thread pool or second HTTP stack is needed, and its in-cluster
loader re-reads the projected service-account token as the kubelet rotates it.

* At the notice (cloud sources only — never a drill or the daemon's own SIGTERM,
  after which the node lives on): ``GET`` the node, then one strategic-merge ``PATCH``
  setting ``spec.unschedulable`` and adding the taint ``spotguard.io/notice=<kind>:NoSchedule``
  (not ``NoExecute``: that would evict the trainers mid-checkpoint). ``spec.taints`` is
  replaced whole by a patch, so the patch carries the ``resourceVersion`` it was computed
  from: a concurrent writer makes it a ``409 Conflict``, and the daemon reads and retries.
* Ownership (as AWS Node Termination Handler labels what it did): the same patch writes
  the annotations ``spotguard.io/notices`` (the notice ids spotguard cordoned for) and
  ``spotguard.io/cordoned`` (``"true"``: spotguard set ``unschedulable``; ``"false"``: the
  node was already cordoned, by an administrator or another tool, and stays so).
* Reconcile — at daemon start, when a notice expires (the VM survived: GCP maintenance
  done, AWS stop/hibernate then start, Azure deallocate then start) and when one is
  withdrawn: if no cloud emergency notice is active on the node any more, remove the
  taint and the annotations, and set ``unschedulable: false`` only if spotguard set it.
  Never while another notice is active; never touches a cordon it did not make.
* At the outcome: one ``Event`` (reason ``SpotNotice``) per subscriber pod, after
  checking with ``GET`` that the pod is on this node (a subscriber only names its pod;
  the daemon does not take its word for it). The Event's name is derived from the notice
  id and the outcome's status (``Outcome.key``), so a repeat of the same outcome is
  ``409 AlreadyExists``, not a duplicate, and a different outcome is never swallowed.
* Node Events (``involvedObject`` = the Node, namespace ``default``, as NTH and the kubelet
  record them; ``kubectl describe node`` shows them): ``SpotguardCordon``,
  ``SpotguardUncordon`` and the outcome (``SpotNotice``) of a cloud notice.

A ``403`` means missing RBAC: one line naming the missing verb and the manifest to
apply, no retry. Everything else retries with backoff until the notice's deadline.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import random
from datetime import datetime, timezone
from typing import Any, Callable, Collection, Optional

from ...logs import get_logger
from ...notice import Notice
from ...timefmt import utcnow
from ..book import Entry
from . import Action, ActionError, Deadline, Outcome

__all__ = ["KubernetesAction", "TAINT_KEY", "EVENT_REASON"]

log = get_logger("spotguard.actions.kubernetes")

TAINT_KEY = "spotguard.io/notice"
#: Ownership annotations on the Node: which notices spotguard cordoned for, and whether it set
#: ``unschedulable`` itself (``"true"``) or found the node already cordoned (``"false"``).
NOTICES_ANNOTATION = "spotguard.io/notices"
CORDONED_ANNOTATION = "spotguard.io/cordoned"
EVENT_REASON = "SpotNotice"
CORDON_REASON = "SpotguardCordon"
UNCORDON_REASON = "SpotguardUncordon"
#: Events about cluster-scoped objects (a Node) live in ``default`` with an empty involvedObject namespace.
NODE_EVENT_NAMESPACE = "default"
SERVICE_ACCOUNT_DIR = "/var/run/secrets/kubernetes.io/serviceaccount"
CLOUD_SOURCES = frozenset({"aws", "gcp", "azure"})
REQUEST_TIMEOUT = 5.0
MIN_BUDGET = 10.0
CONFLICT_RETRIES = 5
RBAC_FIX = ("grant it in the ClusterRole (deploy/kubernetes/daemonset-node-actions/rbac.yaml, or the Helm "
            "chart's kubernetesNodeActions=true)")
#: Reconciling (no notice deadline to follow) gives up after this long; the next start/expiry/cancel retries.
RECONCILE_BUDGET = 30.0


class _Forbidden(Exception):
    pass


class KubernetesAction(Action):
    name = "kubernetes"

    def __init__(self, node: str, *, kubeconfig: Optional[str] = None,
                 service_account_dir: str = SERVICE_ACCOUNT_DIR) -> None:
        self.node = node
        self._api_client: Any = None
        self._kubeconfig = kubeconfig
        self._sa_dir = service_account_dir
        self._core: Any = None
        self._exc: Any = None
        #: The ids of the cloud emergency notices still active on this node (set by the daemon at start):
        #: the cordon is never undone while one is. ``None`` (not wired): none known.
        self.active: Optional[Callable[[], Collection[str]]] = None
        self._reconciles: set[asyncio.Task[Any]] = set()
        self._node_uid = ""

    async def start(self) -> None:
        try:
            from kubernetes_asyncio import client, config
            from kubernetes_asyncio.client.exceptions import ApiException
        except ImportError:
            raise ActionError("--kubernetes-node-actions needs kubernetes_asyncio: pip install 'spotguard[kubernetes]' "
                              "(the spotguard image has it)") from None
        self._exc = ApiException
        self._api_client = await _load_client(client, config, self._kubeconfig, self._sa_dir)
        self._core = client.CoreV1Api(self._api_client)

    async def close(self) -> None:
        for t in list(self._reconciles):
            t.cancel()
        if self._reconciles:
            await asyncio.wait(list(self._reconciles), timeout=1.0)
        self._core = None  # a reconcile timer that fires after the stop does nothing
        if self._api_client is not None:
            await self._api_client.close()
            self._api_client = None

    # --- node: taint + cordon, with ownership ---------------------------------------

    async def on_notice(self, entry: Entry, node: str) -> Optional[bool]:
        notice = entry.notice
        if notice.source not in CLOUD_SOURCES:
            return None  # a drill or the daemon's own SIGTERM: this node is not going away
        budget = Deadline(notice.seconds_left(), minimum=MIN_BUDGET)
        try:
            done = await self._retry(lambda: self._taint_and_cordon(notice, budget), budget, "node.patch")
        except _Forbidden as exc:
            log.error("kubernetes.forbidden", notice_id=notice.id, node=self.node, missing=str(exc), fix=RBAC_FIX)
            return False
        if done in ("cordoned", "tainted"):
            log.info("kubernetes.node_cordoned", notice_id=notice.id, node=self.node, taint=f"{TAINT_KEY}={notice.kind}"
                     ":NoSchedule", cordoned_by="spotguard" if done == "cordoned" else "already cordoned before")
            what = "cordoned and tainted the node" if done == "cordoned" else "tainted the node (already cordoned)"
            await self._node_event(CORDON_REASON, notice.id, "Warning",
                                   f"spotguard {what}: {notice.kind} notice from {notice.source} ({notice.id}), "
                                   f"deadline {_k8s_time(notice.deadline)}", budget)
            if self.active is not None and notice.id not in self.active():  # withdrawn while the patch was in flight
                self._spawn_reconcile("cancelled")
        return done is not None

    async def _taint_and_cordon(self, notice: Notice, budget: Deadline) -> Optional[str]:
        """``"cordoned"`` (spotguard set unschedulable), ``"tainted"`` (the node was cordoned already),
        ``"already"`` (done for this notice before, e.g. by an earlier life), or ``None`` (conflicts kept coming)."""
        for _ in range(CONFLICT_RETRIES):
            node = await self._call("get nodes", self._core.read_node(self.node, _request_timeout=budget.timeout(REQUEST_TIMEOUT)))
            taints = self._taints(node)
            notes = dict(node.metadata.annotations or {})
            owned = _ids(notes.get(NOTICES_ANNOTATION))
            ours = {"key": TAINT_KEY, "value": notice.kind, "effect": "NoSchedule"}
            # The API adds ``timeAdded`` to a taint: compare what identifies it, not the whole dict.
            if node.spec.unschedulable and any(_same_taint(t, ours) for t in taints) and notice.id in owned:
                return "already"
            taints = [t for t in taints if not (t.get("key") == TAINT_KEY and t.get("effect") == "NoSchedule")]
            taints.append({**ours, "timeAdded": _k8s_time()})
            # Who cordoned it: kept from an earlier notice (spotguard's own cordon is not an administrator's).
            cordoned = notes.get(CORDONED_ANNOTATION) or ("false" if node.spec.unschedulable else "true")
            body = {"metadata": {"resourceVersion": node.metadata.resource_version,
                                 "annotations": {NOTICES_ANNOTATION: ",".join(sorted(owned | {notice.id})),
                                                 CORDONED_ANNOTATION: cordoned}},
                    "spec": {"unschedulable": True, "taints": taints}}
            try:
                await self._call("patch nodes", self._core.patch_node(self.node, body,
                                                                       _request_timeout=budget.timeout(REQUEST_TIMEOUT)))
                return "cordoned" if cordoned == "true" and not node.spec.unschedulable else "tainted"
            except self._exc as exc:
                if exc.status != 409:
                    raise
                log.info("kubernetes.conflict", notice_id=notice.id, node=self.node,
                         detail="the node changed since it was read; reading it again")
        return None

    def cancelled(self, notice_id: str) -> None:
        # The provider withdrew the notice: the node stays; give it back to the scheduler (if nothing else is active).
        self._spawn_reconcile("cancelled")

    def _spawn_reconcile(self, why: str) -> None:
        if self._core is not None:
            task = asyncio.get_running_loop().create_task(self.reconcile(why), name="kubernetes-reconcile")
            self._reconciles.add(task)
            task.add_done_callback(self._reconciles.discard)

    async def reconcile(self, why: str) -> Optional[bool]:
        """Undo spotguard's cordon and taint once no cloud emergency notice is active on the node.

        ``None``: nothing of spotguard's on the node, or a notice is still active; True/False: undone/failed.
        Only what the ownership annotations say spotguard did is undone."""
        if self._core is None:
            return None
        budget = Deadline(RECONCILE_BUDGET)
        undone: list[str] = []
        uncordoned: list[bool] = []

        async def once() -> Optional[bool]:
            for _ in range(CONFLICT_RETRIES):
                node = await self._call("get nodes", self._core.read_node(self.node, _request_timeout=budget.timeout(5)))
                notes = node.metadata.annotations or {}
                taints = self._taints(node)
                mine = [t for t in taints if t.get("key") == TAINT_KEY]
                if NOTICES_ANNOTATION not in notes and CORDONED_ANNOTATION not in notes and not mine:
                    return None
                active = set(self.active()) if self.active is not None else set()
                if active:
                    log.info("kubernetes.cordon_kept", node=self.node, why=why, active=sorted(active)[:8],
                             detail="a notice is still active on this node")
                    return None
                spec: dict[str, Any] = {"taints": [t for t in taints if t.get("key") != TAINT_KEY]}
                if notes.get(CORDONED_ANNOTATION) == "true":
                    spec["unschedulable"] = False
                body = {"metadata": {"resourceVersion": node.metadata.resource_version,
                                     "annotations": {NOTICES_ANNOTATION: None, CORDONED_ANNOTATION: None}},
                        "spec": spec}
                try:
                    await self._call("patch nodes", self._core.patch_node(self.node, body,
                                                                           _request_timeout=budget.timeout(5)))
                except self._exc as exc:
                    if exc.status != 409:
                        raise
                    continue
                undone[:] = sorted(_ids(notes.get(NOTICES_ANNOTATION)))
                uncordoned.append("unschedulable" in spec)
                log.info("kubernetes.node_uncordoned" if "unschedulable" in spec else "kubernetes.node_untainted",
                         node=self.node, why=why, notices=undone[:8],
                         detail=("spotguard's cordon and taint removed" if "unschedulable" in spec else
                                 "spotguard's taint removed; the node was cordoned before spotguard, so it stays"))
                return True
            return False

        try:
            ok = await self._retry(once, budget, "node.reconcile")
        except _Forbidden as exc:
            log.error("kubernetes.forbidden", node=self.node, why=why, missing=str(exc), fix=RBAC_FIX)
            return False
        if ok:
            await self._node_event(UNCORDON_REASON, ",".join(undone) or why, "Normal",
                                   f"spotguard removed its taint{' and cordon' if any(uncordoned) else ''} ({why}; "
                                   f"notices {', '.join(undone)[:500]}): no notice is active on this node", budget)
        return ok

    # --- pods: Events ------------------------------------------------------------------

    async def on_outcome(self, outcome: Outcome) -> Optional[bool]:
        pods: dict[tuple[str, str], list[Any]] = {}
        for s in outcome.subscribers:
            if s.pod and s.namespace:
                pods.setdefault((s.namespace, s.pod), []).append(s)
        node_event = outcome.notice.source in CLOUD_SOURCES
        if not pods and not node_event:
            return None
        budget = Deadline(outcome.notice.seconds_left(), minimum=MIN_BUDGET)
        jobs = [self._event(outcome, ns, pod, budget) for ns, pod in pods]
        if node_event:
            n = outcome.notice
            jobs.append(self._node_event(EVENT_REASON, f"{n.id}-{outcome.status}",
                                         "Normal" if outcome.status == "committed" and outcome.late_seconds is None else "Warning",
                                         outcome.summary(), budget))
        results = await asyncio.gather(*jobs)
        return all(results)

    async def _event(self, outcome: Outcome, namespace: str, pod_name: str, budget: Deadline) -> bool:
        notice = outcome.notice
        try:
            pod = await self._retry(lambda: self._call("get pods", self._core.read_namespaced_pod(
                pod_name, namespace, _request_timeout=budget.timeout(REQUEST_TIMEOUT))), budget, "pod.get")
            if pod is None:
                return False
            if pod.spec.node_name != self.node:
                log.warning("kubernetes.pod_elsewhere", notice_id=notice.id, pod=pod_name, namespace=namespace,
                            pod_node=pod.spec.node_name, node=self.node,
                            detail="a subscriber named a pod that is not on this node: no Event")
                return False
            # Named from the notice *and* its outcome (Outcome.key, the shared action layer's): a repeat of this
            # outcome is 409 AlreadyExists, a different outcome of the same notice is a new Event, never swallowed.
            name = f"{pod_name[:200]}.spotguard-{outcome.key[:12]}"
            body = _event_body(name, namespace, {"apiVersion": "v1", "kind": "Pod", "name": pod_name,
                                                 "namespace": namespace, "uid": pod.metadata.uid},
                               EVENT_REASON, "Normal" if outcome.status == "committed" and outcome.late_seconds is None else "Warning",
                               outcome.summary(), self.node)
            ok = await self._retry(lambda: self._create_event(namespace, body, budget), budget, "event.create")
        except _Forbidden as exc:
            log.error("kubernetes.forbidden", notice_id=notice.id, pod=pod_name, namespace=namespace, missing=str(exc),
                      fix=RBAC_FIX)
            return False
        if ok:
            log.info("kubernetes.event_created", notice_id=notice.id, pod=pod_name, namespace=namespace,
                     status=outcome.status)
        return bool(ok)

    async def _node_event(self, reason: str, key: str, type_: str, message: str, budget: Deadline) -> bool:
        """One Event on the Node (``kubectl describe node``); named from ``reason`` and ``key``, so a repeat is a
        ``409 AlreadyExists``. Best effort: a failure is one log line."""
        name = f"{self.node[:200]}.spotguard-{reason.lower()}-{hashlib.sha256(key.encode()).hexdigest()[:12]}"
        # The kubelet's own node Events use the node's name as uid; the real uid once the node was read.
        involved = {"apiVersion": "v1", "kind": "Node", "name": self.node, "uid": self._node_uid or self.node}
        body = _event_body(name, NODE_EVENT_NAMESPACE, involved, reason, type_, message, self.node)
        try:
            ok = bool(await self._retry(lambda: self._create_event(NODE_EVENT_NAMESPACE, body, budget), budget,
                                        "node_event.create"))
        except _Forbidden as exc:
            log.error("kubernetes.forbidden", node=self.node, reason=reason, missing=str(exc), fix=RBAC_FIX)
            return False
        if ok:
            log.info("kubernetes.node_event", node=self.node, reason=reason, type=type_)
        return ok

    async def _create_event(self, namespace: str, body: dict[str, Any], budget: Deadline) -> bool:
        """Create one Event; ``409 AlreadyExists`` is a repeat of the same Event (same name): fine."""
        try:
            await self._call("create events", self._core.create_namespaced_event(
                namespace, body, _request_timeout=budget.timeout(REQUEST_TIMEOUT)))
        except self._exc as exc:
            if exc.status != 409:
                raise
        return True

    # --- plumbing ------------------------------------------------------------------------

    def _taints(self, node: Any) -> list[dict[str, Any]]:
        """The node's taints as the API's JSON (``timeAdded``, not the model's ``time_added``)."""
        self._node_uid = node.metadata.uid or self._node_uid
        return [self._api_client.sanitize_for_serialization(t) for t in (node.spec.taints or [])]

    async def _call(self, verb: str, coro: Any) -> Any:
        try:
            return await coro
        except self._exc as exc:
            if exc.status == 403:
                raise _Forbidden(f"'{verb}'") from None
            raise

    async def _retry(self, fn: Any, budget: Deadline, what: str) -> Any:
        """``fn()`` until it returns, backing off on 5xx/429/timeouts/connection errors; ``None`` past the budget."""
        delay = 0.2
        attempt = 0
        while True:
            attempt += 1
            try:
                return await fn()
            except _Forbidden:
                raise
            except self._exc as exc:
                if exc.status == 404:
                    log.error("kubernetes.not_found", what=what, node=self.node,
                              fix="check --node / SPOTGUARD_NODE (downward API spec.nodeName) and the pod names the "
                                  "trainers send (SPOTGUARD_POD_NAME / SPOTGUARD_POD_NAMESPACE)")
                    return None
                if exc.status not in (409, 429) and exc.status < 500:
                    log.error("kubernetes.rejected", what=what, status=exc.status, reason=str(exc.reason)[:200])
                    return None
                error = f"HTTP {exc.status}"
            except (asyncio.TimeoutError, OSError) as exc:
                error = type(exc).__name__
            except Exception as exc:  # aiohttp.ClientError and the like
                if type(exc).__module__.startswith("aiohttp"):
                    error = type(exc).__name__
                else:
                    raise
            delay = min(delay * 2, 3.0) * random.uniform(0.8, 1.2)
            if budget.left() <= delay:
                log.error("kubernetes.gave_up", what=what, attempts=attempt, error=error,
                          detail="the notice's deadline passed")
                return None
            log.warning("kubernetes.retrying", what=what, attempt=attempt, error=error, in_seconds=round(delay, 3))
            await asyncio.sleep(delay)


def _k8s_time(when: Optional[datetime] = None) -> str:
    """metav1.Time: RFC 3339, whole seconds, UTC."""
    return (when or utcnow()).astimezone(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def _event_body(name: str, namespace: str, involved: dict[str, Any], reason: str, type_: str, message: str,
                node: str) -> dict[str, Any]:
    """A core/v1 Event as ``kubectl describe`` shows it (reporting component and instance set)."""
    now = _k8s_time()
    return {
        "apiVersion": "v1", "kind": "Event",
        "metadata": {"name": name, "namespace": namespace},
        "involvedObject": involved, "reason": reason, "message": message[:1024], "type": type_,
        "source": {"component": "spotguard", "host": node},
        "reportingComponent": "spotguard.io/daemon", "reportingInstance": node[:128],
        "firstTimestamp": now, "lastTimestamp": now, "count": 1,
    }


def _ids(annotation: Optional[str]) -> set[str]:
    """The notice ids in the ownership annotation (comma-separated; empty or absent: none)."""
    return {i for i in (annotation or "").split(",") if i}


def _same_taint(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Taints are identified by key, value and effect; the API server adds ``timeAdded``."""
    return all(a.get(k) == b.get(k) for k in ("key", "value", "effect"))


async def _load_client(client: Any, config: Any, kubeconfig: Optional[str], sa_dir: str) -> Any:
    """In-cluster service-account auth (token re-read as it rotates); ``$KUBECONFIG`` outside a cluster."""
    configuration = client.Configuration()
    try:
        kubeconfig = kubeconfig or (None if os.environ.get("KUBERNETES_SERVICE_HOST") else os.environ.get("KUBECONFIG"))
        if kubeconfig:
            await config.load_kube_config(config_file=kubeconfig, client_configuration=configuration)
        else:
            config.load_incluster_config(client_configuration=configuration,
                                         token_filename=os.path.join(sa_dir, "token"),
                                         cert_filename=os.path.join(sa_dir, "ca.crt"))
    except Exception as exc:  # ConfigException: not in a pod, no token mounted
        raise ActionError(f"--kubernetes-node-actions: no Kubernetes credentials ({exc}); run in a pod whose "
                          "ServiceAccount token is mounted (automountServiceAccountToken: true), or set KUBECONFIG")
    return client.ApiClient(configuration)
