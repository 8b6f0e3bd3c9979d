"""The plain-PyTorch hook: notice -> agreed step -> committed DCP checkpoint -> clean exit.

Shape of one iteration with no loop change (see docs/api.md)::

    fwd/bwd ... [pre-hook: BOUNDARY] opt.step() [post-hook: DECIDE] sched.step() ...

- DECIDE (post-hook of the clock optimizer, or ``GradScaler.update()`` when a
  scaler is in the dict, because the scaler skips ``step()`` on inf/nan): count
  the iteration, snapshot RNG / loader / running-stat buffers (they move on
  before the next step), launch a non-blocking MAX all-reduce of the local
  flag on the hook's own gloo group.
- BOUNDARY (pre-hook of the clock's next step): wait that reduction (finished
  long ago) and, if any rank asked, write the checkpoint standing for the end
  of the deciding iteration: model/optimizer/scheduler as they are now (the
  scheduler has stepped), RNG/loader/buffers from the snapshot.

The clock is the first optimizer that steps (learned at run time), so a GAN's
two optimizers work whatever their order in the dict. ``hook.range(total)`` and
``hook.step()`` replace the optimizer hooks by an explicit boundary.

Levels carried by the flag (MAX wins): 0 nothing, 1 ordinary checkpoint
(rebalance/maintenance notice), 2 emergency (preemption/termination, SIGTERM,
SIGUSR1), 3 a notice whose id is already in the newest committed checkpoint
(a daemon replay after restart: exit without training or saving again).

After ``dist.destroy_process_group()`` no collective is possible: a notice that
arrives then (or after the last step) is logged as ``notice_after_last_step``
and the process keeps its own exit code (0 for a finished job). The hook wraps
``destroy_process_group`` (once per process) so that it first waits, bounded,
for the flag reduction launched at the last iteration's end and for a periodic
upload, then drops its own gloo groups: tearing groups down under in-flight
gloo work could abort a rank ("terminate called without an active exception").

Failed saves: DCP reports write errors as ``CheckpointException``, a
``BaseException``; ``_save`` catches it (re-raising only KeyboardInterrupt and
SystemExit), reports ``checkpoint_failed`` and leaves the previous commit alone.
Storage requests of a notice-driven save run inside
``storage.deadline_at(deadline - SAVE_MARGIN)`` (see ``SAVE_MARGIN``).

Periodic checkpoints (``every`` seconds; ``spotguard.hook.periodic``): the flag
reduction also carries (due, busy) votes; when some rank says due and none says
busy, every rank stages a CPU copy of the state at the boundary and uploads it
on a background thread over a dedicated gloo group, committed with reason
``periodic``. A notice during such an upload: finish it if its own throughput
says it ends within half the time left (cut off there), else abort it; then the
notice's checkpoint is written (docs/storage.md).
"""

from __future__ import annotations

import atexit
import builtins
import contextlib
import gc
import os
import signal
import socket as _socket
import sys
import threading
import time
import uuid
import warnings
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable, Iterator, Mapping, NoReturn, Optional

import torch
import torch.distributed as dist

from .. import __version__
from ..logs import get_logger
from ..notice import Notice
from ..protocol import CheckpointDone, CheckpointFailed, CheckpointStarted
from ..storage import Storage, StorageError, open_storage
from ..storage.base import join_key
from ..storage.commit import (
    COMMIT_NAME,
    CommitRecord,
    commit_and_retain,
    newest_committed,
    prepare_status,
    step_dir,
)
from ..timefmt import to_rfc3339, utcnow
from . import events as ev
from .dist import (
    gather_writes,
    NO_DEADLINE_MS,
    Agreement,
    group_alive,
    is_dist,
    make_group,
    run_bounded,
    set_group_timeout,
    teardown,
)
from ..storage.integrity import DamagedCheckpoint, damage_in  # noqa: I001
from ..storage.safeload import SafeLoadPlanner
from . import elastic
from .state import Objects, Snapshot, classify, pack, tracked_buffers, unpack
from .dist import destroy_group, guard_destroy, unguard_destroy
from .periodic import PERIODIC_SETTLED, PeriodicSaver, stage_state_dict
from .preflight import check_launcher, probe_writable, unwritable_message
from .peers import stop_watch, watch_peers  # [i14b] peer-liveness watch

__all__ = ["Hook", "Preempted", "SIGNAL_GRACE", "EMERGENCY_LEAD", "EXIT_SAVE_FAILED"]

# Storage requests of a notice-driven save stop this long before the notice deadline (at most half
# of what is left): the bounded teardown (barrier + destroy, ~0.1 s), the exit (~0.15 s with
# gc.freeze) and the report to the daemon must still fit before the VM goes.
SAVE_MARGIN = 1.5
# Before the user's destroy_process_group() / at exit: how long to wait for the outstanding flag
# reduction (finished long ago unless a peer is gone) and for an in-flight periodic upload.
QUIESCE_AGREEMENT_TIMEOUT = 10.0


def _env_seconds(name: str, default: float) -> float:
    """A positive number of seconds from the environment; a bad value warns and falls back."""
    raw = os.environ.get(name, "")
    try:
        value = float(raw) if raw.strip() else default
        if not (0 < value < float("inf")):
            raise ValueError("must be a positive, finite number of seconds")
    except ValueError as exc:
        warnings.warn(f"{name}={raw!r} ignored ({exc}); using {default:g} s", stacklevel=2)
        return default
    return value


QUIESCE_PERIODIC_TIMEOUT = _env_seconds("SPOTGUARD_PERIODIC_DRAIN", 60.0)
# What a SIGTERM leaves us before the SIGKILL: torchrun's default --shutdown-timeout (30 s); set it
# per platform (GKE pods: 15 s of the node's 30 s; a pod's terminationGracePeriodSeconds; SLURM GraceTime).
SIGNAL_GRACE = _env_seconds("SPOTGUARD_SIGNAL_GRACE", 30.0)
# An emergency notice further off than this (GCP GPU host maintenance: about an hour; Azure Terminate:
# 5-15 min) does not stop training at once: the emergency checkpoint starts this long before the
# deadline, so it commits before the window opens with a safety margin.
EMERGENCY_LEAD = _env_seconds("SPOTGUARD_EMERGENCY_LEAD", 300.0)
# Framework adapters take ``every=`` checkpoints synchronously, in the framework's own format, through the
# notice path with a synthetic notice: its id prefix keeps it out of daemon reports and commit records.
PERIODIC_NOTICE_PREFIX = "periodic-"
PERIODIC_SYNC_TIMEOUT = 600.0


