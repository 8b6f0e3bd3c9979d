"""Google Cloud Storage backend: JSON API over google-auth + requests; parallel parts by XML API multipart.

Parallel uploads, two ways (``$SPOTGUARD_GCS_MULTIPART``):

- ``xml`` (default on real GCS): the XML API's multipart upload — initiate,
  PUT numbered parts in parallel, complete with the list of ETags, or abort.
  No temporary objects: nothing for soft delete (7 days by default) or
  Nearline/Coldline early deletion to bill, and no 32-source compose tree.
  Unfinished uploads are listed (``GET /BUCKET?uploads``) and aborted by the
  next ``prepare_attempt``.
- ``compose`` (default with ``$STORAGE_EMULATOR_HOST``: the emulators have no
  XML API): each part is uploaded as a temporary object under
  ``<root>.spotguard-uploads/`` (outside every ``step-*`` folder, so listings
  and commit records never see them), then joined with ``compose`` (32 sources
  a call, in a tree) into the final object, which appears atomically; the
  temporary objects are deleted. An interrupted upload leaves only temporary
  objects, which ``abort`` and the next ``prepare_attempt`` delete.

Why not resumable uploads: their chunks go strictly in order over one
connection, which caps one rank at one stream.

The store checks every body: XML API parts carry ``x-goog-hash: crc32c=``,
whole objects (small files, composite parts) go as JSON API multipart
uploads whose metadata holds ``crc32c``; GCS recomputes it and refuses a body
damaged in transit (400), which is retried. The CRC32C comes from the
stream's block checksums where the part is block-aligned (no second pass).

``$STORAGE_EMULATOR_HOST`` (``http://127.0.0.1:9023`` or ``127.0.0.1:9023``)
switches to an emulator without credentials; otherwise Application Default
Credentials (``google.auth.default``), whose bearer token both APIs accept.
Requests are bounded by the deadline.
"""

from __future__ import annotations

import json
import os
import re
import threading
import urllib.parse
import uuid
from xml.etree import ElementTree
from xml.sax.saxutils import escape
from concurrent.futures import Future
from datetime import datetime
from typing import Any, Iterable

from .base import StorageError
from .objstore import (ObjectStorage, RawObject, SegmentReader, Segments, Upload, missing_extra, part_crc32c,
                       request_body)

__all__ = ["GCSStorage", "GCSHTTPError", "UPLOADS_DIR"]

UPLOADS_DIR = ".spotguard-uploads/"
# GCS's answers to a checksum that does not match the body: XML API <Code>BadDigest</Code> / InvalidDigest,
# JSON API 'Provided CRC32C "..." doesn't match calculated CRC32C "..."'
_BAD_DIGEST = re.compile(r"BadDigest|InvalidDigest|(CRC32C|MD5)[^.]*(doesn't|does not|did not) match", re.I)
_COMPOSE_MAX = 32


class GCSHTTPError(Exception):
    """A non-2xx answer from the JSON or XML API (``code``: the XML API's error code, if any).

    ``token_refreshed``: a 401 after which the credentials were refreshed, so a retry may pass.
    """

    def __init__(self, status: int, text: str, what: str, token_refreshed: bool = False) -> None:
        super().__init__(f"HTTP {status} on {what}: {text[:300]}")
        self.status = status
        self.token_refreshed = token_refreshed
        m = re.search(r"<Code>([^<]*)</Code>", text or "")
        self.code = m.group(1) if m else ""
        #: the store refused a body whose checksum did not match (damaged in transit): worth resending
        self.bad_digest = status == 400 and bool(_BAD_DIGEST.search(text or ""))


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
        self.store._put(tmp, data, self.crc_of(number, data))  # checked by GCS, see _put
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


def _xml_root(r: Any, what: str) -> ElementTree.Element:
    """The XML API answer's document; one that is not XML (a proxy's HTML page) is a retryable 502."""
    try:
        return ElementTree.fromstring(r.content)
    except ElementTree.ParseError as exc:
        raise GCSHTTPError(502, f"answer is not XML ({exc}): {r.text[:200]}", what) from None


