"""The checkpoint write: DCP save -> every byte durable -> rank 0 commits -> commit barrier.

Used by emergency, ordinary (rebalance/maintenance) and adapter checkpoints;
periodic background saves (``periodic.py``) follow the same protocol on their
own group. ``_save`` never raises: a failure is reported (``checkpoint_failed``)
and the previous commit stays the newest.
"""

from __future__ import annotations

import contextlib
import sys
import threading
import time
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from ..notice import Notice
from ..protocol import CheckpointDone, CheckpointFailed, CheckpointStarted
from ..storage import Storage
from ..storage.base import join_key
from ..storage.commit import (
    COMMIT_NAME,
    CommitRecord,
    commit_and_retain,
    prepare_status,
    step_dir,
)
from ..timefmt import to_rfc3339, utcnow
from ..version import __version__
from . import elastic
from . import events as ev
from .dist import (
    gather_writes_with,
    set_group_timeout,
)
from .doomed import SafeMark, plan_around_doomed, with_late_notices, writers_record
from .handoff import finish_split, split_for
from .periodic import PERIODIC_SETTLED, stage_state_dict
from .settings import EMERGENCY_LEAD, HANDED_OVER, PERIODIC_NOTICE_PREFIX, SAVE_MARGIN
from .state import Snapshot, clone_buffers, copy_state, pack

#: "the hook's own group" (the training thread's) as a default argument
_OWN: Any = object()


@dataclass
class _Result:
    committed: bool
    peers_ok: bool = True
    uri: str = ""
    bytes: int = 0
    seconds: float = 0.0
    error: str = ""
    late_seconds: float = 0.0  # > 0: committed that long after the emergency notice's deadline
    step: Optional[int] = None  # the step this result stands for when not the agreed one (the exact fallback)



#: a stateful object whose state_dict holds at most this many bytes of tensors is copied at every iteration's
#: anchor (``_copy_at_anchor``); a bigger one (an EMA) is read when a round needs it
ANCHOR_COPY_BYTES = 64 << 10

# The shortest notices real clouds give (docs/deploy.md: AWS 120 s, GCP and Azure 30 s): what a drill's save is compared with.
REAL_NOTICE_SECONDS = {"gcp": 30.0, "azure": 30.0, "aws": 120.0}


def late_by(notice: Notice, deadline: Any = None) -> float:
    """Seconds past an emergency notice's deadline now (<= 0: in time); ``deadline``: the survivors' own bound
    when a handed-over save's doomed ranks have left (``handoff.py``). Rebalance and maintenance notices
    carry no deadline by which the VM is gone, so nothing is late for them."""
    if not notice.emergency:
        return 0.0
    return (utcnow() - (deadline or notice.deadline)).total_seconds()


def drill_verdict(notice: Notice) -> dict[str, Any]:
    """For a drill: whether the same save would have beaten each cloud's real notice (seconds from the moment
    the hook acts on it: receipt, or ``EMERGENCY_LEAD`` before a far deadline)."""
    start = max(notice.received_at.timestamp(), notice.deadline.timestamp() - EMERGENCY_LEAD)
    took = utcnow().timestamp() - start
    return {"seconds_since_notice": round(took, 3),
            "would_beat": {cloud: took <= secs for cloud, secs in REAL_NOTICE_SECONDS.items()}}


_BG = threading.local()  # ``on`` while the agreement thread reads state dicts


def _skip_fake_step_in_background() -> None:
    """Make DCP's ``_init_optim_state`` a no-op on the agreement thread (once per process).

    Why: for an optimizer without state (plain SGD) whose gradients are None,
    ``get_optimizer_state_dict`` runs a fake ``optimizer.step()`` with zero
    gradients and lr 0, then ``zero_grad()``: from a background thread that would
    write gradients and ``lr`` under the training thread. Skipped there, the state
    dict is what the fake step would have produced for such an optimizer (no
    state); an optimizer that has stepped has state and is never touched.
    """
    import torch.distributed.checkpoint.state_dict as sdmod  # noqa: PLC0415

    orig = sdmod._init_optim_state
    if getattr(orig, "__spotguard__", False):
        return

    def init(optim: Any) -> None:
        if getattr(_BG, "on", False):
            return
        try:
            orig(optim)
        except NotImplementedError:
            # A wrapper whose step() is not the update (SAM: first_step/second_step): there is no fake step
            # to run; its state dict is what it holds (an empty state loads into a fresh one as well).
            pass

    init.__spotguard__ = True  # type: ignore[attr-defined]
    sdmod._init_optim_state = init


