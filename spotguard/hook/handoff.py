"""The doomed ranks leave once safe; the survivors finish the save and commit on their own (issue 26).

Why: a doomed rank is *safe* once its bytes are durable or acknowledged by a
survivor (``evacuate.py``), yet every collective of the save after its write
(DCP's gather of write results and ``.metadata``, the durable barrier, the
commit broadcast) included it, and the survivors' uploads were bounded by its
deadline: a commit could never land after the doomed node left, however early
it was safe. Here, when some (not all) ranks are doomed:

1. Before the write, while every rank is there, the save's ranks create a gloo
   group of the survivors (``Handoff.create``).
2. Each survivor's DCP ``write_data`` returns its write results before any byte
   reaches storage (its file serialised into host memory, offsets known then;
   ``Evacuation._write_deferred``) and uploads on a thread. So DCP's gather
   and ``.metadata`` (written by DCP's coordinator, rank 0, doomed or not,
   while every rank is still there) complete as soon as the doomed ranks are
   safe.
3. One all-gather on the save's group (the *handoff*): every rank's "my write
   went well", and each doomed rank's write log and safe info (what the commit
   record must list). A failure anywhere fails the save on every rank, as the
   durable barrier did.
4. The doomed ranks leave the save's collectives: each waits idle for the
   survivors' word (a point-to-point message on the save's group) until its own
   bound (the deadline less the margin), then exits as before — committed if
   the word came, else 75 (it never learns later).
5. The survivors wait for their uploads, then run the durable barrier, the
   write-log gather and the commit broadcast on the survivors' group; the
   lowest surviving rank writes the commit record (rank 0's role when rank 0
   is doomed) and tells the doomed ranks. Their bound is their own: the doomed
   deadline plus ``SPOTGUARD_SIGNAL_GRACE`` — the launcher SIGTERMs the
   survivors once the doomed node is gone (at its deadline at the latest), and
   the SIGTERM leaves that long before the SIGKILL (torchrun's default 30 s).
   A SIGTERM that comes earlier bounds the round from its arrival
   (``notices._bound_running_round``).

When nothing in the DCP state is sharded (DDP, one replicated model: no DTensor or
ShardedTensor, and every rank holds the same items apart from its per-rank
state, so DCP's dedup gives all of a doomed rank's items to a survivor —
``Handoff.replicated_only``, one MAX all-reduce at the write), steps 2 and 3
change: the doomed ranks take no part in ``dcp.save`` at all. Each writes its
per-rank state as its own DCP data file (``__<rank>_0.distcp``, the name a save
by every rank gives it; ``write_own``), is safe once that is durable, and joins
the handoff gather at once with the file's DCP write results; the survivors
take that gather *before* their write (``survivors_first``), then run
``dcp.save`` on the survivors' group and write their files directly (nothing
serialised into memory first: no doomed rank waits in DCP's gather for it). Their
files keep their rank in the save's group as name and their coordinator
(the lowest survivor) adds the doomed ranks' per-rank state to ``.metadata``
(``survivors_writer``), so the checkpoint reads as one written by every rank.
Why: in DCP's collectives a doomed rank waited for the survivors' serialisation
(~0.9 s per GiB), and its first evacuation message (8 bytes: "I write my own
bytes") for a survivor whose receiver thread was kept from the GIL by that
serialisation; it had kilobytes of its own to write. ``SPOTGUARD_EVACUATE=always``
keeps steps 2-3 (its per-rank state goes through a survivor).

Rules kept: the commit record is written only when every byte is in storage
(the survivors' durable barrier follows their uploads; the doomed ranks' bytes
were durable or held by a survivor before the handoff); a survivor lost before
the commit fails the survivors' collectives (bounded) and nothing is
committed; with no rank or every rank doomed, or a save group that is not the
whole world (a survivors' group needs every process of the world), none of
this runs.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import time
from datetime import datetime, timedelta
from typing import Any, Optional

import torch
import torch.distributed as dist

from ..notice import Notice
from ..storage.base import join_key
from ..storage.integrity import merge
from ..timefmt import utcnow
from . import events as ev
from .dist import all_max
from .doomed import writers_record
from .settings import SAVE_MARGIN, SIGNAL_GRACE

__all__ = ["Handoff", "COMMIT_TAG", "split_for", "finish_split", "layout_of"]

COMMIT_TAG = 0x5E7B  # P2P tag of the survivors' word to a doomed rank (committed, bytes)


class Handoff:
    """One save's split between the doomed ranks (leave once safe) and the survivors (finish and commit)."""

    def __init__(self, group: Any, sgroup: Any, rank: int, doomed: "frozenset[int]", world: int,
                 deadline: datetime, t_doomed: float) -> None:
        self.group, self.sgroup, self.rank, self.doomed = group, sgroup, rank, doomed
        self.survivors = [r for r in range(world) if r not in doomed]
        self.coordinator = self.survivors[0]  # writes the commit record and tells the doomed ranks
        self.is_doomed = rank in doomed
        self.t_doomed = t_doomed  # monotonic: a doomed rank waits for the word until then
        # the survivors' own bound: the doomed deadline plus the SIGTERM's grace, less the save's margin
        self.deadline = deadline + timedelta(seconds=SIGNAL_GRACE)
        left = (self.deadline - utcnow()).total_seconds()
        self.t_survivors = time.monotonic() + left - min(SAVE_MARGIN, max(0.0, left) / 2)
        self.replicated = False  # nothing sharded: the doomed ranks stay out of dcp.save (``replicated_only``)
        self.own: Any = None  # doomed, replicated: the DCP write results and metadata of my per-rank state
        self.owns: list[Any] = []  # survivors, replicated: each doomed rank's ``own`` (by rank)
        self.early: Any = None  # survivors, replicated: the handoff gather's answer, taken before our write

    @classmethod
    def create(cls, group: Any, doomed: "Optional[frozenset[int]]", deadline: datetime,
               t_doomed: float) -> "Optional[Handoff]":
        """Every rank of the save's group, before the write: the handoff, or None (today's path: no rank or
        every rank doomed, a single process, or a save group that is not the whole world)."""
        if group is None or not doomed or not dist.is_initialized():
            return None
        world = dist.get_world_size(group)
        if len(doomed) >= world or world != dist.get_world_size():
            return None
        members = [dist.get_global_rank(group, r) for r in range(world) if r not in doomed]
        me = cls(group, None, dist.get_rank(group), doomed, world, deadline, t_doomed)
        sgroup = dist.new_group(ranks=members, backend="gloo",
                                timeout=timedelta(seconds=max(5.0, me.t_survivors - time.monotonic())))
        me.sgroup = None if me.is_doomed else sgroup
        return me

    def close(self) -> None:
        """Release the survivors' group (a local operation)."""
        sg, self.sgroup = self.sgroup, None
        if sg is not None:
            try:
                dist.destroy_process_group(sg)
            except Exception:  # noqa: BLE001 - leaving anyway
                pass

    # ------------------------------------------------------------------ both, while every rank is there

    def exchange(self, ok: bool, mine: dict[str, Any], info: Any) -> "tuple[bool, list[Any]]":
        """The handoff gather: (every rank's write went well, [(write log, info) of each doomed rank, else
        None]). A survivor of a replicated save took it before its write (``survivors_first``): that answer."""
        if self.early is not None:
            return self.early
        reports: list[Any] = [None] * dist.get_world_size(self.group)
        dist.all_gather_object(reports, (ok, mine if self.is_doomed else None, info if self.is_doomed else None,
                                         self.own if self.is_doomed else None), group=self.group)
        self.owns = [r[3] if r else None for r in reports]
        return all(bool(r and r[0]) for r in reports), [(r[1], r[2]) if r else None for r in reports]

    # ------------------------------------------------------------------ replicated state (DDP): no doomed bytes in DCP

    def replicated_only(self, sd: dict[str, Any], own_key: str, off: bool = False) -> bool:
        """Every rank of the save's group, at its write (one MAX all-reduce): True when no rank's state dict
        holds a sharded tensor and every rank holds the same items besides its own per-rank state ``own_key``
        (DCP's dedup then gives every item of a doomed rank to a survivor), and no rank is told to evacuate
        (``SPOTGUARD_EVACUATE=always``: its per-rank state goes through a survivor, as before). Then the
        doomed ranks stay out of ``dcp.save``: each writes its per-rank state only (``write_own``) and the
        survivors save among themselves — a doomed rank is safe in the time its kilobytes take, not after the
        survivors' serialisation, whatever the state size. ``off`` (this rank's ``SPOTGUARD_SURVIVORS_PLAN=0``)
        keeps every rank on the old path: the knob is read per process, so it is agreed here, not assumed."""
        from .evacuate import evacuate_mode  # noqa: PLC0415

        sharded, digest = layout_of(sd, own_key)
        forced = evacuate_mode() == "always"  # its per-rank state through a survivor: the evacuation path
        top = all_max(self.group, [int(sharded or forced or off), digest, -digest])
        self.replicated = top[0] == 0 and top[1] == -top[2]
        return self.replicated

    def write_own(self, storage: Any, key: str, sd: dict[str, Any], own_key: str) -> None:
        """A doomed rank of a replicated save: its per-rank state as a DCP data file under the name DCP would
        give it (``__<rank>_0.distcp``), durable on return; the write results and metadata go to the survivors
        with the handoff, and their coordinator lists them in ``.metadata``."""
        from torch.distributed.checkpoint import DefaultSavePlanner  # noqa: PLC0415
        from torch.distributed.checkpoint.filesystem import _StoragePrefix  # noqa: PLC0415
        from torch.distributed.checkpoint.metadata import BytesStorageMetadata  # noqa: PLC0415

        from .evacuate import _serialise, upload  # noqa: PLC0415

        planner = DefaultSavePlanner()
        planner.set_up_planner({own_key: sd[own_key]}, is_coordinator=False)
        plan = dataclasses.replace(planner.create_local_plan(), storage_data=_StoragePrefix(f"__{self.rank}_"))
        results, files = _serialise(plan, planner)
        for name, data in files.items():  # my write log notes each checksum, as the storage writer would
            upload(storage, join_key(key, name), data)
        self.own = (results, {i.index.fqn: BytesStorageMetadata() for i in plan.items}, plan.planner_data)

    def survivors_first(self) -> None:
        """A survivor of a replicated save, before its write: the handoff gather (the doomed ranks' own
        results). A doomed rank that failed to write fails the save on every rank, as after a write."""
        self.early = self.exchange(True, {}, None)  # kept: ``finish_split`` asks again
        if not self.early[0]:
            raise RuntimeError("a doomed rank failed to write its per-rank state")

    def survivors_writer(self, writer: Any) -> Any:
        """``writer`` for the survivors' ``dcp.save`` on their own group: each survivor's files keep the name
        of its rank in the save's group (``__<rank>_``, not its rank among the survivors: no clash with a
        doomed rank's file, the layout of a save by every rank), and the coordinator's ``.metadata`` also
        lists the doomed ranks' per-rank state."""
        prepare, finish = writer.prepare_global_plan, writer.finish

        def prepare_global_plan(plans: list[Any]) -> list[Any]:
            out = prepare(plans)
            return [_renamed(p, i, r) for i, (p, r) in enumerate(zip(out, self.survivors))]

        def finish_with_doomed(metadata: Any, results: list[Any]) -> Any:
            results = list(results)
            for own in self.owns:
                if own is None:
                    continue
                res, md, mappings = own
                results.append(res)
                metadata.state_dict_metadata.update(md)
                if isinstance(metadata.planner_data, dict) and isinstance(mappings, dict):
                    metadata.planner_data.update(mappings)
            return finish(metadata, results)

        writer.prepare_global_plan, writer.finish = prepare_global_plan, finish_with_doomed
        return writer

    # ------------------------------------------------------------------ doomed

    def wait_word(self, log: Any, fields: dict[str, Any]) -> "tuple[Optional[bool], int, Any]":
        """A doomed rank, safe and out of the save's collectives: (committed, bytes, the record's writers) from
        the survivors' word, or (None, 0, None) at ``t_doomed`` without one (it leaves then, as the deadline
        requires; the survivors may still commit) — a word of failure is (False, ...): nothing will commit."""
        head = torch.zeros(3, dtype=torch.int64)
        log.info(ev.CHECKPOINT_HANDED_OVER, to_rank=self.coordinator,
                 waits_seconds=round(max(0.0, self.t_doomed - time.monotonic()), 3), **fields)
        try:
            self._recv(head)
            body = torch.zeros(max(0, int(head[2])), dtype=torch.uint8)
            if body.numel():
                self._recv(body)
        except Exception:  # noqa: BLE001 - no word by my bound (or the survivor is gone): leave uncommitted
            return None, 0, None
        writers = json.loads(bytes(body.numpy()).decode()) if body.numel() else None
        return bool(head[0]), int(head[1]), writers

    def _recv(self, t: torch.Tensor) -> None:
        work = dist.irecv(t, group=self.group, group_src=self.coordinator, tag=COMMIT_TAG)
        if work.wait(timedelta(seconds=max(0.1, self.t_doomed - time.monotonic()))) is False:
            raise TimeoutError("no word from the survivors")

    # ------------------------------------------------------------------ survivors

    def commit_inputs(self, mine: dict[str, Any], info: Any, handed: list[Any]) -> "tuple[dict[str, Any], list[Any]]":
        """The survivors' write logs (gathered on their group) merged with the doomed ranks' (from the
        handoff): (every file written, every rank's info by rank in the save's group)."""
        reports: list[Any] = [None] * len(self.survivors)
        dist.all_gather_object(reports, (mine, info), group=self.sgroup)
        infos: list[Any] = [None] * (len(self.survivors) + len(self.doomed))
        for r, rep in zip(self.survivors, reports):
            infos[r] = rep[1] if rep else None
        for r in self.doomed:
            infos[r] = handed[r][1] if handed[r] else None
        logs = [(rep[0] if rep else None) or {} for rep in reports] + \
            [(handed[r][0] if handed[r] else None) or {} for r in sorted(self.doomed)]
        return merge(logs), infos

    def all_ok(self, ok: bool) -> bool:
        return all_max(self.sgroup, [0 if ok else 1])[0] == 0

    def bcast(self, obj: Any) -> Any:
        box = [obj]
        dist.broadcast_object_list(box, group=self.sgroup, group_src=0)
        return box[0]

    def tell_doomed(self, committed: bool, nbytes: int, writers: Any) -> None:
        """The coordinator, after the commit broadcast: the word to each doomed rank (best effort, bounded:
        a doomed rank already gone — its deadline came first — makes the send fail or time out)."""
        if self.rank != self.coordinator:
            return
        body = json.dumps(writers).encode() if committed and writers else b""
        for d in sorted(self.doomed):
            try:
                for t in (torch.tensor([int(committed), nbytes, len(body)], dtype=torch.int64),
                          torch.frombuffer(bytearray(body), dtype=torch.uint8) if body else None):
                    if t is not None:
                        dist.isend(t, group=self.group, group_dst=d, tag=COMMIT_TAG).wait(timedelta(seconds=2.0))
            except Exception:  # noqa: BLE001 - it left at its deadline: nothing to tell
                pass


