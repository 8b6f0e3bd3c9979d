"""A checkpoint is data, never code: the only unpicklers spotguard runs on bytes from storage.

Why: DCP's ``.metadata`` is a pickle, DCP's stock planner loads non-tensor
items with ``torch.load(weights_only=False)``, and a pickle can call any
importable function. Whoever can write the checkpoint prefix could run code
on every training node. So:

- ``.metadata`` goes through ``load_dcp_metadata``: an unpickler that admits
  only DCP's own metadata classes and the few torch/stdlib types they hold
  (``torch.Size``, dtypes, the layout lookup, ``PosixPath``);
- everything else goes through ``torch.load(weights_only=True)`` with an
  explicit allowlist (``SAFE_GLOBALS``: numpy arrays and dtypes, for numpy's RNG
  state and loader states), via ``safe_torch_load`` and ``SafeLoadPlanner``.

A forbidden global is reported as a ``DamagedCheckpoint`` (the checkpoint is
skipped like any other damaged one); nothing it names is imported or called.
"""

from __future__ import annotations

import io
import pickle
from typing import Any

import torch
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import ReadItem

from .integrity import DamagedCheckpoint

__all__ = ["load_dcp_metadata", "safe_torch_load", "SafeLoadPlanner", "SAFE_GLOBALS"]

_METADATA_NAMES = ("Metadata", "MetadataIndex", "StorageMeta", "TensorProperties", "TensorStorageMetadata",
                   "BytesStorageMetadata", "ChunkStorageMetadata", "_MEM_FORMAT_ENCODING")
_ALLOWED: frozenset[tuple[str, str]] = frozenset(
    {("torch.distributed.checkpoint.metadata", n) for n in _METADATA_NAMES}
    | {
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
        ("torch", "Size"),
        ("torch.serialization", "_get_layout"),  # looks a layout up by name, nothing else
        ("pathlib", "PosixPath"),  # StorageMeta.checkpoint_id of a FileSystemWriter save
        ("pathlib", "PurePosixPath"),
        ("collections", "OrderedDict"),
    }
)


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _ALLOWED:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"forbidden global {module}.{name}")

    def persistent_load(self, pid: Any) -> Any:
        raise pickle.UnpicklingError("persistent ids are not allowed in DCP metadata")


def load_dcp_metadata(raw: bytes, where: str) -> Metadata:
    """DCP's ``.metadata`` pickle, unpickled with only DCP's metadata classes admitted."""
    try:
        md = _MetadataUnpickler(io.BytesIO(raw)).load()
    except Exception as exc:  # noqa: BLE001 - any failure: the file is not DCP metadata we accept
        raise DamagedCheckpoint(where, f"refused to unpickle: {type(exc).__name__}: {exc}") from None
    if not isinstance(md, Metadata):
        raise DamagedCheckpoint(where, f"holds a {type(md).__name__}, not DCP Metadata")
    return md


def _numpy_globals() -> list[Any]:
    try:
        import numpy as np
    except ImportError:
        return []
    out: list[Any] = [np.ndarray, np.dtype]
    for mod in ("numpy._core.multiarray", "numpy.core.multiarray"):
        try:
            m = __import__(mod, fromlist=["_reconstruct", "scalar"])
            out += [m._reconstruct, m.scalar]
            break
        except (ImportError, AttributeError):
            continue
    dtypes = getattr(np, "dtypes", None)
    if dtypes is not None:
        out += [getattr(dtypes, n) for n in dir(dtypes) if n.endswith("DType") and isinstance(getattr(dtypes, n), type)]
    return out


#: what per-rank state may hold beyond tensors and plain containers: numpy arrays, dtypes and scalars
SAFE_GLOBALS: list[Any] = _numpy_globals()


def safe_torch_load(data: bytes | io.BytesIO, where: str) -> Any:
    """``torch.load(weights_only=True)`` plus ``SAFE_GLOBALS``; a refusal is a ``DamagedCheckpoint``."""
    f = data if isinstance(data, io.BytesIO) else io.BytesIO(data)
    try:
        with torch.serialization.safe_globals(SAFE_GLOBALS):
            return torch.load(f, map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - UnpicklingError for a forbidden global, anything for garbage
        msg = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise DamagedCheckpoint(where, f"refused to load: {type(exc).__name__}: {msg}") from None


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, except that non-tensor items load with ``safe_torch_load``."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        obj = safe_torch_load(value, f"item {read_item.dest_index.fqn}")
        if self.flatten_state_dict:
            from torch.distributed.checkpoint._traverse import set_element  # noqa: PLC0415

            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj
