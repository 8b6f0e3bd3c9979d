"""Evacuation of a doomed rank's unique shards to a survivor's host memory (issue 26, part 2).

Why: with FSDP a doomed node's shards exist nowhere else, and its path to
object storage may be too slow to upload them before its deadline, while its
link to a peer is fast and the survivors have no deadline of their own. So the
doomed rank's DCP storage writer, instead of uploading its data file, serialises
it into host memory (the same bytes, item by item, under the same file name
DCP's plan gave it) and streams the file in bounded chunks over the save's gloo
group to one surviving rank. The survivor acknowledges receipt (the doomed rank
is *safe* then), then uploads the file under the same object name beside its
own, through its storage's ordinary write path: the checksum lands in the
survivor's write log exactly as the doomed rank's would have, and DCP's
metadata (built from the doomed rank's own write results) is unchanged. The
commit is written only once every byte is in storage, as always: a survivor
lost before it fails the save's collectives (bounded by the deadline), so
nothing partial is committed.

Decided on the doomed rank (``SPOTGUARD_EVACUATE``: ``auto`` — the default —
evacuates when its unique bytes at the measured write rate would take more than
half of the time left; ``always``; ``never``) and told to its survivor in the
first message, so both always agree. With no rank or every rank doomed nothing
here runs (today's path).

Wire (point to point on the save's group, tag ``TAG``): doomed -> survivor an
int64 header (0: writes itself — also when it could not serialise —, n: n bytes of JSON follow), the
JSON ``{"files": [[name, size], ...]}``; survivor -> doomed an int64 grant (1:
send, 0: no room in my memory budget — the doomed rank then uploads its
serialised file itself); if granted each file in chunks of at most
``chunk_bytes()``, and survivor -> doomed an int64 ack (bytes received).

Memory: the survivor holds every granted file whole in host memory until it is
uploaded; it grants only within ``memory_budget()`` (``SPOTGUARD_EVACUATE_MAX_MB``,
default half of MemAvailable when the save starts), so evacuation never gets the
survivor — holding everyone's bytes — killed for memory.
"""

from __future__ import annotations

import io
import json
import os
import threading
import time
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.filesystem import SerializationFormat, _StorageWriterTransforms, _write_item
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItemType
from torch.futures import Future

from ..storage.base import join_key
from ..storage.dcp_object import _no_crc32
from ..storage.staging import minimal_storage
from . import events as ev

__all__ = ["Evacuation", "evacuate_mode", "pair_ranks", "unique_bytes", "upload"]

TAG = 0x5E7A  # P2P tag of every evacuation message (never matches another sender's)
POST_WAIT = 1.0  # s: the save goes on after this even if the receiver thread has not posted its receives
SUFFIX = ".distcp"
DEFAULT_RATE = 100 * 2**20  # bytes/s assumed for a rank that has not measured its own write yet
ITEM_SLACK = 64 << 10  # torch.save's framing per item (zip headers, pickle), generously
SHARE = 0.5  # ``auto`` evacuates when the direct write is predicted to need more than this share of the time left


def evacuate_mode() -> str:
    """``$SPOTGUARD_EVACUATE``: auto (default), always or never (anything else: auto)."""
    mode = os.environ.get("SPOTGUARD_EVACUATE", "auto").strip().lower()
    return mode if mode in ("auto", "always", "never") else "auto"


def chunk_bytes() -> int:
    """Bytes per message on the wire (``$SPOTGUARD_EVACUATE_CHUNK_MB``, default 16): bounded, never a whole
    shard at once."""
    try:
        return max(1 << 16, int(float(os.environ.get("SPOTGUARD_EVACUATE_CHUNK_MB", "16")) * 2**20))
    except ValueError:
        return 16 * 2**20


def memory_budget() -> Optional[int]:
    """Bytes a survivor may hold for doomed ranks: ``$SPOTGUARD_EVACUATE_MAX_MB``, else half of MemAvailable
    (Linux), else None (no limit known)."""
    raw = os.environ.get("SPOTGUARD_EVACUATE_MAX_MB", "").strip()
    if raw:
        try:
            return max(0, int(float(raw) * 2**20))
        except ValueError:
            pass
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024 // 2
    except (OSError, ValueError, IndexError):
        pass
    return None


