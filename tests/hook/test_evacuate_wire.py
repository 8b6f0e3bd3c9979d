"""The evacuation wire (``spotguard/hook/evacuate.py``) in one process: three gloo ranks on threads (a real
``ProcessGroupGloo`` each over one ``HashStore``), two doomed ranks evacuating to the one survivor — the case of
more doomed ranks than survivors. Why in-process: the torchrun jobs in ``test_doomed.py`` cover one doomed rank;
this covers the survivor's ordering (every sender acknowledged before any upload) at no torchrun cost."""

from __future__ import annotations

import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Any, Optional

import pytest
import torch
import torch.distributed as dist

from spotguard.hook.evacuate import Evacuation
from spotguard.storage.integrity import digest_of
from spotguard.storage.local import LocalStorage

WORLD = 3
DOOMED = frozenset({1, 2})
TIMEOUT = 8.0  # the group's bound on every send/recv (the save sets it from the deadline)


class _Log:
    def __init__(self) -> None:
        self.lines: list[tuple[str, dict[str, Any]]] = []

    def info(self, event: str, **fields: Any) -> None:
        self.lines.append((event, fields))


class _Wire(Evacuation):
    """``Evacuation`` over a bare ``ProcessGroupGloo`` (not registered with ``torch.distributed``'s world)."""

    pg: Any

    def _send(self, t: torch.Tensor) -> None:
        self.pg.send([t], self.to, 0x5E7A).wait()

    def _recv(self, t: torch.Tensor, src: int) -> None:
        self.pg.recv([t], src, 0x5E7A).wait()

    def _post_recv(self, t: torch.Tensor, src: int) -> Any:
        return self.pg.recv([t], src, 0x5E7A)

    def _send_ack(self, total: int, src: int) -> None:
        self.pg.send([torch.tensor([total], dtype=torch.int64)], src, 0x5E7A).wait()


class _SlowStore(LocalStorage):
    """A store whose uploads take until ``release`` is set (or fail after ``TIMEOUT``): an upload slower than
    the doomed ranks' deadlines."""

    def __init__(self, root: Path, release: threading.Event) -> None:
        super().__init__(root)
        self.release = release

    def write_bytes(self, key: str, data: bytes) -> None:
        if not self.release.wait(TIMEOUT / 2):
            raise TimeoutError("upload waited for a doomed rank that was never acknowledged")
        super().write_bytes(key, data)


