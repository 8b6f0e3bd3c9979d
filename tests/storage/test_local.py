"""Local/NFS backend: atomic durable writes, listing, prefix deletes, key safety, URI handling, DCP."""

from __future__ import annotations

import os
import pathlib
import threading

import pytest

from spotguard.storage import StorageError, open_storage
from spotguard.storage.base import ObjectInfo, check_key, check_prefix, join_key
from spotguard.storage.local import TMP_MARK, LocalStorage


@pytest.fixture
def store(tmp_path: pathlib.Path) -> LocalStorage:
    s = open_storage(str(tmp_path / "ckpt"))
    assert isinstance(s, LocalStorage)
    return s


def test_write_read_roundtrip_creates_folders(store: LocalStorage) -> None:
    store.write_bytes("step-00000001/sub/a.bin", b"hello")
    assert store.read_bytes("step-00000001/sub/a.bin") == b"hello"
    assert store.exists("step-00000001/sub/a.bin")
    assert not store.exists("step-00000001/sub")  # a folder is not an object
    store.write_bytes("step-00000001/sub/a.bin", b"again")  # overwrite replaces atomically
    assert store.read_bytes("step-00000001/sub/a.bin") == b"again"
    leftovers = [p for p in store.root.rglob("*") if p.name.startswith(TMP_MARK)]
    assert leftovers == []


def test_read_missing_raises_file_not_found(store: LocalStorage) -> None:
    with pytest.raises(FileNotFoundError):
        store.read_bytes("nope")
    store.write_bytes("d/x", b"1")
    with pytest.raises(FileNotFoundError):
        store.read_bytes("d")


def test_list_is_recursive_sorted_prefix_filtered_and_hides_temp_files(store: LocalStorage) -> None:
    for key in ("step-00000002/b", "step-00000001/a", "step-00000001/deep/c", "latest", "other/x"):
        store.write_bytes(key, key.encode())
    (store.root / "step-00000001" / f"{TMP_MARK}zz.123").write_bytes(b"partial")
    keys = [o.key for o in store.list()]
    assert keys == sorted(keys)
    assert set(keys) == {"step-00000002/b", "step-00000001/a", "step-00000001/deep/c", "latest", "other/x"}
    assert [o.key for o in store.list("step-00000001/")] == ["step-00000001/a", "step-00000001/deep/c"]
    assert {o.key for o in store.list("step-")} == {"step-00000001/a", "step-00000001/deep/c", "step-00000002/b"}
    info = store.list("latest")[0]
    assert isinstance(info, ObjectInfo) and info.size == len(b"latest") and info.mtime > 0
    assert store.list("missing/") == []


def test_list_of_absent_root_is_empty(tmp_path: pathlib.Path) -> None:
    assert open_storage(str(tmp_path / "never-created")).list() == []


def test_delete_prefix_folder_and_string_prefix(store: LocalStorage) -> None:
    for key in ("step-00000001/a", "step-00000001/d/b", "step-00000010/a", "keep"):
        store.write_bytes(key, b"x")
    store.delete_prefix("step-00000001/")
    assert not (store.root / "step-00000001").exists()
    assert store.exists("step-00000010/a")
    store.delete_prefix("step-")
    assert [o.key for o in store.list()] == ["keep"]
    store.delete_prefix("absent/")  # missing is fine
    with pytest.raises(StorageError):
        store.delete_prefix("")


BAD_KEYS = ["../escape", "a/../../b", "/etc/passwd", "a//b", "./a", "a/./b", "a\\b", "a\x00b", ".."]


@pytest.mark.parametrize("key", BAD_KEYS)
def test_keys_escaping_the_root_are_rejected(store: LocalStorage, key: str) -> None:
    with pytest.raises(StorageError):
        store.write_bytes(key, b"x")
    with pytest.raises(StorageError):
        store.read_bytes(key)
    with pytest.raises(StorageError):
        store.exists(key)
    with pytest.raises(StorageError):
        store.list(key)
    with pytest.raises(StorageError):
        store.delete_prefix(key)
    with pytest.raises(StorageError):
        store.dcp_reader(key)
    assert not (store.root.parent / "escape").exists()


def test_key_helpers() -> None:
    assert check_key("a/b.c") == "a/b.c"
    assert check_prefix("") == "" and check_prefix("a/") == "a/"
    with pytest.raises(StorageError):
        check_key("")
    with pytest.raises(StorageError):
        check_key("a/")
    assert join_key("step-00000001", "COMMIT.json") == "step-00000001/COMMIT.json"
    assert join_key("", "latest") == "latest"


def test_concurrent_reader_never_sees_a_partial_write(store: LocalStorage) -> None:
    payloads = [bytes([i]) * (256 * 1024) for i in range(2)]
    store.write_bytes("obj", payloads[0])
    stop = threading.Event()
    bad: list[int] = []

    def reader() -> None:
        while not stop.is_set():
            data = store.read_bytes("obj")
            if data not in payloads:
                bad.append(len(data))

    t = threading.Thread(target=reader)
    t.start()
    try:
        for i in range(30):
            store.write_bytes("obj", payloads[i % 2])
    finally:
        stop.set()
        t.join()
    assert bad == []