def pair_ranks(world: int, doomed: "frozenset[int]") -> dict[int, int]:
    """doomed rank -> the surviving rank that receives its files: spread evenly over the survivors in rank
    order (a doomed node's 8 ranks go to survivors far apart in rank order — mostly different nodes when ranks
    are numbered node by node — rather than to the first 8 survivors, one node), wrapping round when there are
    more doomed ranks than survivors. Rank order only: no node identity is known (see the issue's note)."""
    survivors = [r for r in range(world) if r not in doomed]
    if not survivors:
        return {}
    d = sorted(doomed)
    if len(d) <= len(survivors):
        return {r: survivors[(i * len(survivors)) // len(d)] for i, r in enumerate(d)}
    return {r: survivors[i % len(survivors)] for i, r in enumerate(d)}


def unique_bytes(plan: SavePlan) -> int:
    """The tensor bytes this rank's (final) DCP plan gives it to write: after the survivors plan, what exists
    nowhere else."""
    total = 0
    for item in plan.items:
        td = getattr(item, "tensor_data", None)
        if td is None:
            continue
        n = 1
        for s in td.chunk.sizes:
            n *= int(s)
        total += n * torch.empty((), dtype=td.properties.dtype).element_size()
    return total


def upload(storage: Any, key: str, buf: "bytearray | memoryview") -> None:
    """One serialised file to storage (its checksum noted in the write log): an object store's parallel part
    upload where there is one (a shard may be far bigger than one PUT should carry), else the store's atomic
    whole-file write."""
    opener = getattr(storage, "open_upload", None)
    if opener is None:
        storage.write_bytes(key, buf)
        return
    stream = opener(key)
    try:
        stream.write(memoryview(buf))
        stream.close()
    except BaseException:
        stream.abort()
        raise


def _int(v: int) -> torch.Tensor:
    return torch.tensor([v], dtype=torch.int64)


def _serialise(plan: SavePlan, planner: SavePlanner) -> tuple[list[Any], dict[str, memoryview]]:
    """This rank's DCP data file in host memory: the write results and {file name: bytes}, written item by
    item as the storage writers do (``torch.save`` per item, byte items first)."""
    prefix = getattr(plan.storage_data, "prefix", None)
    if not isinstance(prefix, str):
        raise RuntimeError("evacuation needs the storage prefix DCP's global plan gives each rank")
    name = f"{prefix}0{SUFFIX}"
    # Sized up front (the tensors' bytes plus torch.save's per-item framing): a growing buffer re-copies
    # everything written so far at each doubling — 0.4 s instead of 0.15 s for 128 MiB here.
    # Extended by a write at its end, not ``BytesIO(bytearray(n))``: that copies the initial buffer, 2x the
    # shard in host memory for a moment on a node that is short of time and may be short of memory.
    buf, size = io.BytesIO(), unique_bytes(plan) + len(plan.items) * ITEM_SLACK
    if size:
        buf.seek(size - 1)
        buf.write(b"\0")
        buf.seek(0)
    transforms = _StorageWriterTransforms(None)
    results = []
    items = [i for i in plan.items if i.type == WriteItemType.BYTE_IO] + \
        [i for i in plan.items if i.type != WriteItemType.BYTE_IO]
    with _no_crc32():  # as the object-store writer: the commit record's CRC32C blocks cover every byte
        for item in items:
            data = planner.resolve_data(item)
            if isinstance(data, torch.Tensor):
                data = minimal_storage(data.detach().cpu())
            results.append(_write_item(transforms, buf, data, item, name, SerializationFormat.TORCH_SAVE))
    buf.truncate(buf.tell())
    return results, {name: buf.getbuffer()}  # the buffer itself (writable, no copy)


class Evacuation:
    """One save's evacuation role for this rank: a doomed sender, a receiving survivor, or nothing."""

    def __init__(self, group: Any, rank: int, world: int, doomed: "frozenset[int]", storage: Any, key: str,
                 t_end: float, rate: Optional[float], log: Any, fields: dict[str, Any], deferred: bool = False) -> None:
        self.group, self.rank, self.storage, self.key = group, rank, storage, key
        # survivor of a save handed to the survivors (``handoff.py``): upload after ``write_data`` returned
        self.deferred = deferred and rank not in doomed
        self._uploads: Optional[threading.Thread] = None
        self._upload_errors: list[BaseException] = []
        self.t_end, self.rate, self.log, self.fields = t_end, rate, log, fields
        pairs = pair_ranks(world, doomed)
        self.to: Optional[int] = pairs.get(rank)  # doomed: who receives my files
        self.sources = [d for d, s in sorted(pairs.items()) if s == rank]  # survivor: whose files I receive
        self.sent = 0  # doomed: bytes acknowledged by ``to``
        self.received: dict[int, int] = {}  # survivor: bytes received (and uploaded) per source rank
        self.budget = memory_budget() if self.sources or self.deferred else None  # survivor: bytes it may hold
        self.decision = ""  # doomed: "evacuate", "direct" (and why in ``why``)
        self.why = ""

    @classmethod
    def for_save(cls, group: Any, doomed: "Optional[frozenset[int]]", storage: Any, key: str, t_end: float,
                 rate: Optional[float], log: Any, fields: dict[str, Any],
                 deferred: bool = False) -> "Optional[Evacuation]":
        """This rank's role, or None (single process, no rank or every rank doomed, or no role here).
        ``deferred`` (the save is handed to the survivors): every survivor has one, receiving or not."""
        if group is None or not doomed or not dist.is_initialized():
            return None
        world = dist.get_world_size(group)
        if len(doomed) >= world:
            return None
        me = cls(group, dist.get_rank(group), world, doomed, storage, key, t_end, rate, log, fields, deferred)
        return me if me.to is not None or me.sources or me.deferred else None

    # ------------------------------------------------------------------ both

    def wrap(self, writer: Any) -> Any:
        """``writer`` whose ``write_data`` evacuates (doomed) or also receives and uploads (survivor)."""
        orig = writer.write_data
        writer.write_data = self._sender(orig) if self.to is not None else self._receiver(orig)
        return writer

    def info(self) -> dict[str, Any]:
        """What this rank reports to the commit record's writers."""
        if self.to is not None and self.sent:
            return {"evacuated_to": self.to, "evacuated_bytes": self.sent}
        if self.received:
            return {"received": {str(r): n for r, n in self.received.items()}}
        return {}

    def _send(self, t: torch.Tensor) -> None:
        dist.send(t, group=self.group, group_dst=self.to, tag=TAG)

    def _recv(self, t: torch.Tensor, src: int) -> None:
        dist.recv(t, group=self.group, group_src=src, tag=TAG)

    # ------------------------------------------------------------------ doomed

    def decide(self, nbytes: int) -> bool:
        """Evacuate ``nbytes`` (this rank's unique bytes)? ``always``/``never``, or ``auto``: the direct write at
        the measured rate would take more than ``SHARE`` of the time left to the deadline."""
        mode = evacuate_mode()
        left = self.t_end - time.monotonic()
        rate = self.rate or DEFAULT_RATE
        predicted = nbytes / rate
        go = mode == "always" or (mode == "auto" and predicted > SHARE * left)
        self.decision = "evacuate" if go else "direct"
        self.why = (f"{mode}: {nbytes} bytes at {rate / 2**20:.0f} MiB/s "
                    f"({'measured' if self.rate else 'assumed'}) ~ {predicted:.2f} s, {left:.2f} s left")
        return go

    def _sender(self, orig: Callable[[SavePlan, SavePlanner], Any]) -> Callable[[SavePlan, SavePlanner], Any]:
        def write_data(plan: SavePlan, planner: SavePlanner) -> Any:
            nbytes = unique_bytes(plan)
            if not self.decide(nbytes):
                self._send(_int(0))  # the survivor stops waiting: I write myself
                return orig(plan, planner)
            try:
                results, files = _serialise(plan, planner)
            except Exception as exc:  # noqa: BLE001 - MemoryError for a big shard, a writer without DCP's prefix
                self.decision, self.why = "direct", f"cannot serialise ({type(exc).__name__}: {exc}); {self.why}"
                self._send(_int(0))  # the survivor stops waiting: I write myself, as without evacuation
                return orig(plan, planner)
            self._hand_over(files)
            fut: Future[list[Any]] = Future()
            fut.set_result(results)
            return fut
        return write_data

    def _hand_over(self, files: dict[str, memoryview]) -> None:
        """``files`` (serialised) to ``self.to``, or — when it has no room for them — to storage myself."""
        if self._evacuate(files):
            return
        for name, data in files.items():  # my write log notes each checksum, as the storage writer would
            self._upload(join_key(self.key, name), data)

    def _evacuate(self, files: dict[str, memoryview]) -> bool:
        """Stream ``files`` to ``self.to`` in bounded chunks; True once it acknowledged every byte, False when it
        declined them (no room in its memory budget)."""
        t0 = time.monotonic()
        head = json.dumps({"files": [[n, len(b)] for n, b in files.items()]}).encode()
        self._send(_int(len(head)))
        self._send(torch.frombuffer(bytearray(head), dtype=torch.uint8))
        grant = _int(0)
        self._recv(grant, self.to)  # type: ignore[arg-type]
        if int(grant[0]) != 1:
            self.decision = "direct"
            self.why = f"rank {self.to} has no room in its memory budget; {self.why}"
            return False
        step = chunk_bytes()
        total = 0
        for data in files.values():
            mv = memoryview(data)
            for off in range(0, len(mv), step):
                piece = mv[off:off + step]
                self._send(torch.frombuffer(piece, dtype=torch.uint8))
            total += len(mv)
        ack = _int(0)
        self._recv(ack, self.to)  # type: ignore[arg-type]
        if int(ack[0]) != total:
            raise RuntimeError(f"evacuation to rank {self.to}: it acknowledged {int(ack[0])} of {total} bytes")
        self.sent = total
        self.log.info(ev.CHECKPOINT_EVACUATED, to_rank=self.to, bytes=total, files=len(files),
                      seconds=round(time.monotonic() - t0, 4), decision=self.why, **self.fields)
        return True

    # ------------------------------------------------------------------ survivor

    def _receiver(self, orig: Callable[[SavePlan, SavePlanner], Any]) -> Callable[[SavePlan, SavePlanner], Any]:
        def write_data(plan: SavePlan, planner: SavePlanner) -> Any:
            if self.deferred:
                return self._write_deferred(orig, plan, planner)
            errors: list[BaseException] = []
            t = self._start_receiving(self.receive_all, errors)
            try:
                fut = orig(plan, planner)
                fut.wait()
            finally:
                t.join()  # bounded: every recv has the group's timeout (the notice's deadline)
            if errors:
                raise errors[0]
            return fut
        return write_data

    def _start_receiving(self, work: Callable[[dict[int, Any]], None], errors: list[BaseException]) -> threading.Thread:
        """Start the receiver thread (``work`` gets each source's posted header receive) and return once every
        header receive is posted. Why: a doomed rank's first message, its 8-byte header, is a gloo send that
        blocks until the matching receive is posted, and what this thread does next — its own write, which
        starts by extending a buffer to its whole file in one call that holds the GIL (~0.9 s per GiB here) —
        kept a receiver that had not posted yet from running: the doomed rank was safe ~1 s later in about
        half the trials (``benchmarks/doomed_plan.py`` at 1 GiB: 0.2 s or 1.0 s)."""
        posted = threading.Event()

        def run() -> None:
            try:
                heads = self._post_heads()
                posted.set()
                work(heads)
            except BaseException as exc:  # noqa: BLE001 - raised on the save's thread by the caller
                errors.append(exc)
            finally:
                posted.set()

        t = threading.Thread(target=run, name="spotguard-evac-recv", daemon=True)
        t.start()
        posted.wait(POST_WAIT)
        return t

    def _post_heads(self) -> dict[int, "tuple[torch.Tensor, Any]"]:
        """The receive of every source's header, posted now (each source's 8-byte send completes at once)."""
        heads = {}
        for src in self.sources:
            h = _int(0)
            heads[src] = (h, self._post_recv(h, src))
        return heads

    def _post_recv(self, t: torch.Tensor, src: int) -> Any:
        return dist.irecv(t, group=self.group, group_src=src, tag=TAG)

    def receive_all(self, heads: "Optional[dict[int, tuple[torch.Tensor, Any]]]" = None) -> None:
        """Take every source's files into host memory, acknowledging each on receipt, and only then upload them
        beside my own. Why this order: a source is *safe* at my acknowledgement, and storage is the slow path
        its deadline cannot afford — a second source (two doomed ranks per survivor, or more doomed ranks than
        survivors) must not wait for the upload of the first one's files. The price: every source's files are
        in my host memory at once (the sum of their unique shards) until uploaded."""
        heads = self._post_heads() if heads is None else heads
        self._upload_held([(src, *self._receive(src, heads[src])) for src in self.sources])

    def _upload_held(self, held: "list[tuple[int, list[tuple[str, bytearray]], float]]") -> None:
        for src, got, received in held:
            t0 = time.monotonic()
            for name, buf in got:  # the storage notes each file's checksum in my write log, as for my own
                self._upload(join_key(self.key, name), buf)
            total = sum(len(b) for _, b in got)
            if got:  # (a source that writes its own files is not in ``received``)
                self.received[src] = total
                self.log.info(ev.EVACUATION_RECEIVED, from_rank=src, bytes=total, receive_seconds=round(received, 4),
                              upload_seconds=round(time.monotonic() - t0, 4), **self.fields)
            got.clear()  # each file leaves my memory once it is in storage

    # ------------------------------------------------------------------ survivor of a handed-over save

    def _write_deferred(self, orig: Callable[[SavePlan, SavePlanner], Any], plan: SavePlan,
                        planner: SavePlanner) -> Any:
        """The survivors finish the save after the doomed ranks left (``handoff.py``): DCP's write results
        must be known before any byte reaches storage, so my own file is serialised into host memory (its
        offsets and lengths are known then) while the sources' files are received and acknowledged; the
        uploads of both run on a thread that ``wait_uploads`` joins. Without room in the memory budget for
        my own file it is written as without a handoff (the doomed ranks then wait in DCP's gather for it)."""
        own = unique_bytes(plan) + len(plan.items) * ITEM_SLACK
        early = self.budget is None or own <= self.budget
        if early and self.budget is not None:
            self.budget -= own
        held: list[tuple[int, list[tuple[str, bytearray]], float]] = []
        errors: list[BaseException] = []
        t = self._start_receiving(lambda heads: held.extend((src, *self._receive(src, heads[src]))
                                                           for src in self.sources), errors)
        files: dict[str, memoryview] = {}
        try:
            results: Any = None
            if early:
                try:
                    results, files = _serialise(plan, planner)
                except Exception:  # noqa: BLE001 - MemoryError, a writer without DCP's prefix: as without
                    early = False
            if not early:
                fut = orig(plan, planner)
                fut.wait()
                results = fut.value()
        finally:
            t.join()  # bounded: every recv has the group's timeout (the doomed ranks' deadline)
        if errors:
            raise errors[0]
        self._uploads = threading.Thread(target=self._upload_deferred, args=(files, held),
                                         name="spotguard-survivor-upload", daemon=True)
        self._uploads.start()
        out: Future[list[Any]] = Future()
        out.set_result(results)
        return out

    def _upload_deferred(self, files: dict[str, memoryview],
                         held: "list[tuple[int, list[tuple[str, bytearray]], float]]") -> None:
        try:
            for name in list(files):
                self._upload(join_key(self.key, name), files.pop(name))
            self._upload_held(held)
        except BaseException as exc:  # noqa: BLE001 - reported by ``wait_uploads``
            self._upload_errors.append(exc)

    def wait_uploads(self, t_end: float) -> Optional[str]:
        """A survivor of a handed-over save: None once every deferred upload is in storage, else why not
        (failed, or still running at ``t_end``, monotonic)."""
        t = self._uploads
        if t is not None:
            t.join(max(0.0, t_end - time.monotonic()))
            if t.is_alive():
                return "the survivor's uploads did not finish within its bound"
        if self._upload_errors:
            exc = self._upload_errors[0]
            return f"{type(exc).__name__}: {exc}"
        return None

    def _receive(self, src: int, posted: "tuple[torch.Tensor, Any]") -> tuple[list[tuple[str, bytearray]], float]:
        """One doomed rank's files in host memory, acknowledged: ([(name, bytes)], seconds to receive them);
        ([], 0.0) when it writes its own files. ``posted``: its header's receive (``_start_receiving``)."""
        head, work = posted
        work.wait()  # as ``dist.recv``: bounded by the group's timeout (the notice's deadline)
        n = int(head[0])
        if n == 0:
            return [], 0.0  # it writes its own files
        if n < 0:  # never sent by a sender here (one that cannot serialise sends 0 and writes itself)
            raise RuntimeError(f"rank {src} sent a malformed evacuation header ({n}); its save fails")
        raw = torch.empty(n, dtype=torch.uint8)
        self._recv(raw, src)
        listing = json.loads(bytes(raw.numpy()).decode())["files"]
        for name, _size in listing:
            if not isinstance(name, str) or "/" in name or not name.endswith(SUFFIX):
                raise RuntimeError(f"rank {src} sent an unexpected file name {name!r}")
        want = sum(int(size) for _, size in listing)
        fits = self.budget is None or want <= self.budget
        self._send_ack(1 if fits else 0, src)  # the grant
        if not fits:
            self.log.info(ev.EVACUATION_DECLINED, from_rank=src, bytes=want, budget=self.budget, **self.fields)
            return [], 0.0
        if self.budget is not None:
            self.budget -= want
        step = chunk_bytes()
        t0 = time.monotonic()
        got: list[tuple[str, bytearray]] = []
        for name, size in listing:
            buf = bytearray(int(size))
            view = torch.frombuffer(buf, dtype=torch.uint8) if size else torch.empty(0, dtype=torch.uint8)
            for off in range(0, int(size), step):
                self._recv(view[off:off + step], src)
            got.append((name, buf))
        self._send_ack(sum(len(b) for _, b in got), src)
        return got, time.monotonic() - t0

    def _upload(self, key: str, buf: "bytearray | memoryview") -> None:
        upload(self.storage, key, buf)

    def _send_ack(self, total: int, src: int) -> None:
        dist.send(_int(total), group=self.group, group_dst=src, tag=TAG)
