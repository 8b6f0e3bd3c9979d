"""DeepSpeed's checkpoint files in spotguard's storage: the writer and reader DeepSpeed's own save and load go
through, and the checks the engine adapter (``deepspeed.py``, ``deepspeed_anymoment.py``) and Lightning's
``DeepSpeedStrategy`` (``lightning_deepspeed.py``) share.

Why apart from the adapter: this is DeepSpeed's pluggable ``CheckpointEngine`` seam and nothing of the hook —
``SpotguardCheckpointEngine`` streams each file DeepSpeed ``torch.save``s into a spotguard checkpoint folder
(an object store's multipart upload, or the local file) with its checksum taken as it goes, and loads with
``torch.load(weights_only=True)`` and an allowlist of DeepSpeed's few types; ``swapped`` puts it in for one
save or load; ``check_world`` refuses a ZeRO checkpoint of another world size before anything is read.
"""

from __future__ import annotations

import contextlib
import io
import os
from typing import Any, Iterator, Optional

import torch
from deepspeed.runtime.checkpoint_engine.checkpoint_engine import CheckpointEngine

from ...storage import Storage
from ...storage.base import join_key
from ...storage.commit import checkpoint_info
from ...storage.integrity import Checksummer, DamagedCheckpoint
from ...storage.safeload import SAFE_GLOBALS

__all__ = ["DeepSpeedWorldSizeChanged", "SpotguardCheckpointEngine", "check_world", "refuse_other_world", "swapped"]


class DeepSpeedWorldSizeChanged(RuntimeError):
    """A ZeRO checkpoint written by another number of ranks: its partitions do not fit this job."""


def check_world(storage: Storage, dirkey: str, world: int) -> None:
    """``DeepSpeedWorldSizeChanged`` unless the committed ``dirkey`` was written by ``world`` ranks."""
    info = checkpoint_info(storage, dirkey)
    refuse_other_world(f"{storage.uri}/{dirkey}", info.record.world_size if info.record is not None else None,
                       world)


def refuse_other_world(where: str, saved: Optional[int], world: int) -> None:
    """``DeepSpeedWorldSizeChanged`` when the checkpoint at ``where`` was written by ``saved`` ranks (known, not
    0) and this job has another ``world`` (known, not 0)."""
    if saved and world and saved != world:
        raise DeepSpeedWorldSizeChanged(
            f"{where} was written by {saved} ranks, this job has {world}: a DeepSpeed "
            "ZeRO checkpoint's optimizer partitions fit only the world size that wrote them, and spotguard does "
            "not reshape them (DeepSpeed's universal checkpoint conversion, ds_to_universal.py, is offline). "
            f"Resume with {saved} ranks, or convert the checkpoint yourself")


@contextlib.contextmanager
def swapped(engine: Any, ce: "SpotguardCheckpointEngine") -> Iterator[None]:
    """``engine``'s checkpoint writer is ``ce`` only inside (a user's own ``save_checkpoint`` is untouched)."""
    old, engine.checkpoint_engine = engine.checkpoint_engine, ce
    try:
        yield
    finally:
        engine.checkpoint_engine = old


def _ds_safe_globals() -> list[Any]:
    """DeepSpeed types its checkpoint files hold besides tensors and containers (checked on 0.19.8)."""
    out: list[Any] = list(SAFE_GLOBALS)
    for mod, names in (("deepspeed.runtime.zero.config", ("ZeroStageEnum",)),
                       ("deepspeed.utils.tensor_fragment", ("fragment_address",)),
                       ("deepspeed.runtime.fp16.loss_scaler", ("LossScaler", "DynamicLossScaler"))):
        try:
            m = __import__(mod, fromlist=list(names))
        except ImportError:
            continue
        out += [getattr(m, n) for n in names if hasattr(m, n)]
    return out


class _SummingFile(io.RawIOBase):
    """A local file written in order, its spotguard checksum taken from the same bytes."""

    def __init__(self, f: Any) -> None:
        super().__init__()
        self._f = f
        self.summer = Checksummer()
        self._pos = 0

    def writable(self) -> bool:
        return True

    def write(self, b: Any) -> int:
        mv = memoryview(b).cast("B")
        self._f.write(mv)
        self.summer.update(mv)
        self._pos += len(mv)
        return len(mv)

    def tell(self) -> int:
        return self._pos


class SpotguardCheckpointEngine(CheckpointEngine):
    """DeepSpeed's file writer/reader, pointed at one spotguard checkpoint folder.

    ``save(state, path)``: ``path`` lies under ``<save_dir>/<tag>/``; its relative
    name becomes ``<key>/<name>`` in the storage, streamed (object store:
    ``open_upload``; local store: the file itself) and noted in the write log.
    ``load(path)``: ``torch.load(weights_only=True)`` with DeepSpeed's few types
    allowed; anything else is a ``DamagedCheckpoint``.
    """

    def __init__(self, storage: Storage, key: str, root: str) -> None:
        super().__init__(None)
        self.name = "SpotguardCheckpointEngine"
        self._storage = storage
        self._key = key
        self._root = os.path.abspath(root)
        self.written: list[str] = []

    def create(self, info: Any) -> None:
        return None

    def makedirs(self, path: str, exist_ok: bool = False) -> None:
        os.makedirs(path, exist_ok=True)  # the throw-away save_dir only (DeepSpeed copies zero_to_fp32.py there)

    def _rel(self, path: str) -> str:
        rel = os.path.relpath(os.path.abspath(path), self._root)
        if rel.startswith(".."):
            raise ValueError(f"DeepSpeed wrote {path} outside its checkpoint folder {self._root}")
        return rel.replace(os.sep, "/")

    def save(self, state_dict: Any, path: str) -> None:
        key = join_key(self._key, self._rel(path))
        local = self._storage.local_path(key)
        if local is not None:
            local.parent.mkdir(parents=True, exist_ok=True)
            with open(local, "wb") as f:
                out = _SummingFile(f)
                torch.save(state_dict, out)
            self._storage.write_log.note(key, out.summer.digest())
        else:
            stream = self._storage.open_upload(key)  # type: ignore[attr-defined] - every object store has it
            try:
                torch.save(state_dict, stream)
                stream.close()  # the write log notes it
            except BaseException as exc:
                err = getattr(stream, "error", None)
                stream.abort()
                if err is not None and err is not exc:
                    raise err from exc
                raise
        self.written.append(key)

    def load(self, path: str, map_location: Any = None) -> Any:
        try:
            with open(path, "rb") as f, torch.serialization.safe_globals(_ds_safe_globals()):
                return torch.load(f, map_location=map_location, weights_only=True)
        except FileNotFoundError:
            raise
        except Exception as exc:  # noqa: BLE001 - a forbidden global or garbage: never run it, skip the checkpoint
            msg = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            raise DamagedCheckpoint(path, f"refused to load: {type(exc).__name__}: {msg}") from None

    def commit(self, info: Any) -> bool:
        return True  # spotguard's commit record, written by rank 0 after every rank's bytes are durable
