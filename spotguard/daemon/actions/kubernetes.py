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
* At the outcome: one ``Event`` (reason ``SpotNotice``) per subscriber pod, after
  checking with ``GET`` that the pod is on this node (a subscriber only names its pod;
  the daemon does not take its word for it). The Event's name is derived from the notice
  id, so a repeat is ``409 AlreadyExists``, not a duplicate.

A ``403`` means missing RBAC: one line naming the missing verb and the manifest to
apply, no retry. Everything else retries with backoff until the notice's deadline.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import random
from datetime import timezone
from typing import Any, Optional

from ...logs import get_logger
from ...notice import Notice
from ...timefmt import utcnow
from ..book import Entry
from . import Action, ActionError, Deadline, Outcome

__all__ = ["KubernetesAction", "TAINT_KEY", "EVENT_REASON"]

log = get_logger("spotguard.actions.kubernetes")

TAINT_KEY = "spotguard.io/notice"
EVENT_REASON = "SpotNotice"
SERVICE_ACCOUNT_DIR = "/var/run/secrets/kubernetes.io/serviceaccount"
CLOUD_SOURCES = frozenset({"aws", "gcp", "azure"})
REQUEST_TIMEOUT = 5.0
MIN_BUDGET = 10.0
CONFLICT_RETRIES = 5
RBAC_FIX = ("grant it in the ClusterRole (deploy/kubernetes/daemonset/rbac.yaml, or the Helm chart's "
            "kubernetesNodeActions=true)")


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
        self._tainted: set[str] = set()

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
        if self._api_client is not None:
            await self._api_client.close()
            self._api_client = None

    # --- node: taint + cordon -------------------------------------------------------

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
        done = bool(done)
        if done:
            self._tainted.add(notice.id)
            log.info("kubernetes.node_cordoned", notice_id=notice.id, node=self.node, taint=f"{TAINT_KEY}={notice.kind}"
                     ":NoSchedule")
        return done

    async def _taint_and_cordon(self, notice: Notice, budget: Deadline) -> bool:
        for _ in range(CONFLICT_RETRIES):
            node = await self._call("get nodes", self._core.read_node(self.node, _request_timeout=budget.timeout(REQUEST_TIMEOUT)))
            taints = self._taints(node)
            ours = {"key": TAINT_KEY, "value": notice.kind, "effect": "NoSchedule"}
            if node.spec.unschedulable and ours in taints:
                return True
            taints = [t for t in taints if not (t.get("key") == TAINT_KEY and t.get("effect") == "NoSchedule")]
            taints.append({**ours, "timeAdded": _k8s_time()})
            body = {"metadata": {"resourceVersion": node.metadata.resource_version},
                    "spec": {"unschedulable": True, "taints": taints}}
            try:
                await self._call("patch nodes", self._core.patch_node(self.node, body,
                                                                       _request_timeout=budget.timeout(REQUEST_TIMEOUT)))
                return True
            except self._exc as exc:
                if exc.status != 409:
                    raise
                log.info("kubernetes.conflict", notice_id=notice.id, node=self.node,
                         detail="the node changed since it was read; reading it again")
        return False

    def cancelled(self, notice_id: str) -> None:
        # The provider withdrew the notice: the node stays; give it back to the scheduler.
        if notice_id in self._tainted and self._core is not None:
            self._tainted.discard(notice_id)
            asyncio.get_running_loop().create_task(self._uncordon(notice_id))

    async def _uncordon(self, notice_id: str) -> None:
        budget = Deadline(MIN_BUDGET)

        async def once() -> bool:
            node = await self._call("get nodes", self._core.read_node(self.node, _request_timeout=budget.timeout(5)))
            keep = [t for t in self._taints(node) if t.get("key") != TAINT_KEY]
            body = {"metadata": {"resourceVersion": node.metadata.resource_version},
                    "spec": {"unschedulable": False, "taints": keep}}
            await self._call("patch nodes", self._core.patch_node(self.node, body, _request_timeout=budget.timeout(5)))
            return True

        try:
            if await self._retry(once, budget, "node.uncordon"):
                log.info("kubernetes.node_uncordoned", notice_id=notice_id, node=self.node,
                         detail="notice withdrawn by its provider")
        except _Forbidden as exc:
            log.error("kubernetes.forbidden", notice_id=notice_id, node=self.node, missing=str(exc), fix=RBAC_FIX)

    # --- pods: Events ------------------------------------------------------------------

    async def on_outcome(self, outcome: Outcome) -> Optional[bool]:
        pods: dict[tuple[str, str], list[Any]] = {}
        for s in outcome.subscribers:
            if s.pod and s.namespace:
                pods.setdefault((s.namespace, s.pod), []).append(s)
        if not pods:
            return None
        budget = Deadline(outcome.notice.seconds_left(), minimum=MIN_BUDGET)
        results = await asyncio.gather(*(self._event(outcome, ns, pod, budget) for ns, pod in pods))
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
            now = _k8s_time()
            name = f"{pod_name[:200]}.spotguard-{hashlib.sha256(notice.id.encode()).hexdigest()[:12]}"
            body = {
                "apiVersion": "v1", "kind": "Event",
                "metadata": {"name": name, "namespace": namespace},
                "involvedObject": {"apiVersion": "v1", "kind": "Pod", "name": pod_name, "namespace": namespace,
                                   "uid": pod.metadata.uid},
                "reason": EVENT_REASON, "message": outcome.summary()[:1024],
                "type": "Normal" if outcome.status == "committed" else "Warning",
                "source": {"component": "spotguard", "host": self.node},
                "reportingComponent": "spotguard.io/daemon", "reportingInstance": self.node[:128],
                "firstTimestamp": now, "lastTimestamp": now, "count": 1,
            }

            async def create() -> bool:
                try:
                    await self._call("create events", self._core.create_namespaced_event(
                        namespace, body, _request_timeout=budget.timeout(REQUEST_TIMEOUT)))
                except self._exc as exc:
                    if exc.status != 409:  # AlreadyExists: a repeat of this notice's Event
                        raise
                return True

            ok = await self._retry(create, budget, "event.create")
        except _Forbidden as exc:
            log.error("kubernetes.forbidden", notice_id=notice.id, pod=pod_name, namespace=namespace, missing=str(exc),
                      fix=RBAC_FIX)
            return False
        if ok:
            log.info("kubernetes.event_created", notice_id=notice.id, pod=pod_name, namespace=namespace,
                     status=outcome.status)
        return bool(ok)

    # --- plumbing ------------------------------------------------------------------------

    def _taints(self, node: Any) -> list[dict[str, Any]]:
        """The node's taints as the API's JSON (``timeAdded``, not the model's ``time_added``)."""
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


def _k8s_time() -> str:
    """metav1.Time: RFC 3339, whole seconds, UTC."""
    return utcnow().astimezone(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


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
