"""The stores' own integrity checks on upload, against the real local servers (see conftest.py).

GCS (gcp-storage-emulator): whole objects and composite parts go as JSON API
multipart uploads whose metadata carries ``crc32c``; the emulator recomputes it
and answers 400 on a mismatch, as GCS does. Azure (Azurite 3.35): every Put
Block / Put Blob carries ``Content-MD5``, which Azurite recomputes (400 on a
mismatch; it ignores ``x-ms-content-crc64``). The fault proxy flips one byte of
one request body on its way to the server: the server must refuse it, spotguard
resends the part, and the object ends up byte-identical. Without the checksum
the damaged body would be stored and the final comparison fails.
(S3: ``test_s3.py``; the GCS XML API, which no emulator has: ``test_gcs_xml.py``.)
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import re
from typing import Any

import pytest

from spotguard.storage.integrity import crc32c

from .conftest import Store

MiB = 1024 * 1024


def _crc_b64(data: bytes) -> str:
    return base64.b64encode(crc32c(data).to_bytes(4, "big")).decode()


def _header(headers: dict[str, str], name: str) -> str | None:
    return next((v for k, v in headers.items() if k.lower() == name.lower()), None)


def _gcs_multipart(body: bytes, content_type: str) -> tuple[dict[str, object], bytes]:
    """(metadata, media) of a multipart/related upload body, split on its boundary (never the email parser:
    the media is binary)."""
    boundary = re.search(r"boundary=([^;\s]+)", content_type).group(1).encode()  # type: ignore[union-attr]
    parts = body.split(b"--" + boundary)
    assert parts[0] == b"" and parts[-1] == b"--\r\n", "body must be exactly two parts and the closing boundary"
    meta_part, media_part = parts[1], parts[2]
    meta = json.loads(meta_part.split(b"\r\n\r\n", 1)[1].rstrip(b"\r\n"))
    media = media_part.split(b"\r\n\r\n", 1)[1]
    assert media.endswith(b"\r\n")
    return meta, media[:-2]


SMALL = b"abc" * 1000


def _upload_with_one_body_damaged(store: Store, record: str, method: str, damage: str) -> tuple[Any, list[Any]]:
    """A 4-part object and a small one, uploaded while the proxy flips a byte of the first request matching
    ``method`` + ``damage``; both must read back intact. Returns (storage, the recorded requests with a body)."""
    storage = store.open()
    store.proxy.record = record
    rule = store.proxy.add(method=method, path_re=damage, corrupt=True, count=1)
    data = os.urandom(3 * storage.part_size + 1234)
    with storage.open_upload("step-00000001/big") as up:
        up.write(data)
    storage.write_bytes("step-00000001/small", SMALL)
    assert rule.hits == 1
    assert storage.read_bytes("step-00000001/big") == data  # the damaged body was refused and resent
    assert storage.read_bytes("step-00000001/small") == SMALL
    sent = [r for r in store.proxy.recorded if r.body]
    assert len(sent) == 4 + 1 + 1, [r.path for r in sent]  # 4 parts, one of them resent, the small object
    damaged = [r for r in sent if r.corrupted]
    assert len(damaged) == 1 and damaged[0].status == 400, damaged  # refused by the store itself
    return storage, sent


class TestGCSChecksums:
    kind = "gs"

    def test_every_body_carries_its_crc32c_and_a_damaged_one_is_refused_then_resent(self, store: Store) -> None:
        storage, sent = _upload_with_one_body_damaged(store, r"^POST /upload/storage/v1/b/[^/]+/o\?", "POST",
                                                      r"uploadType=multipart")
        assert storage.multipart == "compose"  # the emulators have no XML API: parts are temporary objects
        for r in sent:
            meta, media = _gcs_multipart(r.body, _header(r.headers, "Content-Type") or "")
            assert meta["crc32c"] == _crc_b64(media), r.path  # the right checksum of exactly those bytes
            assert int(_header(r.headers, "Content-Length") or -1) == len(r.body)
        assert b"CRC32C" in next(r for r in sent if r.corrupted).answer  # refused for its checksum


class TestAzureChecksums:
    kind = "az"

    def test_every_block_carries_its_md5_and_a_damaged_one_is_refused_then_resent(self, store: Store) -> None:
        _storage, sent = _upload_with_one_body_damaged(store, r"^PUT /(?!.*comp=blocklist)", "PUT",
                                                       r"comp=block(&|$)")
        for r in sent:  # Put Block x 4 (one resent), Put Blob
            want = base64.b64encode(hashlib.md5(r.body).digest()).decode()
            assert _header(r.headers, "Content-MD5") == want, r.path
        assert b"MD5" in next(r for r in sent if r.corrupted).answer.upper()

    def test_content_md5_can_be_switched_off(self, store: Store, monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.setenv("SPOTGUARD_AZURE_CONTENT_MD5", "0")
        storage = store.open()
        store.proxy.record = r"^PUT /"
        storage.write_bytes("step-00000001/small", b"abc")
        assert store.proxy.recorded and all(_header(r.headers, "Content-MD5") is None for r in store.proxy.recorded)