class SaveMixin:
    """Part of ``Hook`` (``core.py``); see the module docstring."""

    def _report(self, msg: Any) -> None:
        if str(getattr(msg, "id", "")).startswith(PERIODIC_NOTICE_PREFIX):
            return  # about no daemon notice
        if self._intake is not None:
            try:
                self._intake.report(msg)
            except Exception:  # noqa: BLE001 - reporting is best effort
                pass

    def _bcast0(self, obj: Any, group: Any = _OWN) -> Any:
        if not self._dist:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0, group=self._group if group is _OWN else group)
        return box[0]

    def _all_ok(self, ok: bool, group: Any = _OWN) -> bool:
        if not self._dist:
            return ok
        t = torch.tensor([0 if ok else 1], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self._group if group is _OWN else group)
        return int(t[0]) == 0

    def _save_built(self, notice: Notice, reason: str, step: int, group: Any, t_end: float, *,
                    build: Callable[[], Any], put: Callable[[str, Any], None], release: bool,
                    done: Optional[Callable[[Any], None]] = None) -> _Result:
        """A framework adapter's background write of step S (agreement thread): ``build`` makes what is written
        (in the framework's own format) while the next step is held; the hold is released after it when
        ``release``; ``put`` writes it under the step's key inside ``_save``, where an exception ``build`` raised
        is raised again, so that every rank learns of it through the save; ``done`` cleans up what ``build``
        made, after the save."""
        made: Any
        try:
            made = build()
        except Exception as exc:  # noqa: BLE001 - raised in the write: every rank learns it through the save
            made = exc
        finally:
            if release:
                self._release_hold()

        def write(key: str) -> None:
            if isinstance(made, Exception):
                raise made
            put(key, made)

        try:
            return self._save(notice, reason, None, group=group, step=step, write=write,
                              bound=max(1.0, t_end - time.monotonic()))
        finally:
            if done is not None and not isinstance(made, Exception):
                done(made)

    def _save(self, notice: Notice, reason: str, snap: Optional[Snapshot], *, group: Any = _OWN,
              step: Optional[int] = None, write: Optional[Callable[[str], None]] = None,
              bound: Optional[float] = None) -> _Result:
        """Every rank: DCP save -> all bytes durable -> rank 0 commits -> barrier. Never raises.

        Defaults: the training thread's boundary save (the hook's group, the current
        count, ``_write``). The background save passes its own group (the agreement
        thread's), the agreed step, a writer of the staged copy and the time bound
        of its collectives.
        """
        t0 = time.monotonic()
        group = self._group if group is _OWN else group
        step = self._count if step is None else step
        key = step_dir(step)
        uri = f"{self._storage.uri}/{key}"
        set_group_timeout(group, bound if bound is not None else min(600.0, max(5.0, notice.seconds_left() - 0.5)))
        self._log.info(ev.CHECKPOINT_STARTED, notice_id=notice.id, step=step, uri=uri, reason=reason)
        self._report(CheckpointStarted(id=notice.id, step=step))
        stage = "periodic"
        scope = contextlib.ExitStack()
        # Rank 0's background periodic save of this same step waits until this save is over (periodic.py,
        # PeriodicSaver._rank0_prepare): both write step-N/, and its prepare would clear the folder under
        # this save's writes, or its shards overwrite the bytes this save's record checksums.
        self._notice_saving = step
        try:
            self._settle_periodic(notice, group)
            stage = "prepare"
            # Retries and uploads never run past the notice deadline, less a margin for teardown/exit.
            left = notice.seconds_left()
            t_store = time.monotonic() + left - min(SAVE_MARGIN, max(0.0, left) / 2)
            scope.enter_context(self._storage.deadline_at(t_store))
            status = self._bcast0(self._prepare_status(step) if self._rank == 0 else None, group)
            if status[0] == "already":
                return self._finish_ok(notice, step, uri, 0, t0, already=True)
            if status[0] == "error":
                return self._fail(notice, step, f"prepare failed on rank 0: {status[1]}", t0, peers_ok=True)
            stage = "doomed"
            doomed = self._doomed = self._doomed_now(group)
            split = self._split = split_for(self, group, doomed, notice, t_store, scope)
            stage = "write"
            err = None
            self._storage.write_log.take(key)  # what an earlier attempt at this step wrote does not count
            self._safe = SafeMark(self._storage, key, t0, bool(doomed and self._rank in doomed), self._log,
                                  {"notice_id": notice.id, "step": step})
            self._safe.evac = self._evac = self._evacuation(group, doomed, key, t_store, notice, step,
                                                            split is not None)
            t_write = time.monotonic()
            try:
                if write is not None:
                    write(key)
                else:
                    self._write(key, snap)
                self._safe.mark()  # a writer that was not wrapped (an adapter's own format): durable now
                self._note_write_rate(self._safe.bytes, time.monotonic() - t_write)
                if self._test_delay:
                    time.sleep(self._test_delay)  # test-only: widen the window for a SIGKILL during the save
            except BaseException as exc:  # noqa: BLE001 - DCP raises CheckpointException (a BaseException!) on every rank
                if isinstance(exc, (KeyboardInterrupt, SystemExit)):
                    raise
                err = f"{type(exc).__name__}: {exc}"
            if split is not None:  # the doomed ranks leave once safe; the survivors commit (handoff.py)
                stage = "handoff"
                return finish_split(self, split, notice, reason, step, uri, key, err, doomed, t0)
            stage = "durable-barrier"
            if not self._all_ok(err is None, group):
                return self._fail(notice, step, err or "another rank failed to write its shards", t0, peers_ok=True)
            stage = "gather"  # the record names exactly what the ranks report writing
            mine = self._storage.write_log.take(key)
            written, infos = gather_writes_with(group if self._dist else None, mine,
                                                {**self._safe.info(), "bytes": sum(d.size for d in mine.values())})
            writers = writers_record(infos, doomed)
            stage = "commit"
            outcome: Any = self._commit(notice, reason, step, t0, written, writers) if self._rank == 0 else None
            stage = "commit-barrier"
            # Every rank passes this only after the record is durable: no rank may exit before it.
            outcome = self._bcast0(outcome, group)
            if outcome[0] != "ok":
                return self._fail(notice, step, f"commit failed on rank 0: {outcome[1]}", t0, peers_ok=True)
            self._writers = writers  # for _finish_ok's line (its signature is an adapter's override point)
            return self._finish_ok(notice, step, uri, int(outcome[1]), t0)
        except BaseException as exc:  # noqa: BLE001 - a collective failed: a peer died or timed out
            if isinstance(exc, (KeyboardInterrupt, SystemExit)):
                raise
            return self._fail(notice, step, f"{stage}: {type(exc).__name__}: {exc}", t0, peers_ok=False)
        finally:
            self._notice_saving = None
            self._evac = None
            self._late_deadline = None
            split = getattr(self, "_split", None)
            if split is not None:
                self._split = None
                split.close()
            scope.close()

    def _commit(self, notice: Notice, reason: str, step: int, t0: float, written: Any, writers: Any) -> Any:
        """The committing rank: the commit record over ``written`` (every rank's write log), then retention."""
        return commit_and_retain(self._storage, step, CommitRecord(
            step=step, world_size=self._world, reason=reason,
            notice_id=None if reason == "periodic" else notice.id,
            seconds=round(time.monotonic() - t0, 3),
            extra={"spotguard": __version__, "lineage": self._lineage} if reason == "periodic" else
            {"notice_kind": notice.kind, "notice_source": notice.source,
             "deadline": to_rfc3339(notice.deadline), "spotguard": __version__, "lineage": self._lineage,
             "writers": writers},
        ), self._keep, self._log, written, exclude=frozenset(getattr(self, "_damaged_dirs", ())))

    def _prepare_status(self, step: int, storage: Optional[Storage] = None) -> tuple[str, Any]:
        """Rank 0: ``prepare_status``, except that "already committed" counts only for this run's own checkpoint.

        A step folder committed by another run (another lineage in its record) that this run never
        resumed from is not this run's state: claiming it would report ``committed`` for bytes that
        are not ours. That is an error naming the fix.
        """
        storage = storage or self._storage
        key = step_dir(step)
        if key in getattr(self, "_damaged_dirs", ()):
            # This run's resume found it damaged; its quarantine mark may not have been written (a read-only
            # or failing store): mark it now, so prepare replaces it — never report it as committed.
            from ..storage.commit import quarantine_dir  # noqa: PLC0415

            try:
                quarantine_dir(storage, key, "found damaged by this run's resume", "", "save")
            except Exception as exc:  # noqa: BLE001 - checked right below
                self._log.warning("cannot mark a damaged checkpoint before saving the same step", dir=key,
                                  error=f"{type(exc).__name__}: {exc}")
        status = prepare_status(storage, step)
        if status[0] == "already" and key in getattr(self, "_damaged_dirs", ()):
            return ("error", f"{self._storage.uri}/{key} holds a checkpoint this run found damaged and it cannot "
                             "be set aside (quarantine mark not written): delete or restore it "
                             "(`spotguard checkpoints --verify URI`), then run again")
        if status[0] != "already" or key == self._resumed_dir:
            return status
        try:
            rec = CommitRecord.from_json(storage.read_bytes(join_key(key, COMMIT_NAME)))
            theirs = rec.extra.get("lineage")
        except Exception as exc:  # noqa: BLE001 - reported to every rank
            return ("error", f"{key} is committed but its record cannot be read: {type(exc).__name__}: {exc}")
        if theirs == self._lineage:
            return status
        return ("error", f"{self._storage.uri}/{key} is already committed by another run (lineage {theirs}) that "
                         "this run never resumed from; call hook.resume() before training, or give this run its "
                         "own storage prefix")

    def _finish_ok(self, notice: Notice, step: int, uri: str, nbytes: int, t0: float, already: bool = False) -> _Result:
        secs = round(time.monotonic() - t0, 3)
        self._last_save_seconds = secs  # what the next save's wait for the end of an iteration leaves room for
        self._committed_ids.add(notice.id)
        if self._periodic is not None:
            self._periodic.restart_clock()
        past = late_by(notice, getattr(self, "_late_deadline", None))
        writers, self._writers = (None if already else getattr(self, "_writers", None)), None
        self._log.info(ev.CHECKPOINT_COMMITTED, notice_id=notice.id, step=step, uri=uri, bytes=nbytes,
                       seconds=secs, already_committed=already, late=past > 0, **self._timing(notice),
                       **({"writers": writers} if writers else {}))
        if past > 0:
            self._log.warning(ev.CHECKPOINT_LATE, notice_id=notice.id, step=step, seconds_past=round(past, 3),
                              source=notice.source,
                              why="committed after the notice's deadline: on a real VM it would have been gone "
                                  "before this commit; the checkpoint is kept (it is valid if the VM lived)",
                              fix="a shorter iteration or save, or a loop the hook can act in at any moment "
                                  "(docs/api.md, the per-pattern table)")
        if notice.source == "drill":
            self._log.info(ev.DRILL_VERDICT, notice_id=notice.id, **drill_verdict(notice))
        mark = getattr(self, "_safe", None)
        own = mark.info() if mark is not None and not already else {}
        self._report(CheckpointDone(id=notice.id, step=step, uri=uri, bytes=nbytes, seconds=secs,
                                    late=past > 0, seconds_past=round(max(0.0, past), 3),
                                    rank_bytes=int(own.get("bytes") or 0), doomed=bool(own.get("doomed")),
                                    safe_seconds=float(own.get("seconds") or 0.0),
                                    evacuated_bytes=int(own.get("evacuated_bytes") or 0),
                                    evacuated_to=int(own.get("evacuated_to", -1))))
        self._after_commit(notice, step, uri)
        return _Result(committed=True, uri=uri, bytes=nbytes, seconds=secs, late_seconds=max(0.0, past))

    def _after_commit(self, notice: Notice, step: int, uri: str) -> None:
        """Every rank, right after the commit barrier: tell the framework (Ray Train). Must not raise."""
        if "ray.train" in sys.modules:  # inside a Ray Train worker: report the committed checkpoint
            from .adapters.ray import report_commit  # noqa: PLC0415

            report_commit(self, step, uri)

    def _fail(self, notice: Notice, step: int, error: str, t0: float, *, peers_ok: bool) -> _Result:
        secs = round(time.monotonic() - t0, 3)
        self._log.error(ev.CHECKPOINT_FAILED, notice_id=notice.id, step=step, error=error, seconds=secs,
                        peers_ok=peers_ok)
        self._report(CheckpointFailed(id=notice.id, error=error))
        return _Result(committed=False, peers_ok=peers_ok, error=error, seconds=secs)

    def _rank_key(self, rank: int) -> str:
        return elastic.rank_key(rank)

    def _write(self, key: str, snap: Optional[Snapshot]) -> None:
        """Write this rank's part of the checkpoint under folder ``key`` (every rank; raise on failure).

        The plain hook writes one DCP checkpoint; framework adapters override this
        to let their trainer write its own format. Durability and the commit
        record are ``_save``'s job.
        """
        self._dcp_save(self._save_state_dict(snap), key, self._group, None)

    def _dcp_save(self, sd: dict[str, Any], key: str, group: Any, cancel: Any) -> None:
        """``dcp.save`` of ``sd`` under ``key`` on ``group``. A save handed to the survivors (``handoff.py``)
        whose state nothing shards (DDP: every item replicated, ``Handoff.replicated_only``): a doomed rank
        writes its per-rank state only, durable on return, and the survivors run ``dcp.save`` on their own
        group — the doomed ranks have no other bytes DCP would give them, and waiting in its collectives made
        them wait for the survivors' writes."""
        import torch.distributed.checkpoint as dcp  # noqa: PLC0415

        split, own = getattr(self, "_split", None), self._rank_key(self._rank)
        mark = getattr(self, "_safe", None)
        # (every rank takes replicated_only's all-reduce: $SPOTGUARD_SURVIVORS_PLAN is read per process, and a rank
        # that skipped it would meet the others' all-reduce with dcp.save's gather)
        if split is not None and mark is not None and split.replicated_only(sd, own, off=not plan_around_doomed()):
            mark.evac = self._evac = None  # nothing unique to evacuate; the survivors write as they would
            mark.planned = "survivors"
            if split.is_doomed:
                split.write_own(self._storage, key, sd, own)
                mark.mark()
                return
            split.survivors_first()
            writer, group, planner = split.survivors_writer(self._dcp_storage_writer(key)), split.sgroup, \
                _planner(cancel, None)
        else:
            writer, planner = self._dcp_storage_writer(key), self._save_planner(cancel)
        with warnings.catch_warnings():  # a single process: DCP's "assuming a single process" note
            warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
            dcp.save(sd, storage_writer=writer, process_group=group, planner=planner)

    def _doomed_now(self, group: Any) -> "Optional[frozenset[int]]":
        """Every rank, right before the write: when the round doomed some ranks only, ask again (a notice that
        came after its gather dooms its rank too: ``with_late_notices``); otherwise the round's answer."""
        agreed = getattr(self, "_doomed", None)
        if not agreed or not self._dist:  # the same on every rank (from the round's gather); not a per-rank env
            return agreed
        got: list[Any] = [None] * dist.get_world_size(group)
        dist.all_gather_object(got, self._doomed_here(), group=group)
        return with_late_notices(agreed, got)

    def _evacuation(self, group: Any, doomed: "Optional[frozenset[int]]", key: str, t_store: float,
                    notice: Notice, step: int, deferred: bool = False) -> Any:
        """This rank's role in evacuating the doomed ranks' unique shards to survivors (``evacuate.py``), or
        None: a single process, no rank or every rank doomed (today's path). ``SPOTGUARD_EVACUATE=never`` still
        has a role: the knob is read per process, and a survivor whose env differs waits for its doomed rank's
        first message (``never``: "I write myself", 8 bytes) — without it the survivor timed out the save."""
        if not doomed or not self._dist:
            return None
        from .evacuate import Evacuation  # noqa: PLC0415

        return Evacuation.for_save(group, doomed, self._storage, key, t_store, getattr(self, "_write_rate", None),
                                   self._log, {"notice_id": notice.id, "step": step}, deferred)

    def _note_write_rate(self, nbytes: int, seconds: float) -> None:
        """This rank's measured write throughput (bytes/s), from a write big enough to tell: what a later
        doomed save predicts its direct write with (``evacuate.Evacuation.decide``)."""
        evac = getattr(self, "_evac", None)
        if nbytes >= 1 << 20 and seconds > 0 and not (evac is not None and evac.sent):
            self._write_rate = nbytes / seconds

    def _save_planner(self, cancel: Any) -> Any:
        """``_planner`` for this save's doomed ranks; the commit record's ``plan`` says whether it was used."""
        planner = _planner(cancel, getattr(self, "_doomed", None))
        mark = getattr(self, "_safe", None)
        if mark is not None and getattr(planner, "doomed", None):
            mark.planned = "survivors"
        return planner

    def _dcp_storage_writer(self, key: str) -> Any:
        """The storage's DCP writer for ``key``, marking this rank safe when its own bytes are durable."""
        writer = self._storage.dcp_writer(key)
        evac = getattr(self, "_evac", None)
        if evac is not None and evac.key == key:  # a doomed rank evacuates, its survivor also receives
            writer = evac.wrap(writer)
        mark = getattr(self, "_safe", None)
        return mark.wrap(writer) if mark is not None and mark.key == key else writer

    def _save_state_dict(self, snap: Optional[Snapshot]) -> dict[str, Any]:
        if snap is None:
            snap = Snapshot.take(self._objs.loaders)
        sd = self._tensor_state()
        sd[self._rank_key(self._rank)] = pack(self._per_rank_state(self._count, snap))
        return sd

    def _per_rank_state(self, step: int, snap: Snapshot) -> dict[str, Any]:
        """This rank's own state at ``step`` (the per-rank blob's contents): RNG, loader and running-stat
        buffers from ``snap``; schedulers, scalers and stateful objects as they are now."""
        o = self._objs
        return {
            "step": step,
            "world_size": self._world,
            "rng": snap.rng,
            "loaders": snap.loaders,
            "buffers": self._end_buffers(step),
            "schedulers": {k: s.state_dict() for k, s in o.schedulers.items()},
            "scalers": {k: s.state_dict() for k, s in o.scalers.items()},
            "stateful": {k: s.state_dict() for k, s in o.stateful.items()},
            # the torch RNG at the first training forward after ``step`` (when it already ran): resume sets
            # it back there if something drew in between that the uninterrupted run did not (core._realign_rng)
            "rng_at_forward": self._fwd_rng[1] if self._fwd_rng is not None and self._fwd_rng[0] == step else None,
        }

    def _end_buffers(self, step: int) -> dict[str, dict[str, torch.Tensor]]:
        """The tracked buffers at the end of iteration ``step``: after the loop's post-step updates (an
        ``AveragedModel``'s ``n_averaged``), before the next forward's (BatchNorm statistics, spectral norm's
        ``_u``/``_v``) — the copy the first forward after the step took, or, when no forward ran since the last
        optimizer step, the buffers as they are now."""
        got = self._fwd_bufs
        if got is not None and got[0] == step and self._fwd_seq == self._post_seq:
            return got[1]
        return clone_buffers(self._buffers)

    def _periodic_flags(self) -> tuple[int, int]:
        p = self._periodic
        if p is None or self._torn_down or self._closed:
            return 0, 0
        return p.flags()

    def _periodic_due(self) -> bool:
        """The boundary reduction just collected agreed on a periodic save (every rank sees the same flags)."""
        if self._periodic is None or self._torn_down or self._closed:
            return False
        due, busy = self._agree.flags[:2]
        return bool(due) and not busy

    def _maybe_periodic(self, snap: Optional[Snapshot]) -> None:
        """At a boundary with no notice: start the agreed periodic save."""
        p = self._periodic
        if p is None or not self._periodic_due():
            return
        self._internal = True
        try:
            t0 = time.monotonic()
            state, nbytes = stage_state_dict(self._save_state_dict(snap))
            p.start(self._count, state, nbytes, time.monotonic() - t0)
        finally:
            self._internal = False

    def _settle_periodic(self, notice: Notice, group: Any = _OWN) -> None:
        """A notice-driven save is about to start (every rank): finish or abort an in-flight periodic one.

        Rule (decided on rank 0, broadcast): finish it if its own throughput says it
        ends within half of the time left (cut off at that half whatever happens),
        else abort it; the notice's checkpoint is written next either way.
        """
        p = self._periodic
        if p is None:
            return
        left = max(0.0, notice.seconds_left() - SAVE_MARGIN)
        decision = p.decide(self._count, left) if self._rank == 0 else None
        what, est = self._bcast0(decision, group)
        if what == "idle" and not p.busy:
            return
        committed, waited = p.settle(what, left)
        self._log.info(PERIODIC_SETTLED, notice_id=notice.id, step=p.job.step if p.job else None, decision=what,
                       estimate=None if est is None else round(est, 3), seconds_left=round(left, 3),
                       waited=round(waited, 3), committed=committed)

    # ------------------------------------------------- background (staged) save

    def _save_staged(self, notice: Notice, reason: str, step: int, t_end: float, group: Any, *,
                     hold: bool = False) -> _Result:
        """The agreement thread: checkpoint of completed iteration ``step`` while training goes on. Never raises.

        1. wait until this rank's count is ``step`` and its training thread is not
           inside ``optimizer.step``; 2. read model and optimizer tensors in the
           background, but only while ``StateWatch`` proves nothing wrote them since
           step ``step`` (watch.py) — otherwise, or for FSDP2, the exact fallback: the
           training thread reads them at its next ``optimizer.step()`` pre-hook, where
           the loop's post-step work is over; 3. the small state (``_small_state``);
           4. DCP save + commit on ``group``. An emergency (``hold``) writes straight
           from the live tensors (no second copy on the host: the training thread
           stays held at its next step until the exit) and checks the watch again
           before the commit; a failed or invalidated attempt is retried once from
           the fallback read. An ordinary checkpoint copies (``stage_state_dict``),
           checks the watch after the copy, and releases the training thread.
        """
        t0 = time.monotonic()
        reached = self._steps.wait_reached(step, t_end,
                                           lambda: self._exit_request is not None or self._handing_over(step))
        if self._handing_over(step):
            return _Result(committed=False, peers_ok=True, error=HANDED_OVER)
        if not reached:
            return self._fail(notice, step, f"the training thread did not reach step {step} within the notice "
                              f"deadline (at {self._count}, inside a step: {self._in_step}): peers lost?", t0,
                              peers_ok=False)
        # The small state first: its anchor (the model's next forward, the next step, the end of training) is
        # also where the loop's post-step writes to tensors are over (an AveragedModel update, an EMA swapped
        # back); reading the tensors before it could commit them without those writes.
        small = self._small_state(step, t_end)
        if isinstance(small, str) and self._handing_over(step):
            return _Result(committed=False, peers_ok=True, error=HANDED_OVER)
        if isinstance(small, str):
            self._release_hold(keep_target=hold)
            return self._fail(notice, step, small, t0, peers_ok=True)
        live = hold
        got = self._background_read(step, copy=not live)
        if not self._all_ok(not isinstance(got, str), group):  # every rank takes the same branch
            why = got if isinstance(got, str) else "another rank could not prove its live state is step's"
            return self._save_next_iteration(notice, reason, step, t_end, group, hold=hold, why=why, t0=t0)
        return self._write_staged(notice, reason, step, t_end, group, got, small, hold=hold, live=live, t0=t0)

    def _write_staged(self, notice: Notice, reason: str, step: int, t_end: float, group: Any, got: Any,
                      small: Any, *, hold: bool, live: bool, t0: float, retry: bool = True,
                      keep_step: bool = False) -> _Result:
        """The staged save's second half: the tensors ``got`` and the small state of ``step`` -> DCP save ->
        commit; an emergency written from live tensors that moved meanwhile is retried once, from the end of
        the next iteration."""
        sd, nbytes, where_read = got
        blob, groups, where = small
        copied = time.monotonic() - t0
        self._live_moved = None
        with self._cv:
            self._staged_step = step
            self._steps.unhold(keep_target=hold)
            self._want_small = self._want_state = None
            self._cv.notify_all()
        self._log.info(ev.CHECKPOINT_STAGED, notice_id=notice.id, step=step, bytes=nbytes,
                       seconds=round(copied, 4), small_state_from=where, tensors_from=where_read,
                       host_copy=not hold)  # an emergency writes the held live tensors: no second copy
        sd = _with_small(sd, groups, self._rank_key(self._rank), blob)
        cancel = None if hold else self._ordinary_cancel  # an emergency arriving now pre-empts this save
        if cancel is not None:
            bg = self._bg
            if bg is not None:
                cancel = _StoreCancel(cancel, bg)
        result = self._save(notice, reason, None, group=group, step=step,
                            write=self._dcp_writer(sd, group, live, cancel), bound=max(1.0, t_end - time.monotonic()))
        if result.committed or not result.peers_ok or not hold or not retry or time.monotonic() >= t_end - 1.0:
            if not retry and not keep_step:  # the exact fallback's step, not the agreed one
                result.step = step
            return result  # (an ordinary checkpoint is not retried: every rank must take the same branch)
        # Every rank sees the same failed result (``_save``'s all-OK reduction): every rank retries, once. The
        # live state moved on some rank (what was there at ``step`` is gone): from the end of the next iteration.
        # Any other failure (storage, a step folder another run committed): the same step, if still provable —
        # a failure that the next step would only dodge (another run's folder) must not become a commit.
        moved = isinstance(getattr(self, "_live_moved", None), str)
        if not self._all_ok(not moved, group):
            return self._save_next_iteration(notice, reason, step, t_end, group, hold=hold, t0=t0,
                                             why=f"{result.error} (second attempt)")
        got = self._background_read(step, copy=False)
        if not self._all_ok(not isinstance(got, str), group):
            return result
        return self._write_staged(notice, reason, step, t_end, group, got, small, hold=hold, live=True, t0=t0,
                                  retry=False, keep_step=True)

    def _save_next_iteration(self, notice: Notice, reason: str, step: int, t_end: float, group: Any, *,
                             hold: bool, why: str, t0: float) -> _Result:
        """The exact fallback. The live tensors may not be those of ``step`` any more — a write the watch saw
        since that iteration's end: an EMA swapped in, a momentum encoder updated inside the forward, SAM's
        perturbation, ``p.data`` scaled by hand before the step — and what they were is gone (no copy is
        kept). So the checkpoint stands for the next iteration's end instead: the training thread reads the
        state at its first training forward after step ``step + 1`` (held there for an emergency), the one
        point where an iteration's end is known, whatever the loop writes inside its iterations. Every rank
        comes here together (the caller's reduction). Costs up to one iteration."""
        nxt = step + 1
        self._log.info(ev.CHECKPOINT_FALLBACK, notice_id=notice.id, step=step, reason=why,
                       waits_for=f"the end of the next iteration (its first training forward after step {nxt}): "
                                 f"the checkpoint stands for step {nxt}")
        with self._cv:  # armed together: the training thread must find the request at its very next anchor
            self._steps.freeze = None
            self._steps.target = nxt  # the training thread steps once more, then is held (an emergency) or read
            self._small = None
            self._want_small = None
            self._arm_read(nxt, copy=not hold)
        got = self._prehook_read(nxt, t_end, copy=not hold, armed=True)
        if isinstance(got, str) and self._handing_over(nxt):
            return _Result(committed=False, peers_ok=True, error=HANDED_OVER)
        if isinstance(got, str):
            self._release_hold(keep_target=hold)
            return self._fail(notice, nxt, got, t0, peers_ok=True)
        sd, nbytes, where_read, at = got  # at: nxt, or step when training ended there (its work is over)
        small = self._small_state(at, t_end)
        if isinstance(small, str):
            self._release_hold(keep_target=hold)
            return self._fail(notice, at, small, t0, peers_ok=True)
        return self._write_staged(notice, reason, at, t_end, group, (sd, nbytes, where_read), small, hold=hold,
                                  live=False, t0=t0, retry=False)

    def _dcp_writer(self, sd: dict[str, Any], group: Any, validate: bool,
                    cancel: Any = None) -> Callable[[str], None]:
        def write(key: str) -> None:
            self._dcp_save(sd, key, group, cancel)
            if validate:  # written from live tensors: still the state of S at the end of the write?
                why = self._watch.changed(getattr(self, "_live_mark", None))
                self._live_moved = why
                if why is not None:
                    raise StateMoved(f"the state moved while it was written from live tensors: {why}")
        return write

    def _handing_over(self, step: int) -> bool:
        """An explicit loop left the any-moment path before ``step`` was proven to end an iteration: the
        round hands its notice to the loop's boundary path instead of failing it."""
        return self._range_broken is not None and getattr(self, "_confirmed", None) != step

    def _background_read(self, step: int, *, copy: bool) -> Any:
        """(state dict, bytes, "background") read off the training thread, or why it cannot be proven exact."""
        mark = self._watch.current()  # every check of this read is against the mark it started from
        why = self._watch.changed(mark)
        if why is not None:
            return why
        ev_ = self._step_event
        if ev_ is not None:
            ev_.synchronize()  # CUDA: step S's kernels (recorded on the training stream) are done
        _BG.on = True
        try:
            _skip_fake_step_in_background()
            sd = self._tensor_state() if self._watch.sharded is None else self._sharded_tensor_state()
            sd, nbytes = stage_state_dict(sd) if copy else (sd, _tensor_bytes(sd))
        except Exception as exc:  # noqa: BLE001 - try the training thread's read instead
            return f"background read failed: {type(exc).__name__}: {exc}"
        finally:
            _BG.on = False
        if copy:
            why = self._watch.changed(mark)  # moved during the copy: it may be torn
            if why is not None:
                return why
        else:
            self._live_mark = mark  # the write from these live tensors is checked against it (_dcp_writer)
        return sd, nbytes, "background"

    def _prehook_read(self, step: int, t_end: float, *, copy: bool, armed: bool = False) -> Any:
        """Ask the training thread for the state dict of ``step``: read at its first training forward after
        that step (``_serve_anchor_read``), else at its next ``optimizer.step()`` pre-hook (held there; a loop whose
        forwards the hook does not see) or the end of training; (state dict, bytes, where, the step read) or why
        not. Bounded by ``t_end``."""
        with self._cv:
            if not armed:
                self._arm_read(step, copy=copy)
            while not self._handed(step) and self._exit_request is None and not self._handing_over(step):
                left = t_end - time.monotonic()
                if left <= 0:
                    break
                self._cv.wait(min(0.5, left))
            got, self._handoff, self._want_state = self._handoff, None, None
        if got is None or not self._handed(step, got):
            return (f"the training thread did not reach the end of iteration {step} (its next training forward "
                    "or optimizer.step()) within the notice deadline; that state could not be read exactly")
        if got[3]:
            return got[3]
        return got[1], got[2], got[4], got[0]

    def _arm_read(self, step: int, *, copy: bool) -> None:
        """(under ``_cv``) Ask the training thread to read the state of ``step`` where it next can."""
        self._handoff = None
        self._want_state = step
        self._want_copy = copy
        self._cv.notify_all()

    def _handed(self, step: int, got: Any = None) -> bool:
        """Whether the training thread's read answers a request for ``step``: that step, or the one before
        it read at the end of training (the iteration asked for will never come; the last one's work is over)."""
        got = self._handoff if got is None else got
        return got is not None and (got[0] == step or (got[0] == step - 1 and got[4] == "end-of-training"))

    def _read_for_round(self, step: int, where: str = "pre-hook") -> None:
        """Training thread, at the end of iteration ``step`` (under ``_cv``): the fallback read."""
        self._internal = True  # DCP's fake step() on a stateless optimizer must not count
        try:
            # FSDP2: from its sharded parameters, never through its state-dict hooks — they reshard parameters
            # its pre-forward has just unsharded (a read at the anchor forward would break that forward)
            sd = self._tensor_state() if self._watch.sharded is None else self._sharded_tensor_state()
            sd, nbytes = stage_state_dict(sd) if getattr(self, "_want_copy", True) else (sd, _tensor_bytes(sd))
            self._handoff = (step, sd, nbytes, "", where)
        except Exception as exc:  # noqa: BLE001 - reported by the round, never raised into the training loop
            self._handoff = (step, None, 0, f"reading the state at step {step}: {type(exc).__name__}: {exc}", where)
        finally:
            self._internal = False
        self._cv.notify_all()

    def _serve_anchor_read(self, step: int, where: str) -> Optional[int]:
        """Training thread, under ``_cv``, at the end of iteration ``step`` (its first training forward after
        the step, or an explicit loop's boundary): serve a read the round asked for (``_save_next_iteration``);
        an emergency's live tensors are written from where they are, so the thread stays here until the exit
        (bounded by the round's hold: past it, the step to give up at — ``_give_up_hold``, outside ``_cv``)."""
        if self._want_state != step or (self._handoff is not None and self._handoff[0] == step):
            return None
        self._read_for_round(step, where)
        if getattr(self, "_want_copy", True):
            return None
        while self._exit_request is None and self._target == step:
            left = self._steps.hold_left()
            if left <= 0:  # the write from these live tensors may still run: never train on under it
                return step
            self._cv.wait(min(0.5, left))
        return None

    def _small_state(self, step: int, t_end: float) -> Any:
        """(per-rank blob, param_groups, where) of ``step``, or why not.

        Read at the first moment the loop's work after ``optimizer.step()`` is known
        to be over: the model's next training forward (not an evaluation's: a
        ``ReduceLROnPlateau`` steps after it; the forward pre-hook copies it every
        iteration on the training thread, so a round that starts later still gets
        the state of that moment, not a meter updated since), the next step's
        pre-hook, or the end of training (``destroy_process_group()``). If none comes before the save must start to make the deadline
        (a data-loading stall right after the step longer than the notice), nothing
        is committed: the state of the end of the iteration is not known yet.
        """
        now = time.monotonic()  # wait for the anchor while the save still fits, and always a little
        latest = max(now + min(1.0, max(0.0, t_end - now) / 3),
                     t_end - max(0.5, getattr(self, "_last_save_seconds", 1.0) * 1.5))
        with self._cv:
            rs = self._range_small
            if (self._small is None or self._small[0] != step) and rs is not None and rs[0] == step:
                self._capture_small_for(step, "iteration-boundary")  # what the explicit loop's boundary copied
            if self._small is None or self._small[0] != step:
                if self._fwd_count == step and self._anchor_ok(step):
                    self._capture_small_for(step, "after-forward")
                else:
                    self._want_small = step
                    self._cv.notify_all()
                    while (self._small is None or self._small[0] != step) and \
                            not (self._fwd_count == step and self._anchor_ok(step)) and \
                            not self._handing_over(step) and self._exit_request is None and time.monotonic() < latest:
                        self._cv.wait(min(0.1, max(0.0, latest - time.monotonic())))
                    self._want_small = None
                    if (self._small is None or self._small[0] != step) and self._fwd_count == step and \
                            self._anchor_ok(step):
                        self._capture_small_for(step, "after-forward")
            got = self._small if self._small is not None and self._small[0] == step else None
            self._small = None
        if got is None:
            return (f"the loop's work after step {step} was not seen to end (no forward of the model and no "
                    "optimizer step since) before the save had to start to make the deadline: the state of the "
                    "end of that iteration is not known, nothing is committed")
        if got[1] is None:
            return got[3]
        return got[1], got[2], got[3]

    def _capture_small_for(self, step: int, where: str) -> None:
        """``_capture_small`` into ``_small`` (under ``_cv``); a raising ``state_dict()`` is recorded, not raised.
        An explicit loop's step: what its boundary read (the exact end of that iteration), whoever asks."""
        rs = getattr(self, "_range_small", None)
        if rs is not None and rs[0] == step:
            if rs[1] is None:  # its state_dict() raised at the boundary
                self._small = rs
            else:
                try:
                    self._small = (step, pack(rs[1]), rs[2], rs[3])
                except Exception as exc:  # noqa: BLE001 - recorded for the round, never raised into the loop
                    self._small = (step, None, None, f"packing the small state of step {step}: "  # type: ignore[assignment]
                                                     f"{type(exc).__name__}: {exc}")
            self._cv.notify_all()
            return
        try:
            self._small = self._capture_small(step, where)
        except Exception as exc:  # noqa: BLE001 - the user's object: the round fails with this, training goes on
            self._small = (step, None, None, f"state_dict() of the small state raised at step {step}: "  # type: ignore[assignment]
                                             f"{type(exc).__name__}: {exc}")
        self._cv.notify_all()

    def _sharded_tensor_state(self) -> dict[str, Any]:
        """FSDP2, off the training thread: what ``get_model_state_dict`` / ``get_optimizer_state_dict`` give
        (FQN -> sharded DTensor; optimizer state and groups by FQN), built from FSDP2's sharded parameters and
        ``Optimizer.state_dict()`` without running any module's state-dict hook (FSDP2's reshards)."""
        from torch.distributed.checkpoint.state_dict import _get_fqns  # noqa: PLC0415

        o, sharded = self._objs, self._watch.sharded
        assert sharded is not None
        sd: dict[str, Any] = {}
        for k, m in o.models.items():
            msd: dict[str, Any] = {fqn: p.detach() for fqn, p in sharded[k]}
            for name, b in self._watch._bufs.get(k, {}).items():
                fqns = _get_fqns(m, name)
                if len(fqns) != 1:
                    raise RuntimeError(f"buffer {name}: {len(fqns)} FQNs")
                msd[next(iter(fqns))] = b.detach()
            sd[k] = msd
        for k, opt in o.optimizers.items():
            fqn_of = {id(p): fqn for fqn, p in sharded[o.owner[k]]}
            params = [p for g in opt.param_groups for p in g["params"]]
            by_index = {i: fqn_of[id(p)] for i, p in enumerate(params)}  # KeyError: not an FSDP2 parameter
            osd = opt.state_dict()
            sd[k] = {"state": {by_index[i]: v for i, v in osd["state"].items()},
                     "param_groups": [{**g, "params": [by_index[i] for i in g["params"]]} for g in osd["param_groups"]]}
        return sd

    def _tensor_state(self) -> dict[str, Any]:
        """Model and optimizer state dicts, by model / optimizer name (references: a background save stages
        them, after ``_skip_fake_step_in_background``)."""
        from torch.distributed.checkpoint.state_dict import (  # noqa: PLC0415
            get_model_state_dict,
            get_optimizer_state_dict,
        )

        o = self._objs
        sd: dict[str, Any] = {}
        for k, m in o.models.items():
            sd[k] = get_model_state_dict(m)
        for k, opt in o.optimizers.items():
            sd[k] = get_optimizer_state_dict(o.models[o.owner[k]], opt)
        return sd

    def _capture_small(self, step: int, where: str) -> tuple[int, bytes, dict[str, list[dict[str, Any]]], str]:
        """(step, per-rank blob, optimizer param_groups without params, who captured it) — call under ``_cv``.

        The state the loop changes *after* ``optimizer.step()``: schedulers, scalers,
        stateful objects (EMA...), and the optimizer's param_groups (a scheduler writes
        ``lr`` there). RNG, loader and running-stat buffers come from the snapshot of
        step ``step``'s post-hook, as at a boundary.
        """
        o = self._objs
        snap = self._snap if self._snap is not None and self._snap_count == step else None
        if snap is None:
            snap = Snapshot.take(o.loaders)
        per = self._per_rank_state(step, snap)
        groups = self._groups_copy()
        anchor = getattr(self, "_anchor_copy", None)
        if anchor is not None and anchor[0] == step:  # what the iteration's anchor copied wins (a meter)
            per["stateful"].update(anchor[1])
            groups = anchor[2]
        return step, pack(per), groups, where

    def _groups_copy(self) -> dict[str, list[dict[str, Any]]]:
        """Every optimizer's ``param_groups`` as they are now, without ``params`` (a scheduler writes ``lr`` there)."""
        return {k: [{n: copy_state(v) for n, v in g.items() if n != "params"} for g in opt.param_groups]
                for k, opt in self._objs.optimizers.items()}

    def _copy_at_anchor(self, step: int) -> None:
        """Training thread, at each iteration's anchor (its first training forward): copy what the loop may
        still change before the next ``optimizer.step()`` — a running-loss meter, a samples-seen counter, the
        optimizer's ``param_groups`` — so that a round starting later in the iteration reads the state of the
        anchor, not a meter updated since. Only the small stateful objects (their state_dict holds at most
        ``ANCHOR_COPY_BYTES`` of tensors, decided at the first anchor): an EMA's shadow weights would cost a
        model copy per iteration, and it changes in the post-step work; schedulers change only in ``step()``
        and scalers only in ``update()``, so both are read when a round needs them."""
        o = self._objs
        try:
            small = getattr(self, "_anchor_small_keys", None)
            if small is None:
                small = self._anchor_small_keys = [k for k, obj in o.stateful.items()
                                                   if _tensor_bytes(obj.state_dict()) <= ANCHOR_COPY_BYTES]
            self._anchor_copy = (step, {k: copy_state(o.stateful[k].state_dict()) for k in small},
                                 self._groups_copy())
        except Exception:  # noqa: BLE001 - the user's object: a round reads it live and reports what raised
            self._anchor_copy = None

    def _copy_small(self, step: int, where: str) -> tuple[int, Any, Any, str]:
        """(step, per-rank state, param_groups, where) as ``_capture_small`` reads them, copied instead of
        packed (an explicit loop's boundary: every iteration); (step, None, None, why) if a state_dict() raised."""
        import copy  # noqa: PLC0415

        o = self._objs
        try:
            snap = self._snap if self._snap is not None and self._snap_count == step else \
                Snapshot.take(o.loaders)
            per = self._per_rank_state(step, snap)
            for k in ("schedulers", "scalers", "stateful"):  # state_dict() may hand out live containers
                per[k] = copy.deepcopy(per[k])
            groups = self._groups_copy()
        except Exception as exc:  # noqa: BLE001 - the user's object: a round for this step fails with it
            return step, None, None, (f"state_dict() of the small state raised at step {step}: "
                                      f"{type(exc).__name__}: {exc}")
        return step, per, groups, where

    def _release_hold(self, keep_target: bool = False) -> None:
        """Let the training thread step again (``keep_target``: an emergency keeps it held until the exit)."""
        with self._cv:
            self._steps.unhold(keep_target)
            self._small = None
            self._want_small = self._want_state = None
            self._cv.notify_all()


