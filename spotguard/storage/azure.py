"""Azure Blob backend: block blobs — ``stage_block`` in parallel, then one ``commit_block_list``.

Why block blobs: staged blocks are invisible until the block list is
committed, so a blob appears all-or-nothing, and blocks upload in parallel from
memory. Aborting = replacing the blob's uncommitted blocks with an empty Put
Blob and deleting it (Azure has no "abort" call; uncommitted blocks would
otherwise linger up to 7 days).

Credentials: ``$AZURE_STORAGE_CONNECTION_STRING`` (Azurite, account keys, SAS),
else ``$AZURE_STORAGE_ACCOUNT_URL`` / ``$AZURE_STORAGE_ACCOUNT`` with
``DefaultAzureCredential`` (needs ``azure-identity``; managed identity on a VM).
The SDK's own retries are off: ``ObjectStorage.call`` retries within the deadline.

Every Put Block / Put Blob carries ``Content-MD5`` (the transactional MD5 the
service checks; Azurite checks it too, while it ignores ``x-ms-content-crc64``),
so a body damaged in transit is refused and resent. Cost: one MD5 pass over
each block in its sending thread (~0.6-0.8 GiB/s per core, parallel across the
upload threads); ``$SPOTGUARD_AZURE_CONTENT_MD5=0`` turns it off (spotguard's
own CRC32C still covers every byte end to end).
"""

from __future__ import annotations

import base64
import os
import uuid
from typing import Any, Iterable

from .base import StorageError
from .objstore import (MemReader, ObjectStorage, RawObject, SegmentReader, Segments, Upload, body_of, missing_extra,
                       part_md5, request_body)

__all__ = ["AzureStorage"]


def _import() -> Any:
    try:
        import azure.core.exceptions
        import azure.storage.blob
    except ImportError as exc:
        raise missing_extra("Azure Blob storage (az://)", "azure", exc) from None
    return azure


def _rewinding_transport() -> Any:
    """azure-core's requests transport, rewinding our streamed bodies before every send.

    Why: after a 401 with a ``WWW-Authenticate`` challenge (Azure AD: token
    expired or revoked, tenant discovery) azure-core's bearer-token policy sends
    the same request again without rewinding its body. A zero-copy block body
    is a stream, so the resend would carry 0 bytes under the full
    ``Content-Length`` and hang until the read timeout. Only spotguard's own
    reader types are rewound; they always start at byte 0.
    """
    from azure.core.pipeline.transport import RequestsTransport

    class _RewindingTransport(RequestsTransport):  # type: ignore[misc]
        def send(self, request: Any, **kwargs: Any) -> Any:
            body = getattr(request, "content", None)
            if body is None:
                body = getattr(request, "data", None)
            if isinstance(body, (SegmentReader, MemReader)):
                body.seek(0)
            return super().send(request, **kwargs)

    return _RewindingTransport()


def _bad_digest(exc: Any) -> bool:
    """A 400 for a body whose Content-MD5 / CRC64 did not match it (damaged in transit): worth resending.
    Azure: ``Md5Mismatch`` / ``Crc64Mismatch``; Azurite: ``InvalidOperation`` "Provided contentMD5 doesn't match"."""
    if (getattr(exc, "status_code", 0) or 0) != 400:
        return False
    code = str(getattr(exc, "error_code", "") or "")
    return code in ("Md5Mismatch", "Crc64Mismatch") or "contentMD5 doesn't match" in str(exc)


class _AzureUpload(Upload):
    def __init__(self, store: "AzureStorage", name: str) -> None:
        self.store, self.name = store, name
        self.blob = store.container.get_blob_client(name)
        self.tag = uuid.uuid4().hex[:12]
        self.staged = False

    def _block_id(self, number: int) -> str:
        return base64.b64encode(f"{self.tag}-{number:06d}".encode()).decode()

    def part(self, number: int, data: memoryview, last: bool) -> Any:
        bid = self._block_id(number)
        self.staged = True
        self.blob.stage_block(bid, request_body(data), length=len(data), timeout=int(self.store.timeout()) + 1,
                              **self.store._md5_header(data))
        return bid

    def complete(self, tokens: list[Any], total: int) -> None:
        from azure.storage.blob import BlobBlock

        self.blob.commit_block_list([BlobBlock(block_id=t) for t in tokens], timeout=int(self.store.timeout()) + 1)

    def abort(self) -> None:
        if self.staged:
            self.store._discard_uncommitted(self.name)