def layout_of(sd: dict[str, Any], own_key: str) -> "tuple[bool, int]":
    """(whether ``sd`` cannot be left to the survivors — a DTensor/ShardedTensor anywhere, or no plain per-rank
    state under ``own_key`` —, a digest of its DCP item names besides ``own_key``)."""
    from torch.distributed._shard.sharded_tensor import ShardedTensor  # noqa: PLC0415
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict  # noqa: PLC0415
    from torch.distributed.tensor import DTensor  # noqa: PLC0415

    flat, _ = flatten_state_dict(sd)
    sharded = any(isinstance(v, (DTensor, ShardedTensor)) for v in flat.values()) or \
        own_key not in flat or isinstance(flat[own_key], torch.Tensor)
    names = "\0".join(sorted(k for k in flat if k != own_key)).encode()
    return sharded, int.from_bytes(hashlib.blake2b(names, digest_size=7).digest(), "big")


def _renamed(plan: Any, i: int, rank: int) -> Any:
    """A survivor's plan (index ``i`` among the survivors) with DCP's ``__<i>_`` file prefix made ``__<rank>_``."""
    prefix = getattr(plan.storage_data, "prefix", None)
    if prefix != f"__{i}_":
        return plan
    return dataclasses.replace(plan, storage_data=dataclasses.replace(plan.storage_data, prefix=f"__{rank}_"))