class Cancelled(Exception):
    """An ordinary checkpoint given up for an emergency that arrived while it was written."""


class _StoreCancel:
    """This rank's cancel flag, or any rank's (the round's cancel key in the c10d store, asked every 20 ms)."""

    def __init__(self, local: threading.Event, bg: Any) -> None:
        self._local, self._bg, self._next = local, bg, 0.0

    def is_set(self) -> bool:
        if self._local.is_set():
            return True
        now = time.monotonic()
        if now >= self._next:
            self._next = now + 0.02
            if self._bg.round_cancelled():
                self._local.set()
                return True
        return False


def _planner(cancel: Any, doomed: "Optional[frozenset[int]]") -> Any:
    """The save's DCP planner: the stock one (None) unless the save can be cancelled (a check per write item)
    or some ranks are doomed (replicated items written by the survivors only: ``storage/survivors.py``)."""
    if not plan_around_doomed():
        doomed = None
    if cancel is None and not doomed:
        return None
    from ..storage.survivors import SurvivorsPlanner  # noqa: PLC0415

    def check() -> None:
        if cancel is not None and cancel.is_set():
            raise Cancelled("ordinary checkpoint given up: an emergency notice arrived while it was written")

    return SurvivorsPlanner(doomed, check)


class StateMoved(Exception):
    """A write from live tensors that the watch no longer vouches for (the attempt must not commit)."""


def _tensor_bytes(sd: Any) -> int:
    if isinstance(sd, torch.Tensor):
        return sd.numel() * sd.element_size()
    if isinstance(sd, dict):
        return sum(_tensor_bytes(v) for v in sd.values())
    if isinstance(sd, (list, tuple)):
        return sum(_tensor_bytes(v) for v in sd)
    return 0


def _with_small(sd: dict[str, Any], groups: dict[str, list[dict[str, Any]]], rank_key: str, blob: bytes
                ) -> dict[str, Any]:
    """The state dict with param_groups (lr...) as they stood after the loop's scheduler step, and the
    per-rank blob; shallow copies, so a live state dict's optimizer groups are never written."""
    out = dict(sd)
    for k, pg in groups.items():
        osd = out.get(k)
        staged = osd.get("param_groups") if isinstance(osd, dict) else None
        if isinstance(staged, list) and len(staged) == len(pg):
            out[k] = {**osd, "param_groups": [{**dst, **src} for dst, src in zip(staged, pg)]}
    out[rank_key] = blob
    return out