class AzureStorage(ObjectStorage):
    """``az://container/prefix``."""

    scheme = "az"
    min_part_size = 1024 * 1024
    # Blocks go as SegmentReader bodies straight from tensor memory. Single PUTs (objects under one
    # part) are joined: upload_blob reads the whole body into bytes.
    zero_copy = True

    def __init__(self, uri: str, *, service: Any = None, credential: Any = None, account_url: str | None = None,
                 **kwargs: Any) -> None:
        """``credential`` / ``account_url``: a token credential and account instead of the environment's."""
        super().__init__(uri, **kwargs)
        azure = _import()
        self._exc = azure.core.exceptions
        if service is None:
            from azure.storage.blob import BlobServiceClient

            opts: dict[str, Any] = {"retry_total": 0, "max_single_put_size": 256 * 1024 * 1024,
                                    "connection_timeout": 10, "read_timeout": self.request_timeout,
                                    "transport": _rewinding_transport()}
            conn = os.environ.get("AZURE_STORAGE_CONNECTION_STRING")
            if conn and credential is None:
                service = BlobServiceClient.from_connection_string(conn, **opts)
            else:
                url = account_url or os.environ.get("AZURE_STORAGE_ACCOUNT_URL")
                account = os.environ.get("AZURE_STORAGE_ACCOUNT")
                if not url and account:
                    url = f"https://{account}.blob.core.windows.net"
                if not url:
                    raise StorageError("az:// storage needs $AZURE_STORAGE_CONNECTION_STRING, or "
                                       "$AZURE_STORAGE_ACCOUNT (with azure-identity for the credential)")
                if credential is None:
                    try:
                        from azure.identity import DefaultAzureCredential
                    except ImportError as exc:
                        raise StorageError(f"az:// without a connection string needs azure-identity ({exc}): "
                                           "pip install azure-identity") from None
                    credential = DefaultAzureCredential()
                service = BlobServiceClient(url, credential=credential, **opts)
        self.service = service
        self.content_md5 = os.environ.get("SPOTGUARD_AZURE_CONTENT_MD5", "").strip() not in ("0", "false", "off", "no")
        # the pool must hold as many connections as parallel block uploads
        self.container = service.get_container_client(self.bucket)

    def _retryable(self, exc: BaseException) -> bool:
        e = self._exc
        if isinstance(exc, (e.ServiceRequestError, e.ServiceResponseError, ConnectionError, TimeoutError)):
            return True
        if isinstance(exc, e.HttpResponseError):
            status = exc.status_code or 0
            return status >= 500 or status in (408, 429) or _bad_digest(exc)
        return False

    def _translate(self, exc: BaseException, what: str) -> BaseException:
        if isinstance(exc, self._exc.ResourceNotFoundError):
            code = getattr(exc, "error_code", "") or ""
            if "Container" in str(code):
                return super()._translate(RuntimeError(f"container {self.bucket!r} does not exist"), what)
            return FileNotFoundError(f"{self.uri}: {what}: not found")
        return super()._translate(exc, what)

    def _t(self) -> int:
        return int(self.timeout()) + 1

    def _put(self, name: str, data: memoryview, crc: str | None = None) -> None:
        # body_of joins Segments: upload_blob requires the whole body as bytes
        self.container.get_blob_client(name).upload_blob(body_of(data), length=len(data), overwrite=True,
                                                         timeout=self._t(), **self._md5_header(data))

    def _md5_header(self, data: "memoryview | Segments") -> dict[str, Any]:
        """``Content-MD5`` of a Put Block / Put Blob body (transactional MD5): Azure recomputes it and
        refuses (400 ``Md5Mismatch``) a body damaged in transit. Off with ``$SPOTGUARD_AZURE_CONTENT_MD5=0``."""
        if not self.content_md5:
            return {}
        return {"headers": {"Content-MD5": part_md5(data)}}

    def _get(self, name: str, start: int | None = None, end: int | None = None) -> bytes:
        kw: dict[str, Any] = {}
        if start is not None and end is not None:
            kw = {"offset": start, "length": end - start}
        return self.container.get_blob_client(name).download_blob(max_concurrency=1, timeout=self._t(),
                                                                   **kw).readall()

    def _head(self, name: str) -> int | None:
        try:
            return int(self.container.get_blob_client(name).get_blob_properties(timeout=self._t()).size)
        except self._exc.ResourceNotFoundError:
            return None

    def _list(self, prefix: str) -> Iterable[RawObject]:
        for b in self.container.list_blobs(name_starts_with=prefix, timeout=self._t()):
            yield RawObject(b.name, int(b.size or 0), b.last_modified.timestamp() if b.last_modified else 0.0)

    def _delete(self, names: list[str]) -> None:
        for i in range(0, len(names), 256):  # batch delete: at most 256 sub-requests
            batch = names[i:i + 256]
            try:
                self.container.delete_blobs(*batch, timeout=self._t())
            except self._exc.PartialBatchErrorException as exc:
                bad = [r for r in exc.parts if r.status_code not in (202, 404)]
                if bad:
                    raise RuntimeError(f"delete failed for {len(bad)} blobs") from exc
            except self._exc.HttpResponseError as exc:
                if (exc.status_code or 0) in (400, 404, 501) and "batch" in str(exc).lower() or \
                        (exc.status_code or 0) == 404:
                    self._delete_each(batch)
                else:
                    raise

    def _delete_each(self, names: list[str]) -> None:
        for n in names:
            try:
                self.container.delete_blob(n, timeout=self._t())
            except self._exc.ResourceNotFoundError:
                pass

    def _discard_uncommitted(self, name: str) -> None:
        """Drop a blob's uncommitted blocks: Put Blob (empty) replaces them, then delete it."""
        blob = self.container.get_blob_client(name)
        blob.upload_blob(b"", overwrite=True, timeout=self._t())
        try:
            blob.delete_blob(timeout=self._t())
        except self._exc.ResourceNotFoundError:
            pass

    def _start_upload(self, name: str) -> Upload:
        return _AzureUpload(self, name)

    def incomplete_uploads(self, prefix: str = "") -> list[str]:
        """Blob names under the root + ``prefix`` that hold uncommitted blocks."""
        return self.call(f"list uncommitted blobs under {self.root + prefix}", self._incomplete, prefix)

    def _incomplete(self, prefix: str) -> list[str]:
        out = []
        for b in self.container.list_blobs(name_starts_with=self.root + prefix, include=["uncommittedblobs"],
                                           timeout=self._t()):
            try:
                _committed, uncommitted = self.container.get_blob_client(b.name).get_block_list(
                    "uncommitted", timeout=self._t())
            except self._exc.ResourceNotFoundError:
                continue
            if uncommitted and not _committed:  # never rewrite a committed blob
                out.append(b.name)
        return out

    def _abort_uploads(self, prefix: str) -> int:
        names = self._incomplete(prefix[len(self.root):])
        for n in names:
            self._discard_uncommitted(n)
        return len(names)
