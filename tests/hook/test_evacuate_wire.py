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


def test_two_doomed_ranks_to_one_survivor_both_safe_before_its_slow_upload(tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """Ranks 1 and 2 are doomed, rank 0 receives both (``pair_ranks``). Each is *safe* at the survivor's
    acknowledgement — rank 2 must not wait for the upload of rank 1's file (storage is the slow path the
    evacuation avoids; its deadline would pass). Then both files land under their names with their checksums
    in the survivor's write log."""
    monkeypatch.setenv("SPOTGUARD_EVACUATE_CHUNK_MB", "0.0625")  # several chunks per file
    pgs = _groups()
    acked = {1: threading.Event(), 2: threading.Event()}
    release = threading.Event()
    store = _SlowStore(tmp_path / "store", release)
    files = {r: {f"__{r}_0.distcp": bytes((r * 7 + i) % 251 for i in range(200_000 + r))} for r in DOOMED}
    log = _Log()
    roles: dict[int, _Wire] = {}
    for r in range(WORLD):
        roles[r] = _Wire(None, r, WORLD, DOOMED, store, "step-5", time.monotonic() + 30, None, log, {})
        roles[r].pg = pgs[r]
    assert roles[1].to == roles[2].to == 0 and roles[0].sources == [1, 2]
    errors: list[BaseException] = []

    def sender(r: int) -> None:
        try:
            roles[r]._evacuate({n: memoryview(bytearray(b)) for n, b in files[r].items()})
            acked[r].set()
            if all(e.is_set() for e in acked.values()):
                release.set()
        except BaseException as exc:  # noqa: BLE001 - asserted below
            errors.append(exc)

    def survivor() -> None:
        try:
            roles[0].receive_all()
        except BaseException as exc:  # noqa: BLE001 - asserted below
            errors.append(exc)

    threads = [threading.Thread(target=sender, args=(r,)) for r in sorted(DOOMED)] + [threading.Thread(target=survivor)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(3 * TIMEOUT)
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
