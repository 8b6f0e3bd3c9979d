"""Content checksums of checkpoint files: computed while the bytes stream out, verified before use.

Why CRC32C in fixed blocks: CRC32C has a hardware instruction (SSE4.2 /
ARMv8), and the ``crc32c`` package runs it with the GIL released at ~10 GiB/s
on one core over cold memory (close to the 13 GiB/s a core reads at all) and
~20 GiB/s in cache (``docs/performance.md`` has the measurements), so it hides
behind a network upload; it is also the checksum S3 and GCS verify natively. A file's
checksum is the list of the CRC32C of each ``BLOCK_SIZE`` block: a reader that
fetches a ranged part of a file (DCP's ranged loads, a parallel download) can
verify every block it uses as it arrives, without reading the file twice.

Every ``Storage`` keeps a ``WriteLog`` of what this process wrote under each
checkpoint folder (name, size, block checksums); after a save each rank hands
its log to rank 0, which writes exactly that into the commit record.
"""

from __future__ import annotations

import base64
import threading
from dataclasses import dataclass
from typing import Any, Iterable, Mapping

from .errors import StorageError

__all__ = [
    "ALGORITHM",
    "BLOCK_SIZE",
    "DamagedCheckpoint",
    "FileDigest",
    "Checksummer",
    "crc32c",
    "crc32c_b64",
    "digest_of",
    "verify_span",
    "WriteLog",
]

ALGORITHM = "crc32c"
BLOCK_SIZE = 4 * 1024 * 1024  # small enough for sparse ranged reads, ~256 entries per GiB in the record

try:  # the ``crc32c`` package: hardware CRC32C, accepts any buffer, releases the GIL
    import crc32c as _crc32c_mod

    def _crc(data: Any, value: int = 0) -> int:
        return _crc32c_mod.crc32c(data, value)

except ImportError:  # pragma: no cover - google-crc32c (brought by the GCS extra) wants read-only bytes
    import google_crc32c as _g

    def _crc(data: Any, value: int = 0) -> int:
        mv = memoryview(data)
        return _g.extend(value, mv.tobytes() if not mv.readonly else bytes(mv))


def crc32c(data: Any, value: int = 0) -> int:
    """CRC32C of ``data`` (any contiguous buffer), continuing from ``value``."""
    return _crc(data, value)


def crc32c_b64(chunks: Iterable[Any]) -> str:
    """Base64 of the big-endian CRC32C of the concatenated ``chunks``: S3's and GCS's wire form."""
    value = 0
    for c in chunks:
        value = _crc(c, value)
    return base64.b64encode(value.to_bytes(4, "big")).decode("ascii")


_POLY = 0x82F63B78  # CRC32C, reflected


def _times(mat: list[int], vec: int) -> int:
    out, i = 0, 0
    while vec:
        if vec & 1:
            out ^= mat[i]
        vec >>= 1
        i += 1
    return out


def _square(mat: list[int]) -> list[int]:
    return [_times(mat, mat[n]) for n in range(32)]


def _shift_operator(nbytes: int) -> list[int]:
    """The GF(2) matrix that advances a CRC32C over ``nbytes`` zero bytes (zlib's crc32_combine, as a matrix)."""
    odd = [_POLY] + [1 << n for n in range(31)]  # one zero bit
    even = _square(odd)  # two
    odd = _square(even)  # four
    op = [1 << n for n in range(32)]  # identity
    n = nbytes
    while n:
        even = _square(odd)
        if n & 1:
            op = [_times(even, v) for v in op]
        n >>= 1
        if not n:
            break
        odd = _square(even)
        if n & 1:
            op = [_times(odd, v) for v in op]
        n >>= 1
    return op


_BLOCK_OP: list[int] | None = None


def crc32c_combine(crc1: int, crc2: int, len2: int) -> int:
    """CRC32C of A+B from crc(A), crc(B) and len(B): part checksums from block checksums, no second pass."""
    global _BLOCK_OP
    if len2 == BLOCK_SIZE:
        if _BLOCK_OP is None:
            _BLOCK_OP = _shift_operator(BLOCK_SIZE)
        op = _BLOCK_OP
    else:
        op = _shift_operator(len2)
    return _times(op, crc1) ^ crc2


def crc32c_of_blocks(crcs: Iterable[int], size: int) -> int:
    """The CRC32C of ``size`` bytes whose consecutive ``BLOCK_SIZE`` blocks have CRCs ``crcs`` (the last may be short)."""
    out, done = 0, 0
    for c in crcs:
        n = min(BLOCK_SIZE, size - done)
        out = c if done == 0 else crc32c_combine(out, c, n)
        done += n
    return out


class DamagedCheckpoint(StorageError):
    """A committed checkpoint whose bytes do not match its record, or that holds something unsafe."""

    def __init__(self, where: str, what: str) -> None:
        super().__init__(f"{where}: {what}")
        self.where, self.what = where, what

    def __reduce__(self) -> Any:  # DCP gathers every rank's exception with pickle
        return (type(self), (self.where, self.what))