def test_make_durable_and_local_path(store: LocalStorage) -> None:
    store.write_bytes("step-00000003/x", b"1")
    store.make_durable("step-00000003")
    store.make_durable("step-00000003/")
    store.make_durable("step-00000003/x")
    assert store.local_path("step-00000003") == store.root / "step-00000003"
    assert store.local_path("") == store.root
    with pytest.raises(FileNotFoundError):
        store.make_durable("step-00000004")


# --- open_storage ---------------------------------------------------------------


def test_open_storage_resolution(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("SPOTGUARD_STORAGE", raising=False)
    default = open_storage()
    assert isinstance(default, LocalStorage)
    assert default.root == tmp_path / "checkpoints"  # file://./checkpoints, absolute at open time
    monkeypatch.setenv("SPOTGUARD_STORAGE", str(tmp_path / "from-env"))
    assert open_storage(None).root == tmp_path / "from-env"  # type: ignore[attr-defined]
    assert open_storage(f"file://{tmp_path}/abs").root == tmp_path / "abs"  # type: ignore[attr-defined]
    assert open_storage("rel/dir").root == tmp_path / "rel" / "dir"  # type: ignore[attr-defined]
    assert open_storage("file://./r2").root == tmp_path / "r2"  # type: ignore[attr-defined]
    s = open_storage(str(tmp_path / "x"))
    assert s.uri == (tmp_path / "x").as_uri()
    os.chdir("/")  # a later cwd change must not move an opened store
    assert s.local_path("") == tmp_path / "x"


@pytest.mark.parametrize("uri", ["http://example.com/x", "ftp://h/x", "file://otherhost/x"])
def test_unsupported_uris_are_clear_errors(uri: str) -> None:
    with pytest.raises(StorageError):
        open_storage(uri)


def test_root_that_is_a_file_is_an_error(tmp_path: pathlib.Path) -> None:
    f = tmp_path / "file"
    f.write_bytes(b"")
    with pytest.raises(StorageError, match="not a directory"):
        open_storage(str(f))


# --- torch.distributed.checkpoint ------------------------------------------------


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_dcp_writer_and_reader_roundtrip(store: LocalStorage) -> None:
    torch = pytest.importorskip("torch")
    import torch.distributed.checkpoint as dcp

    state = {"w": torch.arange(12, dtype=torch.float32).reshape(3, 4), "n": torch.tensor(7)}
    dcp.save(state, storage_writer=store.dcp_writer("step-00000001", thread_count=2))
    names = {o.key for o in store.list("step-00000001/")}
    assert "step-00000001/.metadata" in names and len(names) >= 2
    target = {"w": torch.zeros(3, 4), "n": torch.tensor(0)}
    dcp.load(target, storage_reader=store.dcp_reader("step-00000001"))
    assert torch.equal(target["w"], state["w"]) and int(target["n"]) == 7
    with pytest.raises(FileNotFoundError):
        store.dcp_reader("step-00000099")


def test_fifo_or_symlink_is_not_an_object(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """A FIFO named like a checkpoint file (a forged QUARANTINE.json) would block a read forever, a symlink
    could point anywhere: neither is listed nor read."""
    import os

    import pytest

    from spotguard.storage.local import LocalStorage

    store = LocalStorage(tmp_path)
    store.write_bytes("step-00000001/COMMIT.json", b"{}")
    os.mkfifo(tmp_path / "step-00000001" / "QUARANTINE.json")
    os.symlink("/etc/hostname", tmp_path / "step-00000001" / "x.distcp")
    assert [o.key for o in store.list("step-00000001/")] == ["step-00000001/COMMIT.json"]
    with pytest.raises(FileNotFoundError):
        store.read_bytes("step-00000001/QUARANTINE.json")
    with pytest.raises(FileNotFoundError):
        store.read_bytes("step-00000001/x.distcp")


def test_list_of_a_prefix_never_walks_folders_that_cannot_match(store: LocalStorage,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """``list("step-")`` (every resume, and retention inside each save) must not read the job's history/
    (thousands of small entries: seconds of READDIR on NFS, on the emergency path)."""
    store.write_bytes("step-00000001/a.bin", b"1")
    store.write_bytes("step-00000001/sub/b.bin", b"2")
    store.write_bytes("history/0000000000000001-aaaaaaaaaaaa-00000-000001.json", b"{}")
    store.write_bytes("stepx/c.bin", b"3")
    walked: list[str] = []
    real = os.scandir

    def scandir(path: str = ".") -> "os._ScandirIterator[str]":  # type: ignore[name-defined]
        walked.append(os.path.relpath(path, store.root))
        return real(path)

    monkeypatch.setattr(os, "scandir", scandir)
    keys = [o.key for o in store.list("step-")]
    assert keys == ["step-00000001/a.bin", "step-00000001/sub/b.bin"]
    assert "history" not in walked and "stepx" not in walked, walked
    assert [o.key for o in store.list("step-00000001/s")] == ["step-00000001/sub/b.bin"]
    assert [o.key for o in store.list("")][0] == "history/0000000000000001-aaaaaaaaaaaa-00000-000001.json"