def _groups() -> list[Any]:
    store = dist.HashStore()
    pgs: list[Optional[Any]] = [None] * WORLD

    def make(r: int) -> None:
        pgs[r] = dist.ProcessGroupGloo(dist.PrefixStore("evac", store), r, WORLD, timedelta(seconds=TIMEOUT))

    threads = [threading.Thread(target=make, args=(r,)) for r in range(WORLD)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return pgs


def _run(store: LocalStorage, release: Optional[threading.Event],
         files: dict[int, dict[str, bytes]]) -> tuple[dict[int, _Wire], list[BaseException]]:
    """Ranks 1 and 2 evacuate ``files`` to rank 0 (``pair_ranks``); returns the roles and what was raised
    (``release`` is set once both senders were acknowledged)."""
    pgs = _groups()
    acked = {r: threading.Event() for r in DOOMED}
    roles: dict[int, _Wire] = {}
    for r in range(WORLD):
        roles[r] = _Wire(None, r, WORLD, DOOMED, store, "step-5", time.monotonic() + 30, None, _Log(), {})
        roles[r].pg = pgs[r]
    assert roles[1].to == roles[2].to == 0 and roles[0].sources == [1, 2]
    errors: list[BaseException] = []

    def sender(r: int) -> None:
        try:
            roles[r]._hand_over({n: memoryview(bytearray(b)) for n, b in files[r].items()})
            acked[r].set()
            if release is not None and all(e.is_set() for e in acked.values()):
                release.set()
        except BaseException as exc:  # noqa: BLE001 - asserted by the caller
            errors.append(exc)

    def survivor() -> None:
        try:
            roles[0].receive_all()
        except BaseException as exc:  # noqa: BLE001 - asserted by the caller
            errors.append(exc)

    threads = [threading.Thread(target=sender, args=(r,)) for r in sorted(DOOMED)] + [threading.Thread(target=survivor)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(3 * TIMEOUT)
    assert not any(t.is_alive() for t in threads), "a rank hung past the group's timeout"
    return roles, errors


def _files() -> dict[int, dict[str, bytes]]:
    return {r: {f"__{r}_0.distcp": bytes((r * 7 + i) % 251 for i in range(200_000 + r))} for r in DOOMED}


def test_two_doomed_ranks_to_one_survivor_both_safe_before_its_slow_upload(tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """Ranks 1 and 2 are doomed, rank 0 receives both (``pair_ranks``). Each is *safe* at the survivor's
    acknowledgement — rank 2 must not wait for the upload of rank 1's file (storage is the slow path the
    evacuation avoids; its deadline would pass). Then both files land under their names with their checksums
    in the survivor's write log."""
    monkeypatch.setenv("SPOTGUARD_EVACUATE_CHUNK_MB", "0.0625")  # several chunks per file
    release = threading.Event()
    store = _SlowStore(tmp_path / "store", release)
    files = _files()
    roles, errors = _run(store, release, files)
    assert not errors, errors
    assert roles[0].received == {1: 200_001, 2: 200_002}
    assert (roles[1].sent, roles[2].sent) == (200_001, 200_002)
    logged = store.write_log.peek("step-5")
    for r in DOOMED:
        [(name, data)] = files[r].items()
        assert (tmp_path / "store" / "step-5" / name).read_bytes() == data
        assert logged[name] == digest_of(data)
    assert roles[1].info() == {"evacuated_to": 0, "evacuated_bytes": 200_001}
    assert roles[0].info() == {"received": {"1": 200_001, "2": 200_002}}


class _FailingStore(LocalStorage):
    def write_bytes(self, key: str, data: bytes) -> None:
        raise OSError(f"store down: {key}")


def test_store_failing_for_the_survivor_fails_its_write_after_the_senders_were_safe(tmp_path: Path) -> None:
    """The survivor's store fails while it uploads an evacuated file: its ``write_data`` raises (the save's
    durable barrier then fails on every rank: nothing is committed), nothing is noted in its write log, and
    no rank hangs — the doomed ranks were already acknowledged."""
    store = _FailingStore(tmp_path / "store")
    roles, errors = _run(store, None, _files())
    assert len(errors) == 1 and isinstance(errors[0], OSError), errors
    assert (roles[1].sent, roles[2].sent) == (200_001, 200_002)
    assert roles[0].received == {} and store.write_log.peek("step-5") == {}


def test_survivor_grants_only_what_fits_its_memory_budget(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The survivor holds evacuated files whole in host memory until uploaded: it grants a doomed rank's request
    only within its budget (``SPOTGUARD_EVACUATE_MAX_MB``; default half of MemAvailable), else that rank uploads
    its already serialised file itself — same name, same bytes, its own write log — rather than the survivor
    being killed for memory with everyone's bytes."""
    monkeypatch.setenv("SPOTGUARD_EVACUATE_MAX_MB", str(300_000 / 2**20))  # room for one of the two files
    store = LocalStorage(tmp_path / "store")
    files = _files()
    roles, errors = _run(store, None, files)
    assert not errors, errors
    assert roles[0].received == {1: 200_001} and (roles[1].sent, roles[2].sent) == (200_001, 0)
    assert roles[2].decision == "direct" and "memory" in roles[2].why, roles[2].why
    logged = store.write_log.peek("step-5")
    for r in DOOMED:
        [(name, data)] = files[r].items()
        assert (tmp_path / "store" / "step-5" / name).read_bytes() == data and logged[name] == digest_of(data)


def test_a_doomed_rank_that_cannot_serialise_writes_itself(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Serialising into host memory fails on the doomed rank (here: a plan without DCP's storage prefix; in
    practice MemoryError for a big shard): it tells its survivor "I write myself" and writes through its storage
    writer, rather than failing the whole save on every rank."""
    from torch.distributed.checkpoint.planner import SavePlan

    monkeypatch.setenv("SPOTGUARD_EVACUATE", "always")
    pgs = _groups()
    store = LocalStorage(tmp_path / "store")
    roles = {r: _Wire(None, r, WORLD, DOOMED, store, "step-5", time.monotonic() + 30, None, _Log(), {})
             for r in range(WORLD)}
    wrote: list[int] = []
    errors: list[BaseException] = []
    for r in range(WORLD):
        roles[r].pg = pgs[r]

    def doomed(r: int) -> None:
        try:
            write = roles[r]._sender(lambda plan, planner: wrote.append(r) or "own write")
            assert write(SavePlan(items=[], storage_data=None), None) == "own write"
        except BaseException as exc:  # noqa: BLE001 - asserted below
            errors.append(exc)

    threads = [threading.Thread(target=doomed, args=(r,)) for r in sorted(DOOMED)]
    for t in threads:
        t.start()
    try:
        roles[0].receive_all()
    finally:
        for t in threads:
            t.join(3 * TIMEOUT)
    assert not errors, errors
    assert sorted(wrote) == [1, 2] and roles[0].received == {}


def test_receiver_posts_every_header_receive_before_the_survivor_writes(tmp_path: Path) -> None:
    """A doomed rank's 8-byte header is a gloo send that blocks until its receive is posted, and the survivor's
    own write starts with a buffer extension holding the GIL (~0.9 s per GiB): a receiver thread that had not
    posted by then made the doomed rank safe ~1 s later in about half the trials. ``_start_receiving`` returns
    only once every source's header receive is posted."""
    pgs = _groups()
    store = LocalStorage(tmp_path)
    roles = {r: _Wire(None, r, WORLD, DOOMED, store, "step-5", time.monotonic() + 30, None, _Log(), {})
             for r in range(WORLD)}
    for r in range(WORLD):
        roles[r].pg = pgs[r]
    posted: list[int] = []
    real = roles[0]._post_recv

    def recording(t: torch.Tensor, src: int) -> Any:
        work = real(t, src)
        posted.append(src)
        return work

    roles[0]._post_recv = recording  # type: ignore[method-assign]
    got: dict[int, int] = {}
    errors: list[BaseException] = []

    def work(heads: dict[int, Any]) -> None:
        for src, (h, w) in heads.items():
            w.wait()
            got[src] = int(h[0])

    t = roles[0]._start_receiving(work, errors)
    assert sorted(posted) == [1, 2]  # before any byte of the survivor's own write
    senders = [threading.Thread(target=roles[r]._send, args=(torch.tensor([0], dtype=torch.int64),)) for r in (1, 2)]
    for s in senders:
        s.start()
    for s in senders:
        s.join(TIMEOUT)
    t.join(TIMEOUT)
    assert not errors and got == {1: 0, 2: 0}