@dataclass(frozen=True)
class FileDigest:
    """One file's size and the CRC32C of each ``BLOCK_SIZE`` block, as 8 hex digits each."""

    size: int
    blocks: str

    @staticmethod
    def block_count(size: int) -> int:
        return max(1, -(-size // BLOCK_SIZE))

    def block(self, i: int) -> int:
        return int(self.blocks[8 * i:8 * i + 8], 16)

    def check(self) -> "FileDigest":
        """Raise ValueError if the block list does not fit the size."""
        if len(self.blocks) != 8 * self.block_count(self.size):
            raise ValueError(f"checksum has {len(self.blocks) // 8} blocks, a {self.size}-byte file has "
                             f"{self.block_count(self.size)}")
        try:
            int(self.blocks, 16)
        except ValueError:
            raise ValueError("checksum is not hexadecimal") from None
        return self


class Checksummer:
    """Feed a file's bytes in order (any chunking); ``digest()`` gives its ``FileDigest``."""

    def __init__(self) -> None:
        self.size = 0
        self._crc = 0
        self._fill = 0
        self._done: list[str] = []

    def update(self, data: Any) -> None:
        mv = memoryview(data).cast("B")
        n, off = len(mv), 0
        while off < n:
            take = min(n - off, BLOCK_SIZE - self._fill)
            self._crc = _crc(mv[off:off + take], self._crc)
            self._fill += take
            off += take
            if self._fill == BLOCK_SIZE:
                self._done.append("%08x" % self._crc)
                self._crc = self._fill = 0
        self.size += n

    def crc_of_span(self, start: int, end: int) -> int | None:
        """CRC32C of bytes [start, end) from the block CRCs, or None if the span is not block-aligned
        or not fed yet (``end`` may be the current size, ending in the partial block)."""
        if start % BLOCK_SIZE or end > self.size or (end % BLOCK_SIZE and end != self.size):
            return None
        first, last = start // BLOCK_SIZE, -(-end // BLOCK_SIZE)
        crcs = [int(b, 16) for b in self._done[first:last]]
        if last > len(self._done):  # ends in the block being filled
            crcs.append(self._crc)
        return crc32c_of_blocks(crcs, end - start)

    def digest(self) -> FileDigest:
        blocks = list(self._done)
        if self._fill or not blocks:
            blocks.append("%08x" % self._crc)
        return FileDigest(self.size, "".join(blocks))


def digest_of(data: Any) -> FileDigest:
    """The ``FileDigest`` of a whole buffer."""
    c = Checksummer()
    c.update(data)
    return c.digest()


def verify_span(where: str, digest: FileDigest, start: int, data: Any) -> None:
    """Check ``data`` = bytes [start, start+len) of a file against ``digest``; raise ``DamagedCheckpoint``.

    ``start`` must be block-aligned and the span must end on a block boundary or at the file's end.
    """
    mv = memoryview(data).cast("B")
    end = start + len(mv)
    if start % BLOCK_SIZE or end > digest.size or (end % BLOCK_SIZE and end != digest.size):
        raise DamagedCheckpoint(where, f"read of bytes [{start}, {end}) does not fit a {digest.size}-byte file")
    for a in range(start, end, BLOCK_SIZE) if end > start else [start]:
        b = min(end, a + BLOCK_SIZE)
        got = _crc(mv[a - start:b - start])
        want = digest.block(a // BLOCK_SIZE)
        if got != want:
            raise DamagedCheckpoint(where, f"{ALGORITHM} mismatch in bytes [{a}, {b}): "
                                           f"commit record says {want:08x}, read {got:08x}")


class WriteLog:
    """What this process wrote, per checkpoint folder: ``{folder: {name in folder: FileDigest}}``."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_folder: dict[str, dict[str, FileDigest]] = {}

    def note(self, key: str, digest: FileDigest) -> None:
        folder, sep, name = key.partition("/")
        if sep and name:
            with self._lock:
                self._by_folder.setdefault(folder, {})[name] = digest

    def discard(self, key: str) -> None:
        """Forget one object (a quarantine mark is no checkpoint file: a later commit must not list it)."""
        folder, _, name = key.partition("/")
        with self._lock:
            self._by_folder.get(folder, {}).pop(name, None)

    def peek(self, folder: str) -> dict[str, FileDigest]:
        """Everything noted under ``folder`` so far (kept)."""
        with self._lock:
            return dict(self._by_folder.get(folder.strip("/"), {}))

    def take(self, folder: str) -> dict[str, FileDigest]:
        """Everything noted under ``folder`` since the last ``take`` (and forget it)."""
        with self._lock:
            return self._by_folder.pop(folder.strip("/"), {})


def merge(reports: Iterable[Mapping[str, FileDigest]]) -> dict[str, FileDigest]:
    """One folder's reports from every rank; two ranks reporting one name differently is an error."""
    out: dict[str, FileDigest] = {}
    for rep in reports:
        for name, d in rep.items():
            if name in out and out[name] != d:
                raise StorageError(f"two ranks report different contents for {name}")
            out[name] = d
    return out


def damage_in(exc: BaseException, rank: int | None = None) -> DamagedCheckpoint | None:
    """The ``DamagedCheckpoint`` behind ``exc``: itself, its cause, or (DCP's ``CheckpointException``)
    the one ``rank`` raised (any rank's when ``rank`` is None); None when the failure is something else."""
    seen: set[int] = set()
    todo: list[BaseException | None] = [exc]
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, DamagedCheckpoint):
            return e
        failures = getattr(e, "failures", None)
        if isinstance(failures, dict):
            for r, f in failures.items():
                if rank is None or r == rank:
                    todo.append(f[0] if isinstance(f, tuple) else f)
        todo += [e.__cause__, e.__context__]
    return None
