"""GCS XML API multipart uploads, which no local GCS emulator implements, against Google's documented answers.

``responses`` replays the provider's documented request/response shapes
(cloud.google.com/storage/docs/xml-api: post-object-multipart,
put-object-multipart, post-object-complete, delete-multipart,
get-bucket-uploads): namespaced ``InitiateMultipartUploadResult`` /
``ListMultipartUploadsResult`` bodies, quoted ``ETag`` headers, 204 on abort,
``<Error><Code>`` bodies. Behind them sits a small in-memory bucket (plus the
JSON API calls the backend also makes), so a whole DCP save, commit and load
runs through the XML path.
"""

from __future__ import annotations

import base64
import hashlib
import json
import re
import urllib.parse
from typing import Any, Iterator

import pytest
import torch
import torch.distributed.checkpoint as dcp

requests = pytest.importorskip("requests")
responses = pytest.importorskip("responses")

from spotguard.storage import StorageError  # noqa: E402
from spotguard.storage.commit import CommitRecord, commit, newest_committed, prepare_attempt  # noqa: E402
from spotguard.storage.gcs import UPLOADS_DIR, GCSStorage  # noqa: E402
from spotguard.storage.integrity import crc32c  # noqa: E402

BASE = "https://storage.googleapis.com"
BUCKET = "travel-maps"
NS = "http://s3.amazonaws.com/doc/2006-03-01/"
MiB = 1024 * 1024


def _crc_b64(data: bytes) -> str:
    return base64.b64encode(crc32c(data).to_bytes(4, "big")).decode()


def _error(status: int, code: str, message: str) -> tuple[int, dict[str, str], str]:
    body = f"<?xml version='1.0' encoding='UTF-8'?><Error><Code>{code}</Code><Message>{message}</Message></Error>"
    return status, {"Content-Type": "application/xml"}, body


