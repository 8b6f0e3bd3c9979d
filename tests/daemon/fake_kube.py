"""A fake Kubernetes API server on loopback, answering as the documented API does for
what spotguard's node actions use: nodes get/patch, pods get, events create.

Documented behaviour reproduced: bearer-token auth (401), RBAC denials as ``403`` Status
objects naming the verb/resource, ``404`` NotFound, ``415`` for a PATCH whose
Content-Type is not one of the patch types, optimistic concurrency (a patch carrying a
stale ``metadata.resourceVersion`` is a ``409 Conflict``), ``409 AlreadyExists`` on a
duplicate create, ``422`` when an Event's involvedObject namespace differs from its own,
strategic-merge semantics for ``spec.taints`` (no merge key: the list is replaced) and
maps (``metadata.annotations``: merged, ``null`` deletes a key), Events about a
cluster-scoped object (a Node: empty involvedObject namespace, Event in ``default``),
JSON patch (RFC 6902: add/replace/remove/test). Optional TLS (in-cluster style).
"""

from __future__ import annotations

import asyncio
import copy
import json
import ssl
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import pytest
from aiohttp import web

from .loopback import serve

PATCH_TYPES = ("application/strategic-merge-patch+json", "application/merge-patch+json",
               "application/json-patch+json")
SA_USER = "system:serviceaccount:kube-system:spotguard"


def status(code: int, reason: str, message: str, **details: Any) -> web.Response:
    return web.json_response({"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
                              "message": message, "reason": reason, "details": details, "code": code}, status=code)


def _merge(target: dict[str, Any], patch: dict[str, Any]) -> None:
    for k, v in patch.items():
        if v is None:  # JSON merge patch (RFC 7386) and strategic merge: null deletes the key
            target.pop(k, None)
        elif isinstance(v, dict):
            if not isinstance(target.get(k), dict):
                target[k] = {}
            _merge(target[k], v)
        else:
            target[k] = copy.deepcopy(v)  # lists (spec.taints: no patchMergeKey) are replaced whole


def _json_patch(doc: dict[str, Any], ops: list[dict[str, Any]]) -> Optional[str]:
    for op in ops:
        parts = [p.replace("~1", "/").replace("~0", "~") for p in op["path"].lstrip("/").split("/")]
        parent: Any = doc
        for p in parts[:-1]:
            parent = parent[int(p)] if isinstance(parent, list) else parent.setdefault(p, {})
        last = parts[-1]
        if op["op"] == "test":
            if parent.get(last) != op["value"]:
                return f"test failed at {op['path']}"
        elif op["op"] in ("add", "replace"):
            if isinstance(parent, list):
                parent.append(op["value"]) if last == "-" else parent.insert(int(last), op["value"])
            else:
                parent[last] = op["value"]
        elif op["op"] == "remove":
            del parent[int(last) if isinstance(parent, list) else last]
    return None


