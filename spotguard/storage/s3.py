"""S3 (and S3-compatible) backend: boto3 multipart uploads from memory, ranged GETs.

Why spotguard retries instead of botocore: botocore's retry loop does not know
the notice deadline and would happily sleep past it. Its own retries are off
(one attempt per call); ``ObjectStorage.call`` retries 5xx / SlowDown /
throttling / resets with jittered backoff bounded by ``storage.deadline``.

Endpoint: ``$AWS_ENDPOINT_URL_S3``, else ``$AWS_ENDPOINT_URL`` (MinIO, moto,
LocalStack, ...); path-style addressing is used whenever an endpoint is set.
Request checksums default to ``when_required`` (override with the standard
``$AWS_REQUEST_CHECKSUM_CALCULATION``): TLS already protects the bytes and the
CRC costs CPU on the critical path. For the same reason bodies are sent as
``UNSIGNED-PAYLOAD`` over https (botocore would otherwise SHA-256 every byte
when no checksum header is present: ~1.1 GiB/s of one core, the single largest
CPU cost of an upload); over plain http, where nothing else protects the body,
it stays signed unless ``$SPOTGUARD_S3_SIGN_PAYLOAD=0`` (``=1`` always signs).

Zero-copy: part bodies that are not a whole pooled buffer (tensor memory,
``Segments``) go as a ``SegmentReader``, which hands urllib3 memoryviews of the
ranges, so the bytes are never copied in Python.
"""

from __future__ import annotations

import os
from typing import Any, Iterable

from .objstore import ObjectStorage, RawObject, Upload, missing_extra, part_crc32c, request_body

__all__ = ["S3Storage"]

_RETRY_CODES = {
    "SlowDown", "Throttling", "ThrottlingException", "RequestThrottled", "TooManyRequests",
    "RequestTimeout", "RequestTimeTooSkewed", "InternalError", "ServiceUnavailable", "503", "500",
    "BadDigest",  # a body corrupted in flight
}
_NOT_FOUND = {"NoSuchKey", "404", "NotFound"}


def _drop_expect(params: Any, **kwargs: Any) -> None:
    """botocore adds ``Expect: 100-continue`` for file-like bodies: one more round trip per part,
    and a full second's wait on servers that never answer it. Bytes bodies go without it."""
    headers = params.get("headers") if isinstance(params, dict) else None
    if isinstance(headers, dict):
        headers.pop("Expect", None)


def _sign_payload(endpoint: str | None) -> bool:
    """Whether botocore SHA-256-hashes every body (``$SPOTGUARD_S3_SIGN_PAYLOAD``: 1, 0, default auto)."""
    raw = os.environ.get("SPOTGUARD_S3_SIGN_PAYLOAD", "").strip().lower()
    if raw in ("1", "true", "yes", "on"):
        return True
    if raw in ("0", "false", "no", "off"):
        return False
    return bool(endpoint) and not str(endpoint).lower().startswith("https://")


def _import() -> tuple[Any, Any]:
    try:
        import boto3
        import botocore.config
        import botocore.exceptions
    except ImportError as exc:
        raise missing_extra("S3 storage (s3://)", "s3", exc) from None
    return boto3, botocore


class _S3Upload(Upload):
    def __init__(self, store: "S3Storage", name: str, upload_id: str) -> None:
        self.store, self.name, self.upload_id = store, name, upload_id

    def part(self, number: int, data: memoryview, last: bool) -> Any:
        crc = self.crc_of(number, data)  # S3 refuses a part whose bytes do not match it (BadDigest)
        r = self.store.client.upload_part(Bucket=self.store.bucket, Key=self.name, UploadId=self.upload_id,
                                          PartNumber=number, Body=request_body(data), ContentLength=len(data),
                                          ChecksumAlgorithm="CRC32C", ChecksumCRC32C=crc)
        return {"PartNumber": number, "ETag": r["ETag"], "ChecksumCRC32C": crc}

    def complete(self, tokens: list[Any], total: int) -> None:
        try:
            self.store.client.complete_multipart_upload(
                Bucket=self.store.bucket, Key=self.name, UploadId=self.upload_id,
                MultipartUpload={"Parts": tokens})
        except Exception as exc:
            # A retried complete whose first try succeeded: the upload is gone but the object is there.
            if _code(exc) == "NoSuchUpload" and self.store._head(self.name) == total:
                return
            raise

    def abort(self) -> None:
        try:
            self.store.client.abort_multipart_upload(Bucket=self.store.bucket, Key=self.name,
                                                     UploadId=self.upload_id)
        except Exception as exc:
            if _code(exc) != "NoSuchUpload":
                raise


def _code(exc: BaseException) -> str:
    resp = getattr(exc, "response", None)
    if isinstance(resp, dict):
        return str(resp.get("Error", {}).get("Code", ""))
    return ""


def _status(exc: BaseException) -> int:
    resp = getattr(exc, "response", None)
    if isinstance(resp, dict):
        return int(resp.get("ResponseMetadata", {}).get("HTTPStatusCode", 0) or 0)
    return 0