def periodic_notice(step: int) -> Notice:
    """The synthetic notice an adapter's ``every=`` checkpoint is written under (never sent anywhere)."""
    now = utcnow()
    return Notice(id=f"{PERIODIC_NOTICE_PREFIX}{step}", source="signal", kind="maintenance",
                  deadline=now + timedelta(seconds=PERIODIC_SYNC_TIMEOUT), received_at=now,
                  detail="every= safety-net checkpoint")


#: exit code when the emergency save failed (nothing committed for this stop: progress since the last
#: commit is lost). EX_TEMPFAIL from sysexits.h: "try again later" — launchers restart on it like on 143,
#: and it tells the user apart from 143 ("stopped for a notice, nothing lost").
EXIT_SAVE_FAILED = 75
LEVEL_NONE, LEVEL_CHECKPOINT, LEVEL_EMERGENCY, LEVEL_REPLAY = 0, 1, 2, 3
_ACTIONS = {0: "none", 1: "checkpoint", 2: "emergency", 3: "exit"}


class Preempted(SystemExit):
    """Raised after the emergency checkpoint (or its failure): the process should exit so the launcher restarts it."""

    def __init__(self, code: int = 143, *, notice_id: str | None = None, step: int | None = None,
                 uri: str | None = None, committed: bool = False) -> None:
        super().__init__(code)
        self.notice_id = notice_id
        self.step = step
        self.uri = uri
        self.committed = committed


@dataclass
class _Result:
    committed: bool
    peers_ok: bool = True
    uri: str = ""
    bytes: int = 0
    seconds: float = 0.0
    error: str = ""


def _ms(dt: Any) -> int:
    return int(dt.timestamp() * 1000)


def _env_float(name: str) -> Optional[float]:
    raw = os.environ.get(name)
    try:
        return float(raw) if raw else None
    except ValueError:
        return None


