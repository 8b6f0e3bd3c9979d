"""What both verifying DCP readers share: which byte spans to read, and loading items from bytes in hand.

Why: a load must read each byte once and use none before its checksum block
checked out. So a reader (object store: parallel ranged GETs; local/NFS: one
``readinto`` per span) fetches whole checksum blocks, verifies them, and only
then deserialises the items that lie in them — from the same buffer, never by
reading the file again.
"""

from __future__ import annotations

import io
from typing import Any, Callable, Mapping, cast

import torch
from torch.distributed._shard._utils import narrow_tensor_by_index
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem

from .base import StorageError, check_key
from .integrity import BLOCK_SIZE, DamagedCheckpoint, FileDigest, verify_span
from .objmemory import MemReader
from .safeload import load_dcp_metadata

__all__ = ["Group", "METADATA", "parse_metadata", "recorded_digest", "read_groups", "load_items"]

#: DCP's metadata file in a checkpoint folder
METADATA = ".metadata"

#: (file name in the checkpoint folder, start, end, the read items inside [start, end))
Group = tuple[str, int, int, list[ReadItem]]


def parse_metadata(raw: bytes, digests: Mapping[str, FileDigest] | None, where: str, load_id: str) -> Metadata:
    """The folder ``where``'s ``.metadata`` from ``raw`` (read once): checked against the commit record when
    verifying, unpickled with the restricted loader, stamped with this load's id."""
    path = f"{where}/{METADATA}"
    if digests is not None:
        digest = digests.get(METADATA)
        if digest is None:
            raise DamagedCheckpoint(path, "not named in the commit record")
        if len(raw) != digest.size:
            raise DamagedCheckpoint(path, f"{len(raw)} bytes, commit record says {digest.size}")
        verify_span(path, digest, 0, raw)
    md = load_dcp_metadata(raw, path)
    if getattr(md, "storage_meta", None) is None:
        md.storage_meta = StorageMeta()
    md.storage_meta.load_id = load_id
    return md


def recorded_digest(digests: Mapping[str, FileDigest] | None, name: str, where: str) -> FileDigest | None:
    """The commit record's checksum of file ``name`` (None when not verifying). A name the metadata gives
    that is unsafe as a path, or that the record does not list, is damage."""
    try:
        check_key(name)
    except StorageError as exc:
        raise DamagedCheckpoint(where, f"metadata names an unsafe file {name!r}: {exc}") from None
    if digests is None:
        return None
    digest = digests.get(name)
    if digest is None:
        raise DamagedCheckpoint(f"{where}/{name}", "read by the metadata but not named in the commit record")
    return digest


def read_groups(plan: LoadPlan, storage_data: Mapping[Any, Any], digest_for: Callable[[str], FileDigest | None],
                limit: int, where: str) -> list[Group]:
    """The plan's items coalesced into spans of about ``limit`` bytes per file.

    With a digest (``digest_for(name)``), spans are widened to whole checksum
    blocks, so that each can be verified before use, and an item that shares a
    block with the previous group joins it (a block is read once). Items that
    lie past the recorded size are damage.
    """
    per_file: dict[str, list[ReadItem]] = {}
    for req in plan.items:
        info: _StorageInfo = storage_data[req.storage_index]
        if info.transform_descriptors:
            raise ValueError(f"checkpoint uses stream transforms {info.transform_descriptors}, not supported")
        per_file.setdefault(info.relative_path, []).append(req)
    groups: list[Group] = []
    for path, reqs in per_file.items():
        digest = digest_for(path)
        reqs.sort(key=lambda r: storage_data[r.storage_index].offset)
        cur: list[ReadItem] = []
        start = end = 0
        for r in reqs:
            info = storage_data[r.storage_index]
            a, b = info.offset, info.offset + info.length
            if digest is not None:  # whole checksum blocks, so that each can be verified
                if b > digest.size:
                    raise DamagedCheckpoint(f"{where}/{path}", f"item at [{a}, {b}) lies past the end of the "
                                            f"{digest.size}-byte file")
                a = a - a % BLOCK_SIZE
                b = min(digest.size, -(-b // BLOCK_SIZE) * BLOCK_SIZE)
                if cur and a < end:  # shares a block with the group: must stay in it
                    cur.append(r)
                    end = max(end, b)
                    continue
            if cur and (b - start > limit or a > end + 1024 * 1024):
                groups.append((path, start, end, cur))
                cur = []
            if not cur:
                start, end = a, b
            cur.append(r)
            end = max(end, b)
        if cur:
            groups.append((path, start, end, cur))
    return groups


def load_items(planner: LoadPlanner, storage_data: Mapping[Any, Any], view: memoryview, start: int,
               reqs: list[ReadItem], where: str) -> None:
    """Deserialise ``reqs`` from ``view`` (the file's bytes from offset ``start``, already verified) into the
    planner's targets. In the calling thread: the planner is not thread-safe. Tensors load with
    ``weights_only=True``; anything else goes through the planner's ``load_bytes`` (``SafeLoadPlanner``)."""
    for req in reqs:
        info: _StorageInfo = storage_data[req.storage_index]
        raw = view[info.offset - start:info.offset - start + info.length]
        if req.type == LoadItemType.BYTE_IO:
            planner.load_bytes(req, io.BytesIO(raw.tobytes()))
            continue
        try:
            tensor = cast(torch.Tensor, torch.load(MemReader(raw), map_location="cpu", weights_only=True))
        except Exception as exc:  # noqa: BLE001 - a record that is not a plain tensor
            raise DamagedCheckpoint(where, f"refused to load item at {info.offset}: {type(exc).__name__}") from None
        tensor = narrow_tensor_by_index(tensor, req.storage_offsets, req.lengths)
        target = planner.resolve_tensor(req).detach()
        if target.size() != tensor.size():
            raise AssertionError(f"req {req.storage_index} mismatch sizes {target.size()} vs {tensor.size()}")
        target.copy_(tensor)
        planner.commit_tensor(req, target)