class S3Storage(ObjectStorage):
    """``s3://bucket/prefix``."""

    scheme = "s3"
    min_part_size = 5 * 1024 * 1024  # S3's minimum for every part but the last
    zero_copy = True  # parts go as SegmentReader bodies straight from tensor memory

    def __init__(self, uri: str, *, client: Any = None, **kwargs: Any) -> None:
        super().__init__(uri, **kwargs)
        boto3, botocore = _import()
        self._botocore = botocore
        if client is None:
            endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL") or None
            cfg: dict[str, Any] = {
                "retries": {"total_max_attempts": 1, "mode": "standard"},
                "max_pool_connections": max(10, self.concurrency * 2 + 4),
                "connect_timeout": 10,
                "read_timeout": self.request_timeout,
                "tcp_keepalive": True,
            }
            s3cfg: dict[str, Any] = {"payload_signing_enabled": _sign_payload(endpoint)}
            if endpoint:
                s3cfg["addressing_style"] = "path"
            cfg["s3"] = s3cfg
            if not os.environ.get("AWS_REQUEST_CHECKSUM_CALCULATION"):
                cfg["request_checksum_calculation"] = "when_required"
            if not os.environ.get("AWS_RESPONSE_CHECKSUM_VALIDATION"):
                cfg["response_checksum_validation"] = "when_required"
            session = boto3.session.Session()
            region = session.region_name or os.environ.get("AWS_DEFAULT_REGION") or "us-east-1"
            client = session.client("s3", endpoint_url=endpoint, region_name=region,
                                    config=botocore.config.Config(**cfg))
            for op in ("UploadPart", "PutObject"):
                client.meta.events.register(f"before-call.s3.{op}", _drop_expect,
                                            unique_id=f"spotguard-drop-expect-{op}")
        self.client = client

    def _retryable(self, exc: BaseException) -> bool:
        bexc = self._botocore.exceptions
        if isinstance(exc, (bexc.ConnectionError, bexc.HTTPClientError, ConnectionError, TimeoutError)):
            return True
        if isinstance(exc, bexc.ClientError):
            status = _status(exc)
            return status >= 500 or status == 429 or _code(exc) in _RETRY_CODES
        return isinstance(exc, bexc.IncompleteReadError) if hasattr(bexc, "IncompleteReadError") else False

    def _translate(self, exc: BaseException, what: str) -> BaseException:
        if _code(exc) == "NoSuchBucket":
            return super()._translate(RuntimeError(f"bucket {self.bucket!r} does not exist"), what)
        if _code(exc) in _NOT_FOUND or _status(exc) == 404:
            return FileNotFoundError(f"{self.uri}: {what}: not found")
        return super()._translate(exc, what)

    def _put(self, name: str, data: memoryview, crc: str | None = None) -> None:
        self.client.put_object(Bucket=self.bucket, Key=name, Body=request_body(data), ContentLength=len(data),
                               ChecksumAlgorithm="CRC32C", ChecksumCRC32C=crc or part_crc32c(data))

    def _get(self, name: str, start: int | None = None, end: int | None = None) -> bytes:
        kw: dict[str, Any] = {}
        if start is not None and end is not None:
            kw["Range"] = f"bytes={start}-{end - 1}"
        r = self.client.get_object(Bucket=self.bucket, Key=name, **kw)
        return r["Body"].read()

    def _head(self, name: str) -> int | None:
        try:
            return int(self.client.head_object(Bucket=self.bucket, Key=name)["ContentLength"])
        except self._botocore.exceptions.ClientError as exc:
            if _status(exc) == 404 or _code(exc) in _NOT_FOUND:
                return None
            raise

    def _list(self, prefix: str) -> Iterable[RawObject]:
        pages = self.client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=prefix)
        for page in pages:
            for o in page.get("Contents", []) or []:
                yield RawObject(o["Key"], int(o["Size"]), o["LastModified"].timestamp())

    def _delete(self, names: list[str]) -> None:
        r = self.client.delete_objects(Bucket=self.bucket,
                                       Delete={"Objects": [{"Key": n} for n in names], "Quiet": True})
        errs = [e for e in r.get("Errors", []) or [] if e.get("Code") != "NoSuchKey"]
        if errs:
            raise RuntimeError(f"delete failed for {len(errs)} objects, first: {errs[0]}")

    def _start_upload(self, name: str) -> Upload:
        r = self.client.create_multipart_upload(Bucket=self.bucket, Key=name, ChecksumAlgorithm="CRC32C")
        return _S3Upload(self, name, r["UploadId"])

    def incomplete_uploads(self, prefix: str = "") -> list[tuple[str, str]]:
        """(object name, upload id) of every unfinished multipart upload under the root + ``prefix``."""
        return self.call(f"list uploads under {self.root + prefix}", self._incomplete, prefix)

    def _incomplete(self, prefix: str) -> list[tuple[str, str]]:
        out: list[tuple[str, str]] = []
        pages = self.client.get_paginator("list_multipart_uploads").paginate(Bucket=self.bucket,
                                                                             Prefix=self.root + prefix)
        for page in pages:
            for u in page.get("Uploads", []) or []:
                out.append((u["Key"], u["UploadId"]))
        return out

    def _abort_uploads(self, prefix: str) -> int:
        n = 0
        for name, upload_id in self._incomplete(prefix[len(self.root):]):
            _S3Upload(self, name, upload_id).abort()
            n += 1
        return n