class Hook:
    """Emergency checkpointing for a dict of stateful objects (see the module docstring)."""

    # A dict hook under a launcher must come after init_process_group; framework adapters
    # arm later, once their trainer has created the group.
    _launcher_check = True

    def __init__(
        self,
        state: Mapping[str, Any],
        storage: str | Storage | None = None,
        *,
        socket: str | None = None,
        keep: int | None = None,
        exit_code: int = 143,
        on_notice: Callable[[Notice], Any] | None = None,
        signals: bool = True,
        intake: bool = True,
        every: float | None = None,
        scope: Mapping[str, str] | None = None,
    ) -> None:
        if keep is not None and (isinstance(keep, bool) or not isinstance(keep, int) or keep < 1):
            raise ValueError(f"keep must be a positive integer or None, got {keep!r}")
        if isinstance(exit_code, bool) or not isinstance(exit_code, int) or not 0 <= exit_code <= 255:
            raise ValueError(f"exit_code must be an integer in 0..255, got {exit_code!r}")
        if every is not None and (isinstance(every, bool) or not isinstance(every, (int, float)) or not every > 0):
            raise ValueError(f"every must be a positive number of seconds or None, got {every!r}")
        if self._launcher_check:
            check_launcher(dist.is_available() and dist.is_initialized())
        self._objs: Objects = classify(state, scope)
        self._storage: Storage = storage if isinstance(storage, Storage) else open_storage(storage)
        self._keep = keep
        self._exit_code = exit_code
        self._on_notice_cb = on_notice
        self._dist = is_dist()
        self._rank = dist.get_rank() if self._dist else 0
        self._world = dist.get_world_size() if self._dist else 1
        self._local_rank = int(os.environ.get("LOCAL_RANK", "0") or 0)
        self._group = make_group() if self._dist else None
        self._agree = Agreement(self._group)
        self._log = get_logger("spotguard.hook", component="hook", rank=self._rank)
        if not getattr(self, "_probed", False):
            self._probe_storage()
        self._torn_down = False  # the user destroyed the process group (or the hook quiesced for exit)
        self._late: Optional[tuple[int, int]] = None  # the last flag reduction, settled at teardown
        # periodic safety-net checkpoints: their own gloo group, created here (collective, every rank)
        self._periodic: Optional[PeriodicSaver] = PeriodicSaver(self, float(every)) if every is not None else None
        if self._dist:
            guard_destroy(self._quiesce)
        # [i14b] peer-liveness watch: its own gloo group + thread (collective, every rank, right here)
        self._peers = watch_peers(self) if self._dist else None

        self._count = 0
        self._resumed = False
        self._resumed_step = 0
        self._resumed_dir: Optional[str] = None  # the committed folder this run's state came from
        # Which run wrote a checkpoint (COMMIT.json extra "lineage"): inherited on resume, so a second run
        # on the same storage that never resumed cannot pass another run's checkpoint off as its own.
        self._lineage = uuid.uuid4().hex
        self._fresh_checked = False
        self._explicit = False
        self._implicit_counted = False
        self._internal = False
        self._closed = False
        self._exiting = False
        self._snap: Optional[Snapshot] = None
        self._clock: Optional[torch.optim.Optimizer] = None
        self._buffers = {k: tracked_buffers(m) for k, m in self._objs.models.items()}
        self._buffers = {k: b for k, b in self._buffers.items() if b}
        self._scaler = next(iter(self._objs.scalers.values()), None)
        self._many_opts = len(self._objs.optimizers) > 1

        self._lock = threading.Lock()
        self._pending: dict[str, Notice] = {}
        self._seen: set[str] = set()
        self._committed_ids: set[str] = set()

        self._test_delay = _env_float("SPOTGUARD_TEST_SAVE_DELAY")
        delay_rank = os.environ.get("SPOTGUARD_TEST_SAVE_DELAY_RANK")
        if delay_rank not in (None, "") and int(delay_rank) != self._rank:
            self._test_delay = None

        self._handles: list[Any] = []
        self._scaler_orig: Optional[tuple[Any, Any]] = None
        self._install_step_hooks()
        self._prev_handlers: dict[int, Any] = {}
        if signals:
            self._install_signals()
        self._intake: Any = None
        self._socket = socket
        if intake:
            self._start_intake(socket)
        atexit.register(self._at_exit)
        self._log.info(
            ev.HOOK_INSTALLED, world_size=self._world, storage=self._storage.uri, pid=os.getpid(),
            objects=self._objs.roles(), socket=getattr(self._intake, "socket_path", None),
        )

    def _probe_storage(self) -> None:
        """Every rank writes and deletes a small object; any failure is one StorageError on every rank."""
        err = probe_writable(self._storage)
        if self._dist:
            allv: list[Any] = [None] * self._world
            dist.all_gather_object(allv, err, group=self._group)
        else:
            allv = [err]
        errors = [(r, e) for r, e in enumerate(allv) if e]
        if errors:
            raise StorageError(unwritable_message(self._storage.uri, errors))
        self._probed = True

    # ------------------------------------------------------------------ public

    @property
    def storage(self) -> Storage:
        return self._storage

    @property
    def iteration(self) -> int:
        """Completed iterations (the step a checkpoint taken now would resume from)."""
        return self._count

    def resume(self) -> int:
        """Load the newest committed checkpoint (all ranks call this); the step to continue from, 0 if none.

        Also the one place where ranks agree before training: if a notice is
        already active (e.g. the daemon replayed the one this checkpoint was
        written for), every rank exits at once with ``Preempted``.
        """
        if self._resumed:
            return self._resumed_step
        self._internal = True
        try:
            step, from_notice, dirkey, below, damaged, lineage = 0, None, None, None, [], None
            while True:  # the newest committed checkpoint that verifies; a damaged one is skipped
                found: Any = None
                if self._rank == 0:
                    try:
                        info = newest_committed(self._storage, below=below)
                        found = None if info is None else (
                            info.dir, info.step, info.record.notice_id if info.record else None,
                            info.record.checksums if info.record and info.record.checksums else None,
                            (info.record.extra.get("lineage") if info.record else None) or None)
                    except Exception as exc:  # noqa: BLE001 - shared with peers, then raised
                        found = ("error", f"{type(exc).__name__}: {exc}")
                found = self._bcast0(found)
                if isinstance(found, tuple) and found and found[0] == "error":
                    raise RuntimeError(f"spotguard: cannot list checkpoints in {self._storage.uri}: {found[1]}")
                if found is None:
                    if damaged:
                        raise RuntimeError(
                            f"spotguard: no committed checkpoint in {self._storage.uri} passed verification "
                            f"(damaged: {', '.join(damaged)}); restore them from a backup, or delete them to "
                            f"start from step 0")
                    step, from_notice, dirkey = 0, None, None
                    break
                dirkey, step, from_notice, digests, lineage = found
                t0 = time.monotonic()
                if digests is None:
                    self._log.warning("commit record has no checksums (older spotguard): loading unverified",
                                      dir=dirkey)
                problem = self._load(dirkey, digests)
                if problem is None:
                    break
                self._log.error("skipping damaged checkpoint", dir=dirkey, step=step, file=problem.where,
                                problem=problem.what)
                damaged.append(dirkey)
                below = step
            if dirkey is not None:
                self._resumed_dir = dirkey
                if isinstance(lineage, str):
                    self._lineage = lineage  # this run continues the lineage it resumed from
                if from_notice:
                    self._committed_ids.add(from_notice)
                self._log.info(ev.RESUMED, step=step, uri=f"{self._storage.uri}/{dirkey}",
                               from_notice_id=from_notice, seconds=round(time.monotonic() - t0, 3))
            else:
                self._log.info(ev.RESUMED, step=0, uri=None, from_notice_id=None, seconds=0.0)
        finally:
            self._internal = False
        self._count = self._resumed_step = step
        self._resumed = True
        self._fresh_checked = True
        self._agree_at_start()
        return step

    def range(self, total: int) -> Iterator[int]:
        """``for step in hook.range(total):`` resumes, then yields steps; each iteration's end is a boundary."""
        if isinstance(total, bool) or not isinstance(total, int) or total < 0:
            raise ValueError(f"total must be a non-negative integer, got {total!r}")
        if not self._resumed:
            self.resume()
        self._enter_explicit()
        for i in builtins.range(self._count, total):
            yield i
            self._count += 1
            self._explicit_boundary(final=(i == total - 1))

    def step(self) -> int:
        """An explicit iteration boundary (call once at the end of each iteration); returns completed iterations."""
        skip = False
        if not self._explicit:
            skip = self._implicit_counted  # this iteration was already counted by the optimizer post-hook
            self._enter_explicit()
        if not skip:
            self._count += 1
        self._explicit_boundary(final=False)
        return self._count

    def latest(self) -> Optional[str]:
        """Local path of the newest committed checkpoint folder, or None."""
        from ..storage.verify import latest_verified  # noqa: PLC0415

        found = latest_verified(self._storage, self._log)  # object store: downloaded to a local cache first
        return None if found is None else str(found[1])

    def notify(self, notice: Notice) -> None:
        """Hand the hook a notice yourself (tests, custom sources); same path as the daemon's."""
        self._receive(notice, via="api")

    def emergency_exit(self, notice: Notice, step: int) -> NoReturn:
        """Write the emergency checkpoint for ``notice`` as completed iteration ``step`` now, then exit.

        For engines that decide themselves when to act on a notice their
        ``on_notice`` deferred (torchft: only when every replica group leaves);
        every rank of this process group calls it at the same boundary.
        """
        self._count = step
        self._internal = True
        self._exit(notice, self._save(notice, "emergency", None))

    def close(self) -> None:
        """Remove the optimizer hooks, restore signal handlers, stop the intake (idempotent)."""
        if self._closed:
            return
        self._closed = True
        stop_watch(getattr(self, "_peers", None))  # [i14b] bye to the peers before anything goes
        unguard_destroy(self._quiesce)
        if self._periodic is not None and not self._exiting:
            self._periodic.quiesce(QUIESCE_PERIODIC_TIMEOUT)  # let an in-flight upload finish (bounded)
        self._remove_step_hooks()
        for sig, prev in self._prev_handlers.items():
            try:
                if signal.getsignal(sig) == self._on_signal:
                    signal.signal(sig, prev if prev is not None else signal.SIG_DFL)
            except (ValueError, OSError):
                pass
        self._prev_handlers.clear()
        if self._intake is not None:
            self._intake.close()
        try:
            atexit.unregister(self._at_exit)
        except Exception:
            pass

    # ------------------------------------------------------------- step hooks

    def _install_step_hooks(self) -> None:
        for opt in self._objs.optimizers.values():
            self._handles.append(opt.register_step_pre_hook(self._pre_hook))
            self._handles.append(opt.register_step_post_hook(self._post_hook))
        sc = self._scaler
        if sc is not None:
            orig_step, orig_update = sc.step, sc.update
            hook = self

            def step(optimizer: Any, *args: Any, **kwargs: Any) -> Any:
                if not (hook._internal or hook._explicit or hook._closed) and hook._agree.pending:
                    hook._boundary()
                return orig_step(optimizer, *args, **kwargs)

            def update(*args: Any, **kwargs: Any) -> Any:
                out = orig_update(*args, **kwargs)
                if not (hook._internal or hook._explicit or hook._closed):
                    hook._decide()
                return out

            sc.step, sc.update = step, update
            self._scaler_orig = (orig_step, orig_update)

    def _remove_step_hooks(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
        if self._scaler is not None and self._scaler_orig is not None:
            for name in ("step", "update"):
                try:
                    delattr(self._scaler, name)  # the instance attribute shadowing the method
                except AttributeError:
                    pass
            self._scaler_orig = None

    def _pre_hook(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if self._internal or self._explicit or self._closed or self._torn_down:
            return  # DCP's fake step() on a fresh optimizer lands here: never count it
        if self._clock is None:
            self._clock = optimizer
        if optimizer is self._clock and self._agree.pending:
            self._boundary()

    def _post_hook(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if self._internal or self._explicit or self._closed or self._torn_down:
            return
        if self._scaler is not None:
            return  # GradScaler.update() is the clock
        if optimizer is self._clock:
            self._decide()
        elif self._many_opts:
            self._snap = Snapshot.take(self._objs.loaders, self._buffers)

    def _decide(self) -> None:
        """End of an iteration as the hook sees it: count, snapshot, launch the flag reduction."""
        if not self._fresh_checked:
            self._warn_unresumed()
        if self._torn_down:  # the process group is gone: count, but launch nothing
            self._count += 1
            return
        if self._agree.pending:  # a decision no boundary consumed (unusual loop): settle it here, consistently
            res = self._agree.collect()
            if res is not None and res[0] > 0:
                self._act(res[0], res[1], snap=None, final=False)
        self._count += 1
        self._implicit_counted = True
        self._snap = Snapshot.take(self._objs.loaders, self._buffers)
        level, deadline_ms = self._local_level()
        self._agree.launch(level, deadline_ms, self._periodic_flags())

    def _boundary(self) -> None:
        res = self._agree.collect()
        self._implicit_counted = False
        if res is not None and res[0] > 0:
            self._act(res[0], res[1], snap=self._snap, final=False)
        elif res is not None:
            self._maybe_periodic(self._snap)

    def _enter_explicit(self) -> None:
        if self._explicit:
            return
        self._explicit = True
        self._remove_step_hooks()

    def _explicit_boundary(self, *, final: bool) -> None:
        if not self._fresh_checked:
            self._warn_unresumed()
        if self._torn_down:  # after destroy_process_group(): no collective any more
            return
        res = self._agree.collect()
        self._implicit_counted = False
        if res is not None and res[0] > 0:
            self._act(res[0], res[1], snap=None, final=final)
        elif res is not None and not final:
            self._maybe_periodic(None)
        if not final:
            level, deadline_ms = self._local_level()
            self._agree.launch(level, deadline_ms, self._periodic_flags())

    def _warn_unresumed(self) -> None:
        """First step without ``hook.resume()`` (rank 0, once): say so if the storage already holds a checkpoint."""
        self._fresh_checked = True
        if self._rank != 0:
            return
        try:
            info = newest_committed(self._storage)
        except Exception as exc:  # noqa: BLE001 - a warning must never stop training
            self._log.debug("unresumed check failed", error=repr(exc))
            return
        if info is not None:
            self._log.warning(ev.NOT_RESUMED, uri=f"{self._storage.uri}/{info.dir}", committed_step=info.step,
                              step=self._count,
                              fix="call start = hook.resume() before the first step (or iterate hook.range(total)), "
                                  "or give this run its own storage prefix; its checkpoints are not this run's")

    # ---------------------------------------------------------------- notices

    def _start_intake(self, socket_path: str | None) -> None:
        try:
            from .intake import NoticeIntake  # noqa: PLC0415
        except ImportError as exc:  # pragma: no cover - intake ships with the package
            self._log.warning("notice intake unavailable: acting on SIGTERM/SIGUSR1 only", error=str(exc))
            return
        job = os.environ.get("SPOTGUARD_JOB") or os.environ.get("TORCHELASTIC_RUN_ID", "")
        self._intake = NoticeIntake(
            socket_path, rank=self._rank, local_rank=self._local_rank, world_size=self._world, job=job,
            on_notice=lambda n: self._receive(n, via="daemon"), on_cancel=self._on_cancel,
        )
        self._intake.start()

    def _install_signals(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            self._log.warning("hook installed off the main thread: SIGTERM/SIGUSR1 handlers not installed")
            return
        for sig in (signal.SIGTERM, signal.SIGUSR1):
            try:
                self._prev_handlers[sig] = signal.getsignal(sig)
                signal.signal(sig, self._on_signal)
            except (ValueError, OSError) as exc:
                self._log.warning("cannot install signal handler", signal=int(sig), error=str(exc))

    def _on_signal(self, signum: int, frame: Any) -> None:
        """Runs in the main thread between bytecodes: only hand off (no locks, no I/O here)."""
        if not self._exiting and not self._closed:
            name = signal.Signals(signum).name
            now = utcnow()
            notice = Notice(
                id=f"signal-{name.lower()}-{_socket.gethostname()}-{os.getpid()}-{int(now.timestamp() * 1000)}",
                source="signal",
                kind="termination" if signum == signal.SIGTERM else "preemption",
                deadline=now + timedelta(seconds=SIGNAL_GRACE),
                received_at=now,
                detail=f"{name} received by pid {os.getpid()}",
            )
            threading.Thread(target=self._receive, args=(notice, "signal"), name="spotguard-signal",
                             daemon=True).start()
        prev = self._prev_handlers.get(signum)
        if callable(prev):
            prev(signum, frame)

    def _receive(self, notice: Notice, via: str) -> None:
        with self._lock:
            if notice.id in self._seen:
                return
            self._seen.add(notice.id)
        if not notice.emergency and notice.id in self._committed_ids:
            self._log.info(ev.NOTICE_IGNORED, notice_id=notice.id, kind=notice.kind,
                           reason="replayed; its checkpoint is already committed")
            return
        self._log.info(ev.NOTICE_SEEN, notice_id=notice.id, kind=notice.kind, source=notice.source, via=via,
                       deadline=to_rfc3339(notice.deadline), seconds_left=round(notice.seconds_left(), 3))
        if self._on_notice_cb is not None:
            try:
                verdict = self._on_notice_cb(notice)
            except Exception as exc:  # noqa: BLE001 - a user callback must not break the emergency path
                self._log.warning("on_notice callback raised", notice_id=notice.id, error=repr(exc))
                verdict = None
            if verdict is False:
                self._log.info(ev.NOTICE_IGNORED, notice_id=notice.id, reason="on_notice returned False")
                return
        with self._lock:
            self._pending[notice.id] = notice
        if notice.emergency and notice.seconds_left() > EMERGENCY_LEAD:
            self._log.info(ev.NOTICE_DEFERRED, notice_id=notice.id, kind=notice.kind, lead=EMERGENCY_LEAD,
                           acts_in=round(notice.seconds_left() - EMERGENCY_LEAD, 3))

    def _on_cancel(self, notice_id: str) -> None:
        with self._lock:
            gone = self._pending.pop(notice_id, None)
            self._seen.discard(notice_id)
        if gone is not None:
            self._log.info(ev.NOTICE_CANCELLED, notice_id=notice_id)

    def _level_of(self, n: Notice) -> int:
        if n.id in self._committed_ids:
            # Already checkpointed for it: an emergency replay means "exit, the VM is going"; a
            # rebalance/maintenance replay means nothing (they never stop a job).
            return LEVEL_REPLAY if n.emergency else LEVEL_NONE
        if not n.emergency:
            return LEVEL_CHECKPOINT
        return LEVEL_EMERGENCY if n.seconds_left() <= EMERGENCY_LEAD else LEVEL_NONE  # far: keep training

    def _local_level(self) -> tuple[int, int]:
        if not self._pending:  # fast path: a dict truth test, no lock
            return LEVEL_NONE, NO_DEADLINE_MS
        with self._lock:
            notices = list(self._pending.values())
        level, deadline = LEVEL_NONE, NO_DEADLINE_MS
        for n in notices:
            level = max(level, self._level_of(n))
            deadline = min(deadline, _ms(n.deadline))
        return level, deadline

    def _best_local(self) -> Optional[tuple[int, int, dict[str, Any]]]:
        with self._lock:
            notices = list(self._pending.values())
        if not notices:
            return None
        n = max(notices, key=lambda x: (self._level_of(x), -_ms(x.deadline)))
        return self._level_of(n), _ms(n.deadline), n.to_wire()

    def _gather_notice(self, level: int, deadline_ms: int) -> tuple[Notice, list[str]]:
        """After agreement every rank enters this: the notice to act on (from whichever rank has it)."""
        mine = self._best_local()
        if self._dist and group_alive(self._group):
            allv: list[Any] = [None] * self._world
            dist.all_gather_object(allv, mine, group=self._group)
        else:
            allv = [mine]
        cands = [c for c in allv if c is not None]
        ids = [c[2]["id"] for c in cands]
        if cands:
            best = max(cands, key=lambda c: (c[0], -c[1]))
            return Notice.from_wire(best[2]), ids
        now = utcnow()
        deadline = (now + timedelta(seconds=SIGNAL_GRACE) if deadline_ms >= NO_DEADLINE_MS
                    else now + timedelta(milliseconds=deadline_ms - _ms(now)))
        return Notice(id=f"agreed-{self._count}", source="signal", kind="termination", deadline=deadline,
                      received_at=now, detail="notice withdrawn after agreement"), ids

    # ------------------------------------------------------------- the action

    def _timing(self, notice: Notice) -> dict[str, float]:
        now = utcnow()
        return {
            "seconds_since_notice": round((now - notice.received_at).total_seconds(), 3),
            "seconds_left": round((notice.deadline - now).total_seconds(), 3),
        }

    def _act(self, level: int, deadline_ms: int, *, snap: Optional[Snapshot], final: bool) -> None:
        self._internal = True
        try:
            plan = self._plan(level, deadline_ms, final=final)
            if plan is not None:
                self._carry_out(plan, snap)
        finally:
            self._internal = False

    def _plan(self, level: int, deadline_ms: int, *, final: bool) -> Optional[tuple[Notice, list[str], str]]:
        """After agreement (every rank): the notice and the action, logged as ``agreed``; None = nothing to do.

        Split from ``_carry_out`` so that a framework adapter can let its trainer
        write the checkpoint between the two (Hugging Face: ``control.should_save``).
        """
        try:
            notice, ids = self._gather_notice(level, deadline_ms)
        except Exception as exc:  # noqa: BLE001 - a peer vanished right after agreeing
            notice = Notice(id=f"agreed-{self._count}", source="signal", kind="termination",
                            deadline=utcnow() + timedelta(seconds=SIGNAL_GRACE))
            if level >= LEVEL_EMERGENCY:
                self._log.warning("peers lost while sharing the notice", error=repr(exc))
                self._exit(notice, _Result(committed=False, peers_ok=False, error=repr(exc)))
            return None
        action = _ACTIONS[level]
        if level == LEVEL_REPLAY and self._count != self._resumed_step:
            action = "emergency"  # we trained past the committed step before learning of the replay
        self._log.info(ev.AGREED, notice_id=notice.id, step=self._count, flag=level, action=action,
                       kind=notice.kind, **self._timing(notice))
        if final:
            self._log.info(ev.NOTICE_AFTER_LAST_STEP, notice_id=notice.id, step=self._count)
            self._forget(ids)
            return None
        return notice, ids, action

    def _carry_out(self, plan: tuple[Notice, list[str], str], snap: Optional[Snapshot]) -> None:
        """Exit (replay), emergency save + exit (never returns), or an ordinary save and keep training."""
        notice, ids, action = plan
        if action == "periodic":  # a framework adapter's every= checkpoint: no notice involved
            self._save(notice, "periodic", snap)
            set_group_timeout(self._group, 1800.0)
            return
        if action == "exit":
            self._exit(notice, None)
        if action == "emergency":
            self._exit(notice, self._save(notice, "emergency", snap))
        self._save(notice, "manual", snap)  # ordinary checkpoint, keep training
        self._forget(ids)
        set_group_timeout(self._group, 1800.0)

    def _forget(self, ids: list[str]) -> None:
        with self._lock:
            for i in ids:
                self._pending.pop(i, None)
                self._seen.add(i)

    def _report(self, msg: Any) -> None:
        if str(getattr(msg, "id", "")).startswith(PERIODIC_NOTICE_PREFIX):
            return  # about no daemon notice
        if self._intake is not None:
            try:
                self._intake.report(msg)
            except Exception:  # noqa: BLE001 - reporting is best effort
                pass

    def _bcast0(self, obj: Any) -> Any:
        if not self._dist:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0, group=self._group)
        return box[0]

    def _all_ok(self, ok: bool) -> bool:
        if not self._dist:
            return ok
        t = torch.tensor([0 if ok else 1], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self._group)
        return int(t[0]) == 0

    def _save(self, notice: Notice, reason: str, snap: Optional[Snapshot]) -> _Result:
        """Every rank: DCP save -> all bytes durable -> rank 0 commits -> barrier. Never raises."""
        t0 = time.monotonic()
        step = self._count
        key = step_dir(step)
        uri = f"{self._storage.uri}/{key}"
        set_group_timeout(self._group, min(600.0, max(5.0, notice.seconds_left() - 0.5)))
        self._log.info(ev.CHECKPOINT_STARTED, notice_id=notice.id, step=step, uri=uri, reason=reason)
        self._report(CheckpointStarted(id=notice.id, step=step))
        stage = "periodic"
        scope = contextlib.ExitStack()
        try:
            self._settle_periodic(notice)
            stage = "prepare"
            # Retries and uploads never run past the notice deadline, less a margin for teardown/exit.
            left = notice.seconds_left()
            scope.enter_context(self._storage.deadline_at(
                time.monotonic() + left - min(SAVE_MARGIN, max(0.0, left) / 2)))
            status = self._bcast0(self._prepare_status(step) if self._rank == 0 else None)
            if status[0] == "already":
                return self._finish_ok(notice, step, uri, 0, t0, already=True)
            if status[0] == "error":
                return self._fail(notice, step, f"prepare failed on rank 0: {status[1]}", t0, peers_ok=True)
            stage = "write"
            err = None
            self._storage.write_log.take(key)  # what an earlier attempt at this step wrote does not count
            try:
                self._write(key, snap)
                if self._test_delay:
                    time.sleep(self._test_delay)  # test-only: widen the window for a SIGKILL during the save
            except BaseException as exc:  # noqa: BLE001 - DCP raises CheckpointException (a BaseException!) on every rank
                if isinstance(exc, (KeyboardInterrupt, SystemExit)):
                    raise
                err = f"{type(exc).__name__}: {exc}"
            stage = "durable-barrier"
            if not self._all_ok(err is None):
                return self._fail(notice, step, err or "another rank failed to write its shards", t0, peers_ok=True)
            stage = "gather"  # the record names exactly what the ranks report writing
            written = gather_writes(self._group if self._dist else None, self._storage.write_log.take(key))
            stage = "commit"
            outcome: Any = None
            if self._rank == 0:
                outcome = commit_and_retain(self._storage, step, CommitRecord(
                    step=step, world_size=self._world, reason=reason,
                    notice_id=None if reason == "periodic" else notice.id,
                    seconds=round(time.monotonic() - t0, 3),
                    extra={"spotguard": __version__, "lineage": self._lineage} if reason == "periodic" else
                    {"notice_kind": notice.kind, "notice_source": notice.source,
                     "deadline": to_rfc3339(notice.deadline), "spotguard": __version__, "lineage": self._lineage},
                ), self._keep, self._log, written)
            stage = "commit-barrier"
            # Every rank passes this only after the record is durable: no rank may exit before it.
            outcome = self._bcast0(outcome)
            if outcome[0] != "ok":
                return self._fail(notice, step, f"commit failed on rank 0: {outcome[1]}", t0, peers_ok=True)
            return self._finish_ok(notice, step, uri, int(outcome[1]), t0)
        except BaseException as exc:  # noqa: BLE001 - a collective failed: a peer died or timed out
            if isinstance(exc, (KeyboardInterrupt, SystemExit)):
                raise
            return self._fail(notice, step, f"{stage}: {type(exc).__name__}: {exc}", t0, peers_ok=False)
        finally:
            scope.close()

    def _prepare_status(self, step: int, storage: Optional[Storage] = None) -> tuple[str, Any]:
        """Rank 0: ``prepare_status``, except that "already committed" counts only for this run's own checkpoint.

        A step folder committed by another run (another lineage in its record) that this run never
        resumed from is not this run's state: claiming it would report ``committed`` for bytes that
        are not ours. That is an error naming the fix.
        """
        storage = storage or self._storage
        status = prepare_status(storage, step)
        key = step_dir(step)
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
        self._committed_ids.add(notice.id)
        if self._periodic is not None:
            self._periodic.restart_clock()
        self._log.info(ev.CHECKPOINT_COMMITTED, notice_id=notice.id, step=step, uri=uri, bytes=nbytes,
                       seconds=secs, already_committed=already, **self._timing(notice))
        self._report(CheckpointDone(id=notice.id, step=step, uri=uri, bytes=nbytes, seconds=secs))
        self._after_commit(notice, step, uri)
        return _Result(committed=True, uri=uri, bytes=nbytes, seconds=secs)

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

    def _exit(self, notice: Notice, result: Optional[_Result]) -> NoReturn:
        """Teardown without hanging, then raise Preempted (os._exit if teardown itself hung)."""
        self._exiting = True
        peers_ok = result.peers_ok if result is not None else True
        method, secs = teardown(self._group, peers_ok=peers_ok)
        self._log.info(ev.TEARDOWN, notice_id=notice.id, method=method, seconds=round(secs, 3))
        # No save (result None): a replay of the notice our checkpoint was written for, or a notice
        # already active at start. This run's state is committed only if it came from a checkpoint
        # and did not move since; a run with no checkpoint had nothing to save and claims nothing.
        nothing = result is None and self._resumed_dir is None and self._count == 0
        if result is not None:
            committed = bool(result.committed)
        else:
            committed = self._resumed_dir is not None and self._count == self._resumed_step
        code = self._exit_code if committed or nothing else EXIT_SAVE_FAILED
        self._flush_intake()
        # From here the process is leaving: a late SIGTERM (torchrun tells the others
        # once one rank exits) must not turn our code into -15 during interpreter exit.
        for sig in (signal.SIGTERM, signal.SIGUSR1):
            try:
                signal.signal(sig, signal.SIG_IGN)
            except (ValueError, OSError):
                pass
        self._prev_handlers.clear()
        self._log.info(ev.EXIT, notice_id=notice.id, code=code, step=self._count, committed=committed,
                       nothing_to_save=nothing, **self._timing(notice))
        self.close()
        sys.stdout.flush()
        sys.stderr.flush()
        if method == "timeout":
            os._exit(code)
        gc.collect()
        gc.freeze()  # interpreter teardown with torch's heap: ~1 s -> ~0.1 s
        raise Preempted(code, notice_id=notice.id, step=self._count,
                        uri=result.uri if result is not None else None, committed=committed)

    def _flush_intake(self, timeout: float = 0.5) -> None:
        """Give queued reports a moment to reach the daemon before the process goes."""
        it = self._intake
        if it is None or not it.connected.is_set():
            return
        it.flush(timeout)

    # --------------------------------------------------------- state <-> DCP

    def _rank_key(self, rank: int) -> str:
        return elastic.rank_key(rank)

    def _write(self, key: str, snap: Optional[Snapshot]) -> None:
        """Write this rank's part of the checkpoint under folder ``key`` (every rank; raise on failure).

        The plain hook writes one DCP checkpoint; framework adapters override this
        to let their trainer write its own format. Durability and the commit
        record are ``_save``'s job.
        """
        import torch.distributed.checkpoint as dcp  # noqa: PLC0415

        sd = self._save_state_dict(snap)
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
            dcp.save(sd, storage_writer=self._storage.dcp_writer(key), process_group=self._group)

    def _save_state_dict(self, snap: Optional[Snapshot]) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict  # noqa: PLC0415

        o = self._objs
        if snap is None:
            snap = Snapshot.take(o.loaders, self._buffers)
        sd: dict[str, Any] = {}
        for k, m in o.models.items():
            sd[k] = get_model_state_dict(m)
        for k, opt in o.optimizers.items():
            sd[k] = get_optimizer_state_dict(o.models[o.owner[k]], opt)
        per = {
            "step": self._count,
            "world_size": self._world,
            "rng": snap.rng,
            "loaders": snap.loaders,
            "buffers": snap.buffers,
            "schedulers": {k: s.state_dict() for k, s in o.schedulers.items()},
            "scalers": {k: s.state_dict() for k, s in o.scalers.items()},
            "stateful": {k: s.state_dict() for k, s in o.stateful.items()},
        }
        sd[self._rank_key(self._rank)] = pack(per)
        return sd

    def _load(self, dirkey: str, digests: Any = None) -> Optional[DamagedCheckpoint]:
        """Load ``dirkey`` into the state (every rank), each byte verified against ``digests``.

        Returns None, or (every rank alike) the damage that made some rank refuse
        it: its state may then be partly overwritten, and the caller loads an
        older checkpoint over it. Anything else that fails raises.
        """
        damage: Optional[DamagedCheckpoint] = None
        try:
            self._load_into(dirkey, digests)
        except DamagedCheckpoint as exc:
            damage = exc
        except BaseException as exc:  # CheckpointException is a BaseException
            damage = damage_in(exc)
            if damage is None:
                raise
        if self._all_ok(damage is None):
            return None
        return damage or DamagedCheckpoint(f"{self._storage.uri}/{dirkey}", "another rank found it damaged")

    def _load_into(self, dirkey: str, digests: Any) -> None:
        import torch.distributed.checkpoint as dcp  # noqa: PLC0415
        from torch.distributed.checkpoint.state_dict import (  # noqa: PLC0415
            get_model_state_dict,
            get_optimizer_state_dict,
            set_model_state_dict,
            set_optimizer_state_dict,
        )

        o = self._objs
        meta_ok, meta_err = True, None
        try:
            meta = self._storage.dcp_reader(dirkey, digests).read_metadata()
        except DamagedCheckpoint as exc:
            meta_ok, meta_err = False, exc
        if not self._all_ok(meta_ok):  # no rank enters dcp.load unless every rank can
            raise meta_err or DamagedCheckpoint(f"{self._storage.uri}/{dirkey}", "another rank refused its metadata")
        saved = elastic.saved_ranks(meta.state_dict_metadata)
        src = elastic.source_rank(saved, self._rank)
        rkey = self._rank_key(src) if src is not None else None
        sd: dict[str, Any] = {}
        for k, m in o.models.items():
            sd[k] = get_model_state_dict(m)
        for k, opt in o.optimizers.items():
            sd[k] = get_optimizer_state_dict(o.models[o.owner[k]], opt)  # fake step() on a fresh optimizer
        if rkey is not None:
            sd[rkey] = b""
        try:
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
                dcp.load(sd, storage_reader=self._storage.dcp_reader(dirkey, digests), planner=SafeLoadPlanner(),
                         process_group=self._group)
        except BaseException as exc:  # CheckpointException is a BaseException
            if isinstance(exc, (KeyboardInterrupt, SystemExit)):
                raise
            damage = damage_in(exc, self._rank) or damage_in(exc)
            if damage is not None:
                raise damage from None
            raise RuntimeError(
                f"spotguard: checkpoint {self._storage.uri}/{dirkey} does not fit this state dict "
                f"({type(exc).__name__}: {exc})"
            ) from exc
        for k, m in o.models.items():
            set_model_state_dict(m, sd[k])
        for k, opt in o.optimizers.items():
            set_optimizer_state_dict(o.models[o.owner[k]], opt, sd[k])
        per: Any = None
        if rkey is not None:
            try:
                per = unpack(sd[rkey], f"{self._storage.uri}/{dirkey} per-rank state of rank {src}")
            except DamagedCheckpoint as exc:
                meta_err = exc
        if not self._all_ok(meta_err is None):  # every rank, whether or not it reads per-rank state
            raise meta_err or DamagedCheckpoint(f"{self._storage.uri}/{dirkey}", "another rank refused its state")
        if rkey is None:
            self._log.warning("checkpoint has no per-rank state at all: only model and optimizer restored",
                              dir=dirkey)
            return
        own = src == self._rank
        done = elastic.restore(per, own=own, source=src, scope=o.scope, roles={
            "schedulers": o.schedulers, "scalers": o.scalers, "stateful": o.stateful, "loaders": o.loaders})
        for mk, bufs in per.get("buffers", {}).items():  # global: under DDP rank 0 broadcasts them
            live = self._buffers.get(mk, {})
            with torch.no_grad():
                for name, val in bufs.items():
                    if name in live:
                        live[name].copy_(val)
        if done.missing:
            self._log.warning("checkpoint has no state for object", keys=done.missing, dir=dirkey)
        old_world = int(per.get("world_size", len(saved)))
        elastic.restore_rng_for(per, done, step=int(per.get("step", 0)), rank=self._rank)  # last
        if old_world != self._world or not own:
            self._log.info(ev.ELASTIC_RESUME, dir=dirkey, old_world_size=old_world, world_size=self._world,
                           resharded=[*o.models, *o.optimizers],
                           dropped_ranks=[r for r in saved if r >= self._world] if self._rank == 0 else [],
                           **done.fields())

    # ----------------------------------------------------------- start / exit

    def _agree_at_start(self) -> None:
        """Wait briefly for the daemon's replay, then one blocking agreement: exit at once if a notice is active."""
        it = self._intake
        if it is not None and os.path.exists(it.socket_path):
            if it.wait_connected(1.0):
                it.replayed.wait(1.0)  # every active notice the daemon replays has been received
        with self._lock:  # rebalance/maintenance replays received before resume() knew they were ours
            ours = [i for i, n in self._pending.items() if not n.emergency and i in self._committed_ids]
            for nid in ours:
                del self._pending[nid]
        for nid in ours:
            self._log.info(ev.NOTICE_IGNORED, notice_id=nid, reason="replayed; its checkpoint is already committed")
        level, deadline_ms = self._local_level()
        if self._dist:
            level, deadline_ms = self._agree.blocking(level, deadline_ms)
        if level >= LEVEL_EMERGENCY:
            notice, _ = self._gather_notice(level, deadline_ms)
            self._log.info(ev.AGREED, notice_id=notice.id, step=self._count, flag=level, action="exit",
                           kind=notice.kind, **self._timing(notice))
            self._exit(notice, None)

    def _at_exit(self) -> None:
        """Process exit is the last boundary: a notice seen now came after the last step; keep the exit code."""
        if self._closed or self._exiting:
            return
        res = None
        if self._torn_down:  # the user destroyed the process group: no collective is possible any more
            res = self._late
        elif self._agree.pending:
            if self._group is None:
                res = self._agree.collect()
            elif group_alive(self._group):
                box: dict[str, Any] = {}
                ok, _ = run_bounded(lambda: box.setdefault("r", self._agree.collect()), 3.0, "spotguard-atexit")
                res = box.get("r") if ok else None
            else:
                self._agree.drop(0.0)
        local = self._best_local()
        if (res is not None and res[0] > 0) or local is not None:
            nid = local[2]["id"] if local is not None else None
            self._log.info(ev.NOTICE_AFTER_LAST_STEP, notice_id=nid, step=self._count)
        self.close()  # waits (bounded) for an in-flight periodic upload

    # ------------------------------------------------------- teardown guard

    def _quiesce(self) -> None:
        """Runs inside ``torch.distributed.destroy_process_group()`` (every rank), before the groups go.

        Waits (bounded) for the flag reduction launched at the last iteration's
        end — every rank launched the same number, so this cannot deadlock — and
        for an in-flight periodic upload, then destroys the hook's own groups.
        From then on the hook is "after teardown": no collective is launched, and
        a notice only logs ``notice_after_last_step`` at exit.
        """
        if self._torn_down:
            return
        self._torn_down = True
        stop_watch(getattr(self, "_peers", None))  # [i14b] before any group is destroyed
        self._late = self._agree.drop(QUIESCE_AGREEMENT_TIMEOUT) if self._agree.pending else None
        if self._periodic is not None:  # leaving after a notice: never wait out an upload
            self._periodic.quiesce(5.0 if self._exiting else QUIESCE_PERIODIC_TIMEOUT, cancel=self._exiting)
        destroy_group(self._group)
        # Drop our last references so the C++ group is destroyed now (torch releases the GIL
        # there and joins gloo's worker threads) rather than during interpreter shutdown,
        # where a worker thread still freeing a finished work dies in pthread_exit and the
        # process aborts with -6 ("terminate called without an active exception").
        self._group = None
        self._agree.group = None

    # ------------------------------------------------------------ periodic

    def _periodic_flags(self) -> tuple[int, int]:
        p = self._periodic
        if p is None or self._torn_down or self._closed:
            return 0, 0
        return p.flags()

    def _maybe_periodic(self, snap: Optional[Snapshot]) -> None:
        """At a boundary with no notice: start the agreed periodic save (every rank sees the same flags)."""
        p = self._periodic
        if p is None or self._torn_down or self._closed:
            return
        due, busy = self._agree.flags[:2]
        if not due or busy:
            return
        self._internal = True
        try:
            t0 = time.monotonic()
            state, nbytes = stage_state_dict(self._save_state_dict(snap))
            p.start(self._count, state, nbytes, time.monotonic() - t0)
        finally:
            self._internal = False

    def _settle_periodic(self, notice: Notice) -> None:
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
        what, est = self._bcast0(decision)
        if what == "idle" and not p.busy:
            return
        committed, waited = p.settle(what, left)
        self._log.info(PERIODIC_SETTLED, notice_id=notice.id, step=p.job.step if p.job else None, decision=what,
                       estimate=None if est is None else round(est, 3), seconds_left=round(left, 3),
                       waited=round(waited, 3), committed=committed)