def _xml_text(root: ElementTree.Element, tag: str) -> list[str]:
    """Every ``tag`` element's text (namespaced or not)."""
    return [el.text or "" for el in root.iter() if el.tag == tag or el.tag.endswith("}" + tag)]


class _GCSXMLUpload(Upload):
    """XML API multipart upload: parts in parallel, any order; ``complete`` lists them with their ETags."""

    def __init__(self, store: "GCSStorage", name: str) -> None:
        self.store, self.name = store, name
        what = f"start upload {name}"
        r = store._req("POST", store._xml_url(name) + "?uploads", what,  # the documented form: no "="
                       headers={"Content-Type": "application/octet-stream", "Content-Length": "0"})
        ids = _xml_text(_xml_root(r, what), "UploadId")
        if not ids or not ids[0]:
            raise GCSHTTPError(r.status_code, r.text, f"start upload {name}: no UploadId in the answer")
        self.upload_id = ids[0]

    def part(self, number: int, data: memoryview, last: bool) -> Any:
        # x-goog-hash: GCS recomputes the part's CRC32C and refuses (400 BadDigest) a damaged body
        r = self.store._req("PUT", self.store._xml_url(self.name), f"part {number} of {self.name}",
                            params={"partNumber": str(number), "uploadId": self.upload_id},
                            data=request_body(data), headers={"Content-Length": str(len(data)),
                                                              "x-goog-hash": f"crc32c={self.crc_of(number, data)}"})
        etag = r.headers.get("ETag")
        if not etag:
            raise GCSHTTPError(r.status_code, "no ETag header", f"part {number} of {self.name}")
        return (number, etag)

    def complete(self, tokens: list[Any], total: int) -> None:
        body = "<CompleteMultipartUpload>" + "".join(
            f"<Part><PartNumber>{n}</PartNumber><ETag>{escape(etag)}</ETag></Part>" for n, etag in tokens
        ) + "</CompleteMultipartUpload>"
        try:
            r = self.store._req("POST", self.store._xml_url(self.name), f"complete {self.name}",
                                params={"uploadId": self.upload_id}, data=body.encode(),
                                headers={"Content-Type": "application/xml"})
        except (GCSHTTPError, FileNotFoundError) as exc:
            # A retried complete whose first try succeeded: the upload is gone, the object is there.
            gone = isinstance(exc, FileNotFoundError) or exc.code == "NoSuchUpload"
            if gone and self.store._head(self.name) == total:
                return
            raise
        if b"<Error>" in r.content:  # an error inside a 200, as S3 may answer a complete
            raise GCSHTTPError(500, r.text, f"complete {self.name}")

    def abort(self) -> None:
        self.store._abort_xml(self.name, self.upload_id)


