"""The checkpoint write: DCP save -> every byte durable -> rank 0 commits -> commit barrier.

Used by emergency, ordinary (rebalance/maintenance) and adapter checkpoints;
periodic background saves (``periodic.py``) follow the same protocol on their
own group. ``_save`` never raises: a failure is reported (``checkpoint_failed``)
and the previous commit stays the newest.

The staged save beside training is ``staged.py`` and what it writes, the state
at S, ``stateat.py`` (issue 28: split along those seams); both are bases of
``SaveMixin``, and the names other modules import from here (``_Result``,
``_BG``, ``ANCHOR_COPY_BYTES``, ``_tensor_bytes``) are re-exported.
"""

from __future__ import annotations

import contextlib
import sys
import time
import warnings
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
from .settings import EMERGENCY_LEAD, PERIODIC_NOTICE_PREFIX, SAVE_MARGIN
from .outcome import _OWN, _Result
from .staged import StagedSaveMixin
from .state import Snapshot
from .stateat import (  # noqa: F401 - re-exported: adapters, torchft and core import them from here
    _BG,
    ANCHOR_COPY_BYTES,
    StateAtMixin,
    StateMoved,
    _skip_fake_step_in_background,
    _tensor_bytes,
    _with_small,
)

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


class SaveMixin(StagedSaveMixin, StateAtMixin):
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
        step = self._steps.count if step is None else step
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

class Cancelled(Exception):
    """An ordinary checkpoint given up for an emergency that arrived while it was written."""


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
