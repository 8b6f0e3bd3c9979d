"""Google Cloud Storage backend: JSON API over google-auth + requests, parallel composite uploads.

Why composite uploads: a resumable upload takes its chunks strictly in order
over one connection, which caps one rank at one stream. Instead each part is
uploaded in parallel as a temporary object under ``<root>.spotguard-uploads/``
(outside every ``step-*`` folder, so listings and commit records never see
them), then joined with ``compose`` (32 sources a call, in a tree) into the
final object, which appears atomically; the temporary objects are deleted.
An interrupted upload leaves only temporary objects, which ``abort`` and the
next ``prepare_attempt`` delete.

``$STORAGE_EMULATOR_HOST`` (``http://127.0.0.1:9023`` or ``127.0.0.1:9023``)
switches to an emulator without credentials; otherwise Application Default
Credentials (``google.auth.default``). Requests are bounded by the deadline.
"""

from __future__ import annotations

import os
import urllib.parse
import uuid
from concurrent.futures import Future
from datetime import datetime
from typing import Any, Iterable

from .objstore import ObjectStorage, RawObject, Upload, missing_extra, request_body

__all__ = ["GCSStorage", "GCSHTTPError", "UPLOADS_DIR"]

UPLOADS_DIR = ".spotguard-uploads/"
_COMPOSE_MAX = 32


class GCSHTTPError(Exception):
    """A non-2xx answer from the JSON API."""

    def __init__(self, status: int, text: str, what: str) -> None:
        super().__init__(f"HTTP {status} on {what}: {text[:300]}")
        self.status = status


def _import() -> Any:
    try:
        import requests
        import requests.adapters
    except ImportError as exc:
        raise missing_extra("Google Cloud Storage (gs://)", "gcs", exc) from None
    return requests


def _q(name: str) -> str:
    return urllib.parse.quote(name, safe="")


class _GCSUpload(Upload):
    def __init__(self, store: "GCSStorage", name: str) -> None:
        self.store, self.name = store, name
        self.tmp = f"{store.root}{UPLOADS_DIR}{name[len(store.root):]}/{uuid.uuid4().hex[:12]}/"
        self.sent: list[str] = []

    def part(self, number: int, data: memoryview, last: bool) -> Any:
        tmp = f"{self.tmp}{number:06d}"
        self.sent.append(tmp)
        self.store._put(tmp, data)
        return tmp

    def complete(self, tokens: list[Any], total: int) -> None:
        sources: list[str] = list(tokens)
        level = 0
        ex = self.store.executor()
        while len(sources) > _COMPOSE_MAX:  # a tree of composes, each level in parallel
            level += 1
            groups = [sources[i:i + _COMPOSE_MAX] for i in range(0, len(sources), _COMPOSE_MAX)]
            names = [f"{self.tmp}L{level}-{i:05d}" for i in range(len(groups))]
            self.sent.extend(names)
            futs: list[Future[None]] = [
                ex.submit(self.store.call, f"compose {n}", self.store._compose, n, g) for n, g in zip(names, groups)
            ]
            for f in futs:
                self.store.wait(f, f"compose of {self.name}")
            sources = names
        self.store._compose(self.name, sources)
        self._cleanup()

    def _cleanup(self) -> None:
        try:
            self.store._delete(self.sent)
        except Exception:  # noqa: BLE001 - leftovers are swept by the next prepare_attempt
            pass

    def abort(self) -> None:
        self.store._delete(self.sent)