class GCSStorage(ObjectStorage):
    """``gs://bucket/prefix``."""

    scheme = "gs"
    hidden_prefix = UPLOADS_DIR
    min_part_size = 256 * 1024
    zero_copy = True  # parts go as SegmentReader bodies straight from tensor memory (requests streams them)

    def __init__(self, uri: str, *, session: Any = None, base_url: str | None = None, multipart: str | None = None,
                 credentials: Any = None, **kwargs: Any) -> None:
        """``credentials``: google-auth credentials instead of Application Default Credentials."""
        emulator = os.environ.get("STORAGE_EMULATOR_HOST", "").strip()
        mode = (multipart or os.environ.get("SPOTGUARD_GCS_MULTIPART", "").strip().lower()
                or ("compose" if emulator else "xml"))
        if mode not in ("xml", "compose"):
            raise StorageError(f"$SPOTGUARD_GCS_MULTIPART={mode!r}: use 'xml' (XML API multipart uploads) or "
                               "'compose' (parallel composite uploads)")
        self.multipart = mode
        if mode == "xml":
            self.min_part_size = 5 * 1024 * 1024  # the XML API's minimum for every part but the last
        super().__init__(uri, **kwargs)
        requests = _import()
        self._requests = requests
        if base_url is None:
            if emulator:
                base_url = emulator if "://" in emulator else f"http://{emulator}"
            else:
                base_url = "https://storage.googleapis.com"
        self.base = base_url.rstrip("/")
        self._credentials: Any = None
        self._refresh_lock = threading.Lock()
        if session is None:
            if emulator and credentials is None:
                session = requests.Session()
            else:
                try:
                    import google.auth
                    import google.auth.exceptions
                    from google.auth.transport.requests import AuthorizedSession
                except ImportError as exc:
                    raise missing_extra("Google Cloud Storage (gs://)", "gcs", exc) from None
                if credentials is None:
                    try:
                        credentials, _project = google.auth.default(
                            scopes=["https://www.googleapis.com/auth/devstorage.read_write"])
                    except google.auth.exceptions.DefaultCredentialsError as exc:
                        raise StorageError(
                            f"gs:// needs Google credentials and none were found ({exc}): attach a service "
                            "account to the VM, set GOOGLE_APPLICATION_CREDENTIALS to a key file, or run "
                            "`gcloud auth application-default login`; for an emulator set STORAGE_EMULATOR_HOST"
                        ) from None
                self._credentials = credentials
                # No resend on 401 inside the session: it would resend a streamed (zero-copy) body from
                # where the first send left it. _req refreshes and the retry builds a fresh body.
                session = AuthorizedSession(credentials, refresh_status_codes=())
            adapter = requests.adapters.HTTPAdapter(pool_connections=4, pool_maxsize=self.concurrency * 2 + 4,
                                                    max_retries=0)
            session.mount("http://", adapter)
            session.mount("https://", adapter)
        self.session = session

    # -- HTTP ------------------------------------------------------------------

    def _req(self, method: str, url: str, what: str, ok: tuple[int, ...] = (200,), **kw: Any) -> Any:
        creds = self._credentials
        token = getattr(creds, "token", None)
        r = self.session.request(method, url, timeout=(min(10.0, self.timeout()), self.timeout()), **kw)
        if r.status_code not in ok:
            if r.status_code == 404:
                raise FileNotFoundError(f"{self.uri}: {what}: not found")
            if r.status_code == 401 and creds is not None:
                self._refresh(token)
                raise GCSHTTPError(401, r.text, what, token_refreshed=True)
            raise GCSHTTPError(r.status_code, r.text, what)
        return r

    def _refresh(self, rejected: Any) -> None:
        """New credentials after a 401 (once for all the threads that saw the same token rejected)."""
        with self._refresh_lock:
            if getattr(self._credentials, "token", None) != rejected:
                return  # another thread already refreshed
            from google.auth.transport.requests import Request

            try:
                self._credentials.refresh(Request())
            except Exception as exc:  # noqa: BLE001 - google.auth.exceptions.RefreshError and transport errors
                raise StorageError(f"{self.uri}: GCS rejected the access token and refreshing it failed ({exc}); "
                                   "check the VM's service account / Application Default Credentials") from exc

    def _obj_url(self, name: str) -> str:
        return f"{self.base}/storage/v1/b/{_q(self.bucket)}/o/{_q(name)}"

    def _xml_url(self, name: str = "") -> str:
        """XML API, path style: ``https://storage.googleapis.com/BUCKET/OBJECT``."""
        url = f"{self.base}/{_q(self.bucket)}"
        return f"{url}/{urllib.parse.quote(name, safe='/')}" if name else url

    def _retryable(self, exc: BaseException) -> bool:
        rx = self._requests.exceptions
        if isinstance(exc, (rx.ConnectionError, rx.Timeout, rx.ChunkedEncodingError, ConnectionError, TimeoutError)):
            return True
        if isinstance(exc, GCSHTTPError):
            return exc.status >= 500 or exc.status in (408, 429) or exc.token_refreshed or exc.bad_digest
        return False

    # -- primitives ------------------------------------------------------------------

    def _put(self, name: str, data: "memoryview | Segments", crc: str | None = None) -> None:
        """A JSON API multipart upload whose metadata carries the body's CRC32C: GCS recomputes it and
        refuses (400) a body damaged in transit. The body is sent from ``data``'s memory, between the
        metadata part and the closing boundary, without joining it."""
        crc = crc or part_crc32c(data)
        boundary = f"spotguard-{uuid.uuid4().hex}"
        meta = json.dumps({"name": name, "crc32c": crc, "contentType": "application/octet-stream"})
        head = (f"--{boundary}\r\nContent-Type: application/json; charset=UTF-8\r\n\r\n{meta}\r\n"
                f"--{boundary}\r\nContent-Type: application/octet-stream\r\n\r\n").encode()
        tail = f"\r\n--{boundary}--\r\n".encode()
        views = data.views if isinstance(data, Segments) else (memoryview(data).cast("B"),)
        body = Segments([memoryview(head), *views, memoryview(tail)])
        url = f"{self.base}/upload/storage/v1/b/{_q(self.bucket)}/o"
        self._req("POST", url, f"upload {name}", params={"uploadType": "multipart"},
                  data=SegmentReader(body), headers={"Content-Type": f"multipart/related; boundary={boundary}",
                                                     "Content-Length": str(len(body))})

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
        return _GCSXMLUpload(self, name) if self.multipart == "xml" else _GCSUpload(self, name)

    def _xml_uploads(self, prefix: str) -> list[tuple[str, str]]:
        """(object name, upload id) of every unfinished XML API multipart upload under ``prefix`` (full name)."""
        out: list[tuple[str, str]] = []
        params: dict[str, str] = {"prefix": prefix}
        what = f"list uploads under {prefix}"
        while True:
            r = self._req("GET", f"{self._xml_url()}?uploads&{urllib.parse.urlencode(params)}", what)
            root = _xml_root(r, what)
            local = {el: el.tag.rsplit("}", 1)[-1] for el in root.iter()}
            for up in (el for el, tag in local.items() if tag == "Upload"):
                fields = {local[c]: c.text or "" for c in up}
                if fields.get("Key") and fields.get("UploadId"):
                    out.append((fields["Key"], fields["UploadId"]))
            flags = {tag: el.text or "" for el, tag in local.items() if el is not root and tag in (
                "IsTruncated", "NextKeyMarker", "NextUploadIdMarker")}
            if flags.get("IsTruncated", "false").lower() != "true" or not flags.get("NextKeyMarker"):
                return out
            params = {"prefix": prefix, "key-marker": flags["NextKeyMarker"],
                      "upload-id-marker": flags.get("NextUploadIdMarker", "")}

    def _abort_xml(self, name: str, upload_id: str) -> None:
        try:
            self._req("DELETE", self._xml_url(name), f"abort upload of {name}", ok=(200, 204),
                      params={"uploadId": upload_id})
        except FileNotFoundError:
            pass  # already gone (a retried abort, or completed meanwhile)

    def incomplete_uploads(self, prefix: str = "") -> list[str]:
        """Unfinished uploads whose target is under root + ``prefix``: XML API uploads (``name?uploadId=``)
        and temporary part objects of composite uploads."""
        full = self.root + UPLOADS_DIR + prefix
        names = self.call(f"list {full}", lambda: [o.name for o in self._list(full)])
        if self.multipart == "xml":
            ups = self.call(f"list uploads under {self.root + prefix}", self._xml_uploads, self.root + prefix)
            names += [f"{n}?uploadId={u}" for n, u in ups]
        return names

    def _abort_uploads(self, prefix: str) -> int:
        names = [o.name for o in self._list(self.root + UPLOADS_DIR + prefix[len(self.root):])]
        self._delete(names)
        count = len({n.rsplit("/", 2)[0] for n in names})
        if self.multipart == "xml":
            for name, upload_id in self._xml_uploads(prefix):
                self._abort_xml(name, upload_id)
                count += 1
        return count


def _mtime(text: str | None) -> float:
    if not text:
        return 0.0
    try:
        return datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()
    except ValueError:
        return 0.0