class FakeGCS:
    """Just enough of GCS (XML multipart + the JSON calls spotguard makes) to hold real checkpoints."""

    def __init__(self, rsps: Any) -> None:
        self.objects: dict[str, bytes] = {}
        self.uploads: dict[str, tuple[str, dict[int, bytes]]] = {}
        self.completed: list[str] = []  # object names completed through the XML API
        self.complete_bodies: list[bytes] = []
        self.etags: dict[tuple[str, int], str] = {}
        self.aborted: list[str] = []
        self.media_puts: list[str] = []  # JSON API simple uploads (object names)
        self.fail: list[dict[str, Any]] = []  # queued faults: {"method", "match", "answer", "after"}
        self.list_page = 1000
        self.hashes: list[tuple[str, str | None]] = []  # (API, crc32c the client sent) per body
        self.corrupt = 0  # damage this many more bodies in transit
        self.corrupted = 0
        q = re.escape(BASE)
        rsps.add_callback("POST", re.compile(q + r"/upload/storage/v1/b/[^/]+/o\b.*"), self._media_upload)
        rsps.add_callback("GET", re.compile(q + r"/storage/v1/b/[^/]+/o/[^/?]+.*"), self._json_get)
        rsps.add_callback("GET", re.compile(q + r"/storage/v1/b/[^/]+/o(\?.*)?$"), self._json_list)
        rsps.add_callback("DELETE", re.compile(q + r"/storage/v1/b/[^/]+/o/.*"), self._json_delete)
        xml = re.compile(q + r"/" + re.escape(BUCKET) + r"(/.*|\?.*|)$")
        for method in ("POST", "PUT", "GET", "DELETE"):
            rsps.add_callback(method, xml, self._xml)

    # -- helpers -----------------------------------------------------------------

    @staticmethod
    def _body(request: Any) -> bytes:
        b = request.body
        if b is None:
            return b""
        if hasattr(b, "read"):
            return bytes(b.read())
        return bytes(b) if not isinstance(b, str) else b.encode()

    def _fault(self, method: str, url: str) -> Any:
        for f in self.fail:
            if f["method"] == method and re.search(f["match"], url):
                if f.get("after", 0) > 0:
                    f["after"] -= 1
                    return None
                f["count"] = f.get("count", 1) - 1
                if f["count"] <= 0:
                    self.fail.remove(f)
                return f["answer"]
        return None

    # -- JSON API ----------------------------------------------------------------

    def _media_upload(self, request: Any) -> Any:
        """``uploadType=multipart``: a JSON metadata part (name, crc32c) and the media; GCS recomputes the
        CRC32C and answers 400 on a mismatch (cloud.google.com/storage/docs/uploading-objects#uploading-an-object,
        data-validation)."""
        q = urllib.parse.parse_qs(urllib.parse.urlsplit(request.url).query)
        assert q["uploadType"] == ["multipart"]
        body = self._body(request)
        assert int(request.headers["Content-Length"]) == len(body)
        boundary = re.search(r"boundary=(\S+)", request.headers["Content-Type"]).group(1).encode()
        _, meta_part, media_part, end = body.split(b"--" + boundary)
        assert end == b"--\r\n"
        meta = json.loads(meta_part.split(b"\r\n\r\n", 1)[1])
        data = self.damage(media_part.split(b"\r\n\r\n", 1)[1][:-2])
        name = meta["name"]
        self.hashes.append(("json", meta.get("crc32c")))
        if meta.get("crc32c") != _crc_b64(data):
            msg = f'Provided CRC32C "{meta.get("crc32c")}" doesn\'t match calculated CRC32C "{_crc_b64(data)}".'
            return 400, {}, json.dumps({"error": {"code": 400, "message": msg}})
        self.objects[name] = data
        self.media_puts.append(name)
        return 200, {}, json.dumps({"name": name, "size": str(len(data))})

    def damage(self, data: bytes) -> bytes:
        """The body as the server got it: one byte flipped while ``corrupt`` > 0 (damage in transit)."""
        if self.corrupt <= 0:
            return data
        self.corrupt -= 1
        self.corrupted += 1
        b = bytearray(data)
        b[len(b) // 2] ^= 0x01
        return bytes(b)

    def _name_of(self, url: str) -> str:
        path = urllib.parse.urlsplit(url).path
        return urllib.parse.unquote(path.split("/o/", 1)[1])

    def _json_get(self, request: Any) -> Any:
        name = self._name_of(request.url)
        if name not in self.objects:
            return 404, {}, json.dumps({"error": {"code": 404, "message": "No such object"}})
        data = self.objects[name]
        if "alt=media" in request.url:
            rng = request.headers.get("Range")
            if rng:
                a, b = (int(x) for x in rng.split("=")[1].split("-"))
                return 206, {}, data[a:b + 1]
            return 200, {}, data
        return 200, {}, json.dumps({"name": name, "size": str(len(data)), "updated": "2026-12-02T10:00:00.000Z"})

    def _json_list(self, request: Any) -> Any:
        q = urllib.parse.parse_qs(urllib.parse.urlsplit(request.url).query)
        prefix = q.get("prefix", [""])[0]
        items = [{"name": n, "size": str(len(d)), "updated": "2026-12-02T10:00:00.000Z"}
                 for n, d in sorted(self.objects.items()) if n.startswith(prefix)]
        return 200, {}, json.dumps({"items": items})

    def _json_delete(self, request: Any) -> Any:
        name = self._name_of(request.url)
        if self.objects.pop(name, None) is None:
            return 404, {}, json.dumps({"error": {"code": 404}})
        return 204, {}, ""

    # -- XML API (documented shapes) ---------------------------------------------

    def _xml(self, request: Any) -> Any:
        fault = self._fault(request.method, request.url)
        if fault is not None:
            if callable(fault):
                return fault(request)
            return fault
        parts = urllib.parse.urlsplit(request.url)
        q = urllib.parse.parse_qs(parts.query, keep_blank_values=True)
        key = urllib.parse.unquote(parts.path[len(f"/{BUCKET}"):].lstrip("/"))
        if request.method == "POST" and "uploads" in q:
            assert request.headers.get("Content-Length") == "0"
            uid = hashlib.sha1(f"{key}-{len(self.uploads)}".encode()).hexdigest()
            self.uploads[uid] = (key, {})
            return 200, {"Content-Type": "application/xml"}, (
                f'<?xml version="1.0" encoding="UTF-8"?><InitiateMultipartUploadResult xmlns="{NS}">'
                f"<Bucket>{BUCKET}</Bucket><Key>{key}</Key><UploadId>{uid}</UploadId>"
                "</InitiateMultipartUploadResult>")
        if request.method == "PUT" and "partNumber" in q:
            uid, n = q["uploadId"][0], int(q["partNumber"][0])
            if uid not in self.uploads:
                return _error(404, "NoSuchUpload", "The requested upload was not found.")
            data = self._body(request)
            assert int(request.headers["Content-Length"]) == len(data)
            data = self.damage(data)
            sent = dict(h.split("=", 1) for h in request.headers.get("x-goog-hash", "").split(",") if "=" in h)
            self.hashes.append(("xml", sent.get("crc32c")))
            if "crc32c" in sent and sent["crc32c"] != _crc_b64(data):
                return _error(400, "BadDigest", "The CRC32C you specified did not match what we received.")
            self.uploads[uid][1][n] = data
            etag = '"' + hashlib.md5(data).hexdigest() + '"'
            self.etags[(uid, n)] = etag
            return 200, {"ETag": etag, "x-goog-hash": "crc32c=n03x6A==", "Content-Length": "0"}, ""
        if request.method == "POST" and "uploadId" in q:
            uid = q["uploadId"][0]
            if uid not in self.uploads:
                return _error(404, "NoSuchUpload", "The requested upload was not found.")
            body = self._body(request)
            self.complete_bodies.append(body)
            listed = re.findall(rb"<Part><PartNumber>(\d+)</PartNumber><ETag>([^<]*)</ETag></Part>", body)
            name, have = self.uploads[uid]
            for n, etag in listed:
                if self.etags.get((uid, int(n))) != etag.decode():
                    return _error(400, "InvalidPart", "One or more of the specified parts could not be found.")
            self.objects[name] = b"".join(have[int(n)] for n, _ in listed)
            del self.uploads[uid]
            self.completed.append(name)
            return 200, {"Content-Type": "application/xml"}, (
                f'<?xml version="1.0" encoding="UTF-8"?><CompleteMultipartUploadResult xmlns="{NS}">'
                f"<Location>http://{BUCKET}.storage.googleapis.com/{name}</Location><Bucket>{BUCKET}</Bucket>"
                f'<Key>{name}</Key><ETag>"7fc8f92280ac3c975f300cb64412c16f-{len(listed)}"</ETag>'
                "</CompleteMultipartUploadResult>")
        if request.method == "DELETE" and "uploadId" in q:
            uid = q["uploadId"][0]
            if self.uploads.pop(uid, None) is None:
                return _error(404, "NoSuchUpload", "The requested upload was not found.")
            self.aborted.append(uid)
            return 204, {}, ""
        if request.method == "GET" and "uploads" in q:
            prefix = q.get("prefix", [""])[0]
            mine = sorted((n, u) for u, (n, _) in self.uploads.items() if n.startswith(prefix))
            if "key-marker" in q:
                marker = (q["key-marker"][0], q.get("upload-id-marker", [""])[0])
                mine = [m for m in mine if m > marker]
            page, more = mine[:self.list_page], len(mine) > self.list_page
            ups = "".join(f"<Upload><Key>{n}</Key><UploadId>{u}</UploadId><StorageClass>STANDARD</StorageClass>"
                          f"<Initiated>2021-11-10T20:48:33.000Z</Initiated></Upload>" for n, u in page)
            nxt = (f"<NextKeyMarker>{page[-1][0]}</NextKeyMarker><NextUploadIdMarker>{page[-1][1]}"
                   "</NextUploadIdMarker>") if more else ""
            return 200, {"Content-Type": "application/xml"}, (
                f'<ListMultipartUploadsResult xmlns="{NS}"><Bucket>{BUCKET}</Bucket><KeyMarker></KeyMarker>'
                f"<UploadIdMarker></UploadIdMarker>{nxt}<MaxUploads>{self.list_page}</MaxUploads>"
                f"<IsTruncated>{'true' if more else 'false'}</IsTruncated>{ups}</ListMultipartUploadsResult>")
        return _error(400, "InvalidArgument", f"unexpected {request.method} {request.url}")


@pytest.fixture
def gcs(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[GCSStorage, FakeGCS]]:
    monkeypatch.delenv("STORAGE_EMULATOR_HOST", raising=False)
    monkeypatch.delenv("SPOTGUARD_GCS_MULTIPART", raising=False)
    monkeypatch.delenv("SPOTGUARD_PART_SIZE", raising=False)
    with responses.RequestsMock(assert_all_requests_are_fired=False) as rsps:
        fake = FakeGCS(rsps)
        store = GCSStorage(f"gs://{BUCKET}/run", session=requests.Session(), base_url=BASE,
                           part_size=5 * MiB, concurrency=3, backoff=0.01)
        yield store, fake


def _state(seed: int = 0) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    return {"big": torch.randn(3_300_000, generator=g),  # 13.2 MB: three 5 MiB parts
            "small": torch.arange(10.0) + seed, "meta": {"seed": seed}}


def test_default_on_real_gcs_is_xml_multipart_with_its_5_mib_minimum(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("STORAGE_EMULATOR_HOST", raising=False)
    monkeypatch.delenv("SPOTGUARD_GCS_MULTIPART", raising=False)
    s = GCSStorage("gs://b/p", session=requests.Session(), base_url=BASE, part_size=1 * MiB)
    assert s.multipart == "xml" and s.part_size == 5 * MiB
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", "127.0.0.1:9")  # emulators have no XML API
    s = GCSStorage("gs://b/p", session=requests.Session(), part_size=1 * MiB)
    assert s.multipart == "compose" and s.part_size == 1 * MiB
    monkeypatch.setenv("SPOTGUARD_GCS_MULTIPART", "parallel")
    with pytest.raises(StorageError, match="SPOTGUARD_GCS_MULTIPART.*'xml'.*'compose'"):
        GCSStorage("gs://b/p", session=requests.Session())


def test_two_saves_commit_and_load_bitwise_through_xml_multipart(gcs: tuple[GCSStorage, FakeGCS]) -> None:
    store, fake = gcs
    for step, seed in ((1, 1), (2, 2)):
        sd = _state(seed)
        key = prepare_attempt(store, step)
        dcp.save(sd, storage_writer=store.dcp_writer(key), no_dist=True)
        commit(store, step, CommitRecord(step=step))
    best = newest_committed(store)
    assert best is not None and best.step == 2
    out = {"big": torch.zeros(3_300_000), "small": torch.zeros(10), "meta": {"seed": None}}
    dcp.load(out, storage_reader=store.dcp_reader("step-00000002"), no_dist=True)
    want = _state(2)
    assert torch.equal(out["big"], want["big"]) and torch.equal(out["small"], want["small"])
    assert out["meta"] == {"seed": 2}
    # the shard went through the XML API in parts; no temporary objects, nothing left open
    assert "run/step-00000002/__0_0.distcp" in fake.completed
    assert not any(UPLOADS_DIR in n for n in fake.media_puts)
    assert fake.uploads == {} and store.incomplete_uploads() == []
    assert store.zero_copy_bytes >= 2 * want["big"].nbytes


def test_complete_lists_every_part_in_order_with_its_quoted_etag(gcs: tuple[GCSStorage, FakeGCS]) -> None:
    store, fake = gcs
    data = bytes(range(256)) * (17 * MiB // 256) + b"tail"
    with store.open_upload("obj") as up:
        up.write(data)
    assert fake.objects["run/obj"] == data
    body = fake.complete_bodies[-1]
    assert body.startswith(b"<CompleteMultipartUpload><Part>")
    numbers = [int(n) for n in re.findall(rb"<PartNumber>(\d+)</PartNumber>", body)]
    assert numbers == [1, 2, 3, 4]  # 17 MiB + 4 bytes in 5 MiB parts
    assert all(e.startswith(b'"') and e.endswith(b'"') for e in re.findall(rb"<ETag>([^<]*)</ETag>", body))


def test_every_part_and_object_carries_its_crc32c_and_a_damaged_part_is_refused_then_resent(
        gcs: tuple[GCSStorage, FakeGCS]) -> None:
    store, fake = gcs
    fake.corrupt = 1  # the first body the server receives arrives with one byte flipped
    data = bytes(range(256)) * (12 * MiB // 256) + b"tail"
    with store.open_upload("obj") as up:
        up.write(data)
    store.write_bytes("small", b"abc")
    assert fake.corrupted == 1 and store.retries >= 1  # refused with 400 BadDigest, then resent
    assert fake.objects["run/obj"] == data and fake.objects["run/small"] == b"abc"
    assert [api for api, _ in fake.hashes] == ["xml"] * 4 + ["json"]  # 3 parts, one resent; the small object
    assert all(crc for _, crc in fake.hashes)  # every body carried one (checked against its bytes above)


def test_503_and_429_on_parts_are_retried_from_the_first_byte(gcs: tuple[GCSStorage, FakeGCS]) -> None:
    store, fake = gcs
    fake.fail.append({"method": "PUT", "match": r"partNumber=2", "answer": _error(503, "ServiceUnavailable", "x")})
    fake.fail.append({"method": "PUT", "match": r"partNumber=3", "answer": _error(429, "TooManyRequests", "x")})
    fake.fail.append({"method": "POST", "match": r"uploads", "answer": _error(500, "InternalError", "x")})
    data = bytes(range(256)) * (12 * MiB // 256)
    with store.open_upload("obj") as up:
        up.write(data)
    assert fake.objects["run/obj"] == data
    assert store.retries >= 3


def test_a_failed_part_aborts_the_upload_and_leaves_no_object(gcs: tuple[GCSStorage, FakeGCS]) -> None:
    store, fake = gcs
    fake.fail.append({"method": "PUT", "match": r"partNumber=2",
                      "answer": _error(403, "AccessDenied", "Access denied.")})
    up = store.open_upload("obj")
    with pytest.raises(Exception, match="AccessDenied"):
        up.write(b"x" * (12 * MiB))
        up.close()
    up.abort()
    assert len(fake.aborted) == 1 and fake.uploads == {}
    assert "run/obj" not in fake.objects


def test_orphaned_uploads_are_listed_across_pages_and_aborted_by_the_next_attempt(
        gcs: tuple[GCSStorage, FakeGCS]) -> None:
    store, fake = gcs
    fake.list_page = 2  # three orphans: two pages
    for i in range(3):
        uid = f"orphan{i}"
        fake.uploads[uid] = (f"run/step-00000007/__{i}_0.distcp", {1: b"x"})
    fake.uploads["other"] = ("elsewhere/step-00000007/x", {})  # outside this job's root: left alone
    found = store.incomplete_uploads("step-")
    assert sorted(found) == sorted(f"run/step-00000007/__{i}_0.distcp?uploadId=orphan{i}" for i in range(3))
    prepare_attempt(store, 8)
    assert sorted(fake.aborted) == ["orphan0", "orphan1", "orphan2"]
    assert list(fake.uploads) == ["other"] and store.incomplete_uploads("step-") == []


def test_a_retried_complete_whose_first_try_landed_counts_as_done(gcs: tuple[GCSStorage, FakeGCS]) -> None:
    store, fake = gcs

    def lost_answer(request: Any) -> Any:  # the complete happens, its answer is lost
        fake.fail.clear()
        fake._xml(request)
        return _error(503, "ServiceUnavailable", "Backend Error")

    fake.fail.append({"method": "POST", "match": r"uploadId=", "answer": lost_answer})
    data = b"y" * (11 * MiB)
    with store.open_upload("obj") as up:
        up.write(data)
    assert fake.objects["run/obj"] == data and fake.uploads == {}


def test_complete_that_answers_200_with_an_error_body_fails(gcs: tuple[GCSStorage, FakeGCS]) -> None:
    store, fake = gcs
    fake.fail.append({"method": "POST", "match": r"uploadId=", "count": 20,
                      "answer": (200, {}, "<Error><Code>InternalError</Code><Message>x</Message></Error>")})
    up = store.open_upload("obj")
    up.write(b"z" * (11 * MiB))
    with pytest.raises(Exception, match="InternalError"):
        up.close()
    up.abort()
    assert "run/obj" not in fake.objects and fake.uploads == {}


class _Creds:
    """google-auth style credentials: ``token``, ``refresh(request)``, ``apply``/``before_request``."""

    def __init__(self, fail_refresh: bool = False) -> None:
        from google.auth import credentials

        class C(credentials.Credentials):  # type: ignore[misc]
            def refresh(inner, request: Any) -> None:  # noqa: N805
                if fail_refresh:
                    from google.auth.exceptions import RefreshError

                    raise RefreshError("metadata server said no")
                inner.refreshes += 1
                inner.token = f"t{inner.refreshes + 1}"

        self.c = C()
        self.c.token = "t1"
        self.c.refreshes = 0
        self.c.expiry = None


def _rejects_token(fake: FakeGCS, bad: str) -> Any:
    def answer(request: Any) -> Any:
        if request.headers.get("Authorization") == f"Bearer {bad}":
            return 401, {"Content-Type": "application/xml"}, "<Error><Code>AuthenticationRequired</Code></Error>"
        return fake._xml(request)
    return answer


def test_a_rejected_token_is_refreshed_once_and_the_part_resent_whole(monkeypatch: pytest.MonkeyPatch) -> None:
    """A 401 mid-save (token expired or revoked): refresh, then resend the part from its first byte.

    google-auth's own 401 handling resends the request object as it is — a zero-copy body already
    read to its end — so the backend turns it off and retries through its own loop instead.
    """
    pytest.importorskip("google.auth")
    monkeypatch.delenv("STORAGE_EMULATOR_HOST", raising=False)
    creds = _Creds().c
    with responses.RequestsMock(assert_all_requests_are_fired=False) as rsps:
        fake = FakeGCS(rsps)
        store = GCSStorage(f"gs://{BUCKET}/run", credentials=creds, base_url=BASE, part_size=5 * MiB,
                           concurrency=3, backoff=0.01)
        fake.fail.append({"method": "PUT", "match": r"partNumber=", "count": 3, "answer": _rejects_token(fake, "t1")})
        data = bytes(range(256)) * (12 * MiB // 256)
        with store.open_upload("obj") as up:
            up.write(data)
    assert fake.objects["run/obj"] == data
    assert creds.refreshes == 1 and creds.token == "t2"


def test_a_token_that_cannot_be_refreshed_fails_with_the_fix_named(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("google.auth")
    monkeypatch.delenv("STORAGE_EMULATOR_HOST", raising=False)
    creds = _Creds(fail_refresh=True).c
    with responses.RequestsMock(assert_all_requests_are_fired=False) as rsps:
        fake = FakeGCS(rsps)
        store = GCSStorage(f"gs://{BUCKET}/run", credentials=creds, base_url=BASE, part_size=5 * MiB,
                           backoff=0.01)
        fake.fail.append({"method": "PUT", "match": r"partNumber=", "count": 50, "answer": _rejects_token(fake, "t1")})
        up = store.open_upload("obj")
        with pytest.raises(Exception, match="refreshing it failed.*Application Default Credentials"):
            up.write(b"q" * (12 * MiB))
            up.close()
        up.abort()
    assert "run/obj" not in fake.objects and fake.uploads == {}


def test_an_answer_that_is_not_xml_is_retried_then_named(gcs: tuple[GCSStorage, FakeGCS]) -> None:
    store, fake = gcs
    html = (200, {"Content-Type": "text/html"}, "<html><body>proxy says hi</body>")
    fake.fail.append({"method": "POST", "match": r"\?uploads$", "answer": html})  # once: retried
    data = b"w" * (6 * MiB)
    with store.open_upload("obj") as up:
        up.write(data)
    assert fake.objects["run/obj"] == data and store.retries >= 1
    fake.fail.append({"method": "POST", "match": r"\?uploads$", "answer": html, "count": 50})
    up = store.open_upload("obj2")
    with pytest.raises(Exception, match="answer is not XML"):
        up.write(data)
        up.close()
    up.abort()