class GCSStorage(ObjectStorage):
    """``gs://bucket/prefix``."""

    scheme = "gs"
    hidden_prefix = UPLOADS_DIR
    min_part_size = 256 * 1024
    zero_copy = True  # parts go as SegmentReader bodies straight from tensor memory (requests streams them)

    def __init__(self, uri: str, *, session: Any = None, base_url: str | None = None, **kwargs: Any) -> None:
        super().__init__(uri, **kwargs)
        requests = _import()
        self._requests = requests
        emulator = os.environ.get("STORAGE_EMULATOR_HOST", "").strip()
        if base_url is None:
            if emulator:
                base_url = emulator if "://" in emulator else f"http://{emulator}"
            else:
                base_url = "https://storage.googleapis.com"
        self.base = base_url.rstrip("/")
        if session is None:
            if emulator:
                session = requests.Session()
            else:
                try:
                    import google.auth
                    from google.auth.transport.requests import AuthorizedSession
                except ImportError as exc:
                    raise missing_extra("Google Cloud Storage (gs://)", "gcs", exc) from None
                creds, _project = google.auth.default(
                    scopes=["https://www.googleapis.com/auth/devstorage.read_write"])
                session = AuthorizedSession(creds)
            adapter = requests.adapters.HTTPAdapter(pool_connections=4, pool_maxsize=self.concurrency * 2 + 4,
                                                    max_retries=0)
            session.mount("http://", adapter)
            session.mount("https://", adapter)
        self.session = session

    # -- HTTP ------------------------------------------------------------------

    def _req(self, method: str, url: str, what: str, ok: tuple[int, ...] = (200,), **kw: Any) -> Any:
        r = self.session.request(method, url, timeout=(min(10.0, self.timeout()), self.timeout()), **kw)
        if r.status_code not in ok:
            if r.status_code == 404:
                raise FileNotFoundError(f"{self.uri}: {what}: not found")
            raise GCSHTTPError(r.status_code, r.text, what)
        return r

    def _obj_url(self, name: str) -> str:
        return f"{self.base}/storage/v1/b/{_q(self.bucket)}/o/{_q(name)}"

    def _retryable(self, exc: BaseException) -> bool:
        rx = self._requests.exceptions
        if isinstance(exc, (rx.ConnectionError, rx.Timeout, rx.ChunkedEncodingError, ConnectionError, TimeoutError)):
            return True
        if isinstance(exc, GCSHTTPError):
            return exc.status >= 500 or exc.status in (408, 429)
        return False

    # -- primitives ------------------------------------------------------------------

    def _put(self, name: str, data: memoryview) -> None:
        url = f"{self.base}/upload/storage/v1/b/{_q(self.bucket)}/o"
        self._req("POST", url, f"upload {name}", params={"uploadType": "media", "name": name},
                  data=request_body(data), headers={"Content-Type": "application/octet-stream",
                                                      "Content-Length": str(len(data))})

    def _get(self, name: str, start: int | None = None, end: int | None = None) -> bytes:
        headers = {}
        if start is not None and end is not None:
            headers["Range"] = f"bytes={start}-{end - 1}"
        r = self._req("GET", self._obj_url(name), f"get {name}", ok=(200, 206), params={"alt": "media"},
                      headers=headers)
        data = r.content
        if start is not None and end is not None and r.status_code == 200:
            data = data[start:end]  # server ignored the range
        return data

    def _head(self, name: str) -> int | None:
        try:
            return int(self._req("GET", self._obj_url(name), f"stat {name}").json()["size"])
        except FileNotFoundError:
            return None

    def _list(self, prefix: str) -> Iterable[RawObject]:
        url = f"{self.base}/storage/v1/b/{_q(self.bucket)}/o"
        token: str | None = None
        while True:
            params = {"prefix": prefix, "maxResults": "1000"}
            if token:
                params["pageToken"] = token
            try:
                doc = self._req("GET", url, f"list {prefix}", params=params).json()
            except FileNotFoundError:
                raise GCSHTTPError(404, f"bucket {self.bucket!r} does not exist", f"list {prefix}") from None
            for o in doc.get("items", []) or []:
                yield RawObject(o["name"], int(o.get("size", 0)), _mtime(o.get("updated")))
            token = doc.get("nextPageToken")
            if not token:
                return

    def _delete(self, names: list[str]) -> None:
        for n in names:
            try:
                self._req("DELETE", self._obj_url(n), f"delete {n}", ok=(200, 204))
            except FileNotFoundError:
                pass

    def _compose(self, dest: str, sources: list[str]) -> None:
        body = {"sourceObjects": [{"name": s} for s in sources],
                "destination": {"contentType": "application/octet-stream"}}
        self._req("POST", f"{self._obj_url(dest)}/compose", f"compose {dest}", json=body)

    def _start_upload(self, name: str) -> Upload:
        return _GCSUpload(self, name)

    def incomplete_uploads(self, prefix: str = "") -> list[str]:
        """Temporary part objects of unfinished uploads whose target is under root + ``prefix``."""
        full = self.root + UPLOADS_DIR + prefix
        return self.call(f"list {full}", lambda: [o.name for o in self._list(full)])

    def _abort_uploads(self, prefix: str) -> int:
        names = [o.name for o in self._list(self.root + UPLOADS_DIR + prefix[len(self.root):])]
        self._delete(names)
        return len({n.rsplit("/", 2)[0] for n in names})


def _mtime(text: str | None) -> float:
    if not text:
        return 0.0
    try:
        return datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()
    except ValueError:
        return 0.0