@dataclass
class FakeKube:
    node_name: str = "node-a"
    token: str = "sa-token-1"
    allowed: set[str] = field(default_factory=lambda: {"get nodes", "patch nodes", "get pods", "create events"})
    pods: dict[tuple[str, str], dict[str, Any]] = field(default_factory=dict)
    concurrent_writes: int = 0  # another controller writes the node right after each of this many GETs
    hang: bool = False
    tls_dir: Optional[Path] = None
    nodes: dict[str, dict[str, Any]] = field(default_factory=dict)
    events: list[dict[str, Any]] = field(default_factory=list)
    log: list[tuple[str, str, int, str]] = field(default_factory=list)  # (method, path, status, content type)
    arrivals: int = 0  # requests received (answered or not)
    _rv: int = 100
    port: int = 0
    _runner: Optional[web.AppRunner] = None
    _release: asyncio.Event = field(default_factory=asyncio.Event)
    changed: asyncio.Event = field(default_factory=asyncio.Event)

    def __post_init__(self) -> None:
        self.nodes[self.node_name] = {
            "apiVersion": "v1", "kind": "Node",
            "metadata": {"name": self.node_name, "uid": "uid-node", "resourceVersion": self._next_rv(),
                         "labels": {"kubernetes.io/hostname": self.node_name}},
            "spec": {"taints": [{"key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule"}]},
        }

    def add_pod(self, namespace: str, name: str, node: Optional[str] = None) -> None:
        self.pods[(namespace, name)] = {
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": namespace, "uid": f"uid-{namespace}-{name}",
                         "resourceVersion": self._next_rv()},
            "spec": {"nodeName": node or self.node_name, "containers": [{"name": "trainer", "image": "t"}]},
        }

    def _next_rv(self) -> str:
        self._rv += 1
        return str(self._rv)

    @property
    def node(self) -> dict[str, Any]:
        return self.nodes[self.node_name]

    @property
    def url(self) -> str:
        return f"{'https' if self.tls_dir else 'http'}://127.0.0.1:{self.port}"

    # --- request handling -------------------------------------------------------------

    def _authz(self, request: web.Request, verb: str, resource: str, name: str,
               namespace: str = "") -> Optional[web.Response]:
        if request.headers.get("Authorization") != f"Bearer {self.token}":
            return status(401, "Unauthorized", "Unauthorized")
        if f"{verb} {resource}" not in self.allowed:
            scope = f'in the namespace "{namespace}"' if namespace else "at the cluster scope"
            return status(403, "Forbidden", f'{resource} "{name}" is forbidden: User "{SA_USER}" cannot {verb} '
                                            f'resource "{resource}" in API group "" {scope}',
                          name=name, kind=resource)
        return None

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        self.arrivals += 1
        self.changed.set()
        resp = await self._route(request)
        self.log.append((request.method, request.path, resp.status, request.headers.get("Content-Type", "")))
        self.changed.set()
        return resp

    async def _route(self, request: web.Request) -> web.StreamResponse:
        if self.hang:
            await self._release.wait()
        parts = request.path.strip("/").split("/")
        if parts[:3] == ["api", "v1", "nodes"] and len(parts) == 4:
            return await self._node(request, parts[3])
        if parts[:3] == ["api", "v1", "namespaces"] and len(parts) == 6 and parts[4] == "pods":
            if request.method != "GET":
                return status(405, "MethodNotAllowed", "the server does not allow this method on the requested resource")
            denied = self._authz(request, "get", "pods", parts[5], parts[3])
            if denied:
                return denied
            pod = self.pods.get((parts[3], parts[5]))
            return web.json_response(pod) if pod else status(404, "NotFound", f'pods "{parts[5]}" not found',
                                                              name=parts[5], kind="pods")
        if parts[:3] == ["api", "v1", "namespaces"] and len(parts) == 5 and parts[4] == "events":
            if request.method != "POST":
                return status(405, "MethodNotAllowed", "the server does not allow this method on the requested resource")
            return await self._create_event(request, parts[3])
        return status(404, "NotFound", "the server could not find the requested resource")

    async def _node(self, request: web.Request, name: str) -> web.StreamResponse:
        verb = {"GET": "get", "PATCH": "patch"}.get(request.method)
        if verb is None:
            return status(405, "MethodNotAllowed", "the server does not allow this method on the requested resource")
        denied = self._authz(request, verb, "nodes", name)
        if denied:
            return denied
        node = self.nodes.get(name)
        if node is None:
            return status(404, "NotFound", f'nodes "{name}" not found', name=name, kind="nodes")
        if verb == "get":
            out = web.json_response(node)
            if self.concurrent_writes > 0:  # e.g. the node lifecycle controller updates it right after
                self.concurrent_writes -= 1
                node["metadata"]["labels"]["touched-by"] = "other-controller"
                node["metadata"]["resourceVersion"] = self._next_rv()
            return out
        ctype = request.headers.get("Content-Type", "").split(";")[0].strip()
        if ctype not in PATCH_TYPES:
            return status(415, "UnsupportedMediaType", f"the body of the request was in an unknown format - accepted "
                                                       f"media types include: {', '.join(PATCH_TYPES)}")
        try:
            body = await request.json()
        except json.JSONDecodeError:
            return status(400, "BadRequest", "invalid JSON")
        new = copy.deepcopy(node)
        if ctype == "application/json-patch+json":
            err = _json_patch(new, body)
            if err:
                return status(422, "Invalid", err)
        else:
            want_rv = (body.get("metadata") or {}).get("resourceVersion")
            if want_rv is not None and want_rv != node["metadata"]["resourceVersion"]:
                return status(409, "Conflict", f'Operation cannot be fulfilled on nodes "{name}": the object has been '
                                               "modified; please apply your changes to the latest version and try again",
                              name=name, kind="nodes")
            _merge(new, body)
        new["metadata"]["resourceVersion"] = self._next_rv()
        self.nodes[name] = new
        return web.json_response(new)

    async def _create_event(self, request: web.Request, namespace: str) -> web.StreamResponse:
        body = await request.json()
        name = (body.get("metadata") or {}).get("name", "")
        denied = self._authz(request, "create", "events", name, namespace)
        if denied:
            return denied
        if (body.get("metadata") or {}).get("namespace", namespace) != namespace:
            return status(400, "BadRequest", "the namespace of the provided object does not match the namespace sent "
                                             "on the request")
        involved_ns = (body.get("involvedObject") or {}).get("namespace") or ""
        if not involved_ns:  # a cluster-scoped object (a Node): the Event lives in "default" (or no namespace)
            if namespace not in ("", "default"):
                return status(422, "Invalid", f'Event "{name}" is invalid: involvedObject.namespace: Invalid value: '
                                              '"": does not match event.namespace')
        elif involved_ns != namespace:
            return status(422, "Invalid", f'Event "{name}" is invalid: involvedObject.namespace: Invalid value: '
                                          "does not match event.namespace")
        if any(e["metadata"]["name"] == name and e["metadata"]["namespace"] == namespace for e in self.events):
            return status(409, "AlreadyExists", f'events "{name}" already exists', name=name, kind="events")
        body["metadata"] = {**body["metadata"], "namespace": namespace, "resourceVersion": self._next_rv()}
        self.events.append(body)
        return web.json_response(body, status=201)

    # --- lifecycle ------------------------------------------------------------------------

    def _ssl(self) -> Optional[ssl.SSLContext]:
        if self.tls_dir is None:
            return None
        crt, key = self.tls_dir / "ca.crt", self.tls_dir / "tls.key"
        subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj",
                        "/CN=kubernetes", "-addext", "subjectAltName=IP:127.0.0.1", "-keyout", str(key),
                        "-out", str(crt)], check=True, capture_output=True, timeout=60)
        (self.tls_dir / "token").write_text(self.token)  # as the kubelet projects it: no newline
        ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        ctx.load_cert_chain(str(crt), str(key))
        return ctx

    async def wait_for(self, cond: Any, timeout: float = 10.0, what: str = "condition") -> None:
        loop = asyncio.get_running_loop()
        end = loop.time() + timeout
        while not cond():
            self.changed.clear()
            left = end - loop.time()
            if left <= 0:
                raise AssertionError(f"fake kube: timed out waiting for {what}; log: {self.log}")
            try:
                await asyncio.wait_for(self.changed.wait(), left)
            except asyncio.TimeoutError:
                pass

    def kubeconfig(self, path: Path) -> str:
        path.write_text(json.dumps({
            "apiVersion": "v1", "kind": "Config", "current-context": "fake",
            "clusters": [{"name": "fake", "cluster": {"server": self.url}}],
            "users": [{"name": "sa", "user": {"token": self.token}}],
            "contexts": [{"name": "fake", "context": {"cluster": "fake", "user": "sa"}}],
        }))
        return str(path)

    async def __aenter__(self) -> "FakeKube":
        self._runner, self.port = await serve(self._handle, self._ssl())
        return self

    async def __aexit__(self, *exc: Any) -> None:
        self._release.set()
        assert self._runner is not None
        await self._runner.cleanup()


@pytest.fixture
def kubeconfig_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    """``kubeconfig_env(kube)``: the daemon under test finds ``kube`` through ``$KUBECONFIG`` (not in-cluster)."""
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)

    def _set(kube: FakeKube) -> None:
        monkeypatch.setenv("KUBECONFIG", kube.kubeconfig(tmp_path / "kubeconfig"))
    return _set