# ---------------------------------------------------------------------- the save's side (``save._save``)


def split_for(hook: Any, group: Any, doomed: "Optional[frozenset[int]]", notice: Notice, t_store: float,
              scope: contextlib.ExitStack) -> "Optional[Handoff]":
    """This save's ``handoff.Handoff`` (some, not all, ranks doomed), or None (today's path). A survivor's
    storage requests, hold and lateness are bounded by the survivors' own bound from here."""
    if not doomed or not hook._dist:
        return None
    split = Handoff.create(group, doomed, notice.deadline, t_store)
    if split is not None and not notice.emergency:  # an ordinary checkpoint (a doomed rank's own notice is far
        split.t_doomed = split.t_survivors  # off): nobody leaves, so it waits for the word as long as they work
    if split is not None and not split.is_doomed:
        scope.enter_context(hook._storage.deadline_at(split.t_survivors))
        hook._late_deadline = split.deadline
        hook._steps.extend_hold(split.t_survivors)  # a held training thread must not give up (exit 75) at the
        # doomed ranks' bound
    return split


def finish_split(hook: Any, split: Handoff, notice: Notice, reason: str, step: int, uri: str, key: str,
                 err: Optional[str], doomed: "frozenset[int]", t0: float) -> Any:
    """After the write (``hook``: the ``Hook``; returns its ``_Result``): the handoff, then a
    doomed rank waits for the survivors' word; the survivors upload, agree and commit among themselves.
    Past the handoff the save's group never runs a collective again: any failure is ``peers_ok=False``
    (no rank retries on it)."""
    fields = {"notice_id": notice.id, "step": step}
    mine = hook._storage.write_log.take(key) if split.is_doomed else {}
    info = {**hook._safe.info(), "bytes": sum(d.size for d in mine.values())} if split.is_doomed else None
    try:
        ok, handed = split.exchange(err is None, mine, info)
    except BaseException as exc:  # noqa: BLE001 - a rank died or timed out before the handoff
        if isinstance(exc, (KeyboardInterrupt, SystemExit)):
            raise
        return hook._fail(notice, step, f"handoff: {type(exc).__name__}: {exc}", t0, peers_ok=False)
    if not ok:
        return hook._fail(notice, step, err or "another rank failed to write its shards", t0, peers_ok=True)
    if split.is_doomed:
        committed, nbytes, hook._writers = split.wait_word(hook._log, fields)
        if committed:
            return hook._finish_ok(notice, step, uri, nbytes, t0)
        if committed is False:  # told: the survivors' commit failed (their checkpoint_failed says why)
            return hook._fail(notice, step, "safe, then left the save to the survivors, who reported that their "
                              "commit failed: nothing is committed for this step (the previous checkpoint stays "
                              "newest)", t0, peers_ok=False)
        return hook._fail(notice, step, "safe, then left the save to the survivors at this rank's bound without "
                          "word of their commit: they may still commit it on their own bound (the newest "
                          "commit tells)", t0, peers_ok=False)
    stage, outcome, writers = "survivors-upload", ("error", ""), None
    try:
        why = hook._evac.wait_uploads(split.t_survivors) if hook._evac is not None else None
        why = why or err  # (a replicated save's handoff came before our write: it may have failed since)
        stage = "survivors-durable-barrier"
        if not split.all_ok(why is None):
            raise RuntimeError(why or "another survivor failed to write or upload its shards")
        stage = "survivors-gather"
        mine = hook._storage.write_log.take(key)
        written, infos = split.commit_inputs(mine, {**hook._safe.info(), "bytes": sum(d.size for d in mine.values())},
                                             handed)
        writers = writers_record(infos, doomed)
        stage = "survivors-commit"
        outcome = split.bcast(hook._commit(notice, reason, step, t0, written, writers)
                              if split.rank == split.coordinator else None)
    except BaseException as exc:  # noqa: BLE001 - a survivor died, timed out or failed to upload
        if isinstance(exc, (KeyboardInterrupt, SystemExit)):
            raise
        outcome = ("error", f"{stage}: {type(exc).__name__}: {exc}")
    committed = outcome[0] == "ok"
    split.tell_doomed(committed, int(outcome[1]) if committed else 0, writers)
    if not committed:
        return hook._fail(notice, step, f"the survivors' commit failed: {outcome[1]}", t0, peers_ok=False)
    hook._writers = writers
    return hook._finish_ok(notice, step, uri, int(outcome[1]), t0)
