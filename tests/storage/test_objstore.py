"""Backend-independent object-store logic: retries bounded by the deadline, part streaming, missing extras."""

from __future__ import annotations

import sys
import threading
import time
from typing import Iterable

import pytest

from spotguard.storage import StorageError, open_storage
from spotguard.storage.objstore import (
    DeadlineExceeded,
    MemReader,
    ObjectStorage,
    ObjectStoreError,
    RawObject,
    Upload,
    env_int,
    split_bucket_uri,
)


class _MemUpload(Upload):
    def __init__(self, store: "MemStore", name: str) -> None:
        self.store, self.name = store, name
        store.open_uploads.add(name)

    def part(self, number: int, data: memoryview, last: bool) -> bytes:
        self.store.maybe_fail()
        return bytes(data)

    def complete(self, tokens: list[bytes], total: int) -> None:
        self.store.objects[self.name] = b"".join(tokens)
        self.store.open_uploads.discard(self.name)

    def abort(self) -> None:
        self.store.open_uploads.discard(self.name)


class MemStore(ObjectStorage):
    """An in-memory backend whose requests fail ``fail`` times with a retryable error."""

    scheme = "mem"
    min_part_size = 16

    def __init__(self, uri: str = "mem://b/root", **kw: object) -> None:
        super().__init__(uri, backoff=0.01, **kw)  # type: ignore[arg-type]
        self.objects: dict[str, bytes] = {}
        self.open_uploads: set[str] = set()
        self.fail = 0
        self.lock = threading.Lock()

    def maybe_fail(self) -> None:
        with self.lock:
            if self.fail:
                self.fail -= 1
                raise ConnectionResetError("injected")

    def _retryable(self, exc: BaseException) -> bool:
        return isinstance(exc, ConnectionError)

    def _put(self, name: str, data: memoryview, crc: str | None = None) -> None:
        self.maybe_fail()
        self.objects[name] = bytes(data)

    def _get(self, name: str, start: int | None = None, end: int | None = None) -> bytes:
        if name not in self.objects:
            raise FileNotFoundError(name)
        return self.objects[name][start:end]

    def _head(self, name: str) -> int | None:
        return len(self.objects[name]) if name in self.objects else None

    def _list(self, prefix: str) -> Iterable[RawObject]:
        return [RawObject(k, len(v), 0.0) for k, v in self.objects.items() if k.startswith(prefix)]

    def _delete(self, names: list[str]) -> None:
        for n in names:
            self.objects.pop(n, None)

    def _start_upload(self, name: str) -> Upload:
        return _MemUpload(self, name)

    def _abort_uploads(self, prefix: str) -> int:
        doomed = [n for n in self.open_uploads if n.startswith(prefix)]
        self.open_uploads.difference_update(doomed)
        return len(doomed)


def test_retryable_errors_are_retried() -> None:
    s = MemStore()
    s.fail = 3
    s.write_bytes("a", b"x")
    assert s.read_bytes("a") == b"x" and s.retries == 3


def test_non_retryable_error_is_an_object_store_error_and_an_oserror() -> None:
    s = MemStore()
    with pytest.raises(ObjectStoreError) as ei:
        s.call("boom", lambda: (_ for _ in ()).throw(ValueError("bad")))
    assert isinstance(ei.value, OSError) and isinstance(ei.value, StorageError)


@pytest.mark.serial
def test_retries_stop_at_the_deadline_not_after() -> None:
    s = MemStore(max_attempts=1000)
    s.backoff, s.backoff_cap = 0.05, 0.05
    s.fail = 10**6
    t0 = time.monotonic()
    with s.deadline_at(t0 + 0.3):
        with pytest.raises(DeadlineExceeded):
            s.write_bytes("a", b"x")
    assert time.monotonic() - t0 < 0.4
    assert s.deadline is None  # the context restored it


def test_streamed_upload_parts_and_small_put() -> None:
    s = MemStore(part_size=16, concurrency=3)
    data = bytes(range(256)) * 3
    st = s.open_upload("big")
    for i in range(0, len(data), 7):
        st.write(data[i:i + 7])
    assert st.tell() == len(data)
    st.close()
    assert s.read_bytes("big") == data
    st = s.open_upload("small")
    st.write(b"abc")
    st.close()
    assert s.read_bytes("small") == b"abc" and not s.open_uploads
    assert s.pool().allocated_bytes <= s.pool().count * 16


def test_failed_part_fails_the_stream_and_abort_discards() -> None:
    s = MemStore(part_size=16, concurrency=2, max_attempts=2)
    st = s.open_upload("x")
    s.fail = 10**6
    with pytest.raises(ObjectStoreError):
        for _ in range(50):
            st.write(b"y" * 16)
            time.sleep(0.005)
        st.close()
    st.abort()
    assert not s.open_uploads and "root/x" not in s.objects


def test_uri_parsing_and_env_sizes(monkeypatch: pytest.MonkeyPatch) -> None:
    assert split_bucket_uri("s3://b/a/b/", "s3") == ("b", "a/b/")
    assert split_bucket_uri("s3://b", "s3") == ("b", "")
    with pytest.raises(StorageError):
        split_bucket_uri("s3://b/../x", "s3")
    monkeypatch.setenv("X_SIZE", "8MiB")
    assert env_int("X_SIZE", 1) == 8 * 1024 * 1024
    assert MemReader(memoryview(b"hello")).read(3) == b"hel"


@pytest.mark.parametrize("uri, module, extra", [
    ("s3://bucket/run", "boto3", "s3"),
    ("gs://bucket/run", "requests", "gcs"),
    ("az://container/run", "azure.storage.blob", "azure"),
])
def test_missing_extra_names_the_pip_install(monkeypatch: pytest.MonkeyPatch, uri: str, module: str,
                                             extra: str) -> None:
    monkeypatch.setitem(sys.modules, module, None)  # import fails as if not installed
    with pytest.raises(StorageError, match=rf"pip install 'spotguard\[{extra}\]'"):
        open_storage(uri)
