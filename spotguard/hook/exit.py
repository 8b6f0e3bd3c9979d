"""Leaving: bounded teardown, exit code, ``Preempted``; the process-exit and destroy guards.

Exit codes: ``exit_code`` (143) when this run's state is committed (or there
was nothing to save), ``EXIT_SAVE_FAILED`` (75) when the save failed.
"""

from __future__ import annotations

import gc
import os
import signal
import sys
import threading
import time
from typing import Any, Callable, NoReturn, Optional

from ..notice import Notice
from . import events as ev
from .dist import (
    destroy_group,
    group_alive,
    run_bounded,
    teardown,
)
from .lifecycle import Lifecycle
from .peers import stop_watch
from .save import _Result
from .state import Snapshot
from .settings import (
    EXIT_CALLBACK_TIMEOUT,
    EXIT_GRACE,
    EXIT_SAVE_FAILED,
    QUIESCE_AGREEMENT_TIMEOUT,
    QUIESCE_PERIODIC_TIMEOUT,
)


_LATE_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


def _swallow(signum: int, frame: Any) -> None:
    """A late signal while leaving: nothing to do (the code is already decided)."""


def _ignore_late_at_exit() -> None:
    for sig in _LATE_SIGNALS:
        try:
            if signal.getsignal(sig) is _swallow:
                signal.signal(sig, signal.SIG_IGN)
        except (ValueError, OSError):
            pass


def _ignore_late_signals() -> None:
    """From here the process is leaving: a late SIGTERM (torchrun tells the others
    once one rank exits) must not turn our code into -15 during interpreter exit.

    A Python handler, not SIG_IGN: an ignored disposition survives exec, so a process
    that catches ``Preempted`` and goes on (a test runner, a wrapper) would hand
    SIGTERM-deaf children to everything it starts. SIG_IGN only at interpreter exit,
    for the part of shutdown where Python handlers no longer run.
    """
    if threading.current_thread() is not threading.main_thread():
        return
    for sig in _LATE_SIGNALS:
        try:
            signal.signal(sig, _swallow)
        except (ValueError, OSError):
            pass
    import atexit

    atexit.unregister(_ignore_late_at_exit)
    atexit.register(_ignore_late_at_exit)


class Preempted(SystemExit):
    """Raised after the emergency checkpoint (or its failure): the process should exit so the launcher restarts it."""

    def __init__(self, code: int = 143, *, notice_id: str | None = None, step: int | None = None,
                 uri: str | None = None, committed: bool = False, late: bool = False) -> None:
        super().__init__(code)
        self.notice_id = notice_id
        self.step = step
        self.uri = uri
        self.committed = committed
        self.late = late  # committed after the notice's deadline (the code is then 75)


def _late(result: Optional[_Result]) -> bool:
    return result is not None and result.committed and result.late_seconds > 0



class ExitMixin:
    """Part of ``Hook`` (``core.py``); see the module docstring."""

    def emergency_exit(self, notice: Notice, step: int, snap: Optional[Snapshot] = None) -> NoReturn:
        """Write the emergency checkpoint for ``notice`` as completed iteration ``step`` now, then exit.

        For engines that decide themselves when to act on a notice their
        ``on_notice`` deferred (torchft: only when every replica group leaves);
        every rank of this process group calls it at the same boundary. ``snap``:
        loaders and RNG taken at step ``step`` when the write comes later.
        """
        self._steps.set_count(step)
        self._internal = True
        self._exit(notice, self._save(notice, "emergency", snap))

    def _outcome(self, result: Optional[_Result], step: int) -> tuple[bool, bool, int]:
        """(committed, nothing_to_save, exit code) for leaving after ``result`` at completed iteration ``step``.

        No save (result None): a replay of the notice our checkpoint was written for, or a
        notice already active at start. This run's state is committed only if it came from a
        checkpoint and did not move since; a run with no checkpoint had nothing to save and
        claims nothing.
        """
        untrained, already = self._standing(step)
        nothing = result is None and untrained
        committed = bool(result.committed) if result is not None else already
        if committed and result is not None and result.late_seconds > 0:
            return committed, nothing, EXIT_SAVE_FAILED  # committed, but after the deadline: never "nothing lost"
        return committed, nothing, self._life.exit_code if committed or nothing else EXIT_SAVE_FAILED

    def _standing(self, step: int) -> tuple[bool, bool]:
        """(nothing, already) at completed iteration ``step``: nothing trained and nothing resumed (so nothing
        to save), or exactly the state this run resumed from (already committed)."""
        nothing = step == 0 and self._resumed_dir is None
        already = self._resumed_dir is not None and step == self._resumed_step
        if (nothing or already) and self._watch.moved_since(self._baseline):
            # The parameters moved although no optimizer step was counted since the start or the resume
            # (SAM's first_step/second_step, manual updates): work was done that no checkpoint can stand for.
            self._log.error(ev.UNTRACKED_TRAINING, step=step,
                            fix="call hook.step() at the end of each iteration (or iterate hook.range()), or step "
                                "the optimizer in the hook's dict with optimizer.step()")
            return False, False
        return nothing, already

    def _exit(self, notice: Notice, result: Optional[_Result], step: Optional[int] = None) -> NoReturn:
        """Teardown without hanging, then raise Preempted (os._exit if teardown itself hung).

        ``step``: the completed iteration the checkpoint stands for when it is not the
        current count (the background save: training went on while it uploaded).
        """
        self._life.begin_exit()
        step = self._steps.count if step is None else step
        peers_ok = result.peers_ok if result is not None else True
        method, secs = teardown(self._group, peers_ok=peers_ok, timeout=self._teardown_timeout(notice))
        self._log.info(ev.TEARDOWN, notice_id=notice.id, method=method, seconds=round(secs, 3))
        committed, nothing, code = self._outcome(result, step)
        self._flush_intake()
        _ignore_late_signals()
        self._life.forget_handlers()
        self._log.info(ev.EXIT, notice_id=notice.id, code=code, step=step, committed=committed,
                       nothing_to_save=nothing, by="training-thread", late=_late(result), **self._timing(notice))
        self._run_exit_callbacks(notice, code, committed)
        self.close()
        sys.stdout.flush()
        sys.stderr.flush()
        if method == "timeout":
            os._exit(code)
        gc.collect()
        gc.freeze()  # interpreter teardown with torch's heap: ~1 s -> ~0.1 s
        raise Preempted(code, notice_id=notice.id, step=step,
                        uri=result.uri if result is not None else None, committed=committed, late=_late(result))

    def _teardown_timeout(self, notice: Notice) -> float:
        """Each bounded teardown step: 5 s, less when the deadline is nearer (never under 0.5 s)."""
        return max(0.5, min(5.0, notice.seconds_left() / 3))

    # ------------------------------------------------ leaving after a background save

    def _exit_from_background(self, notice: Notice, result: Optional[_Result], step: Optional[int], *,
                              lost_where: str = "save") -> None:
        """The agreement thread, after the commit barrier (or a lost peer): make the process leave.

        The training thread raises ``Preempted`` at its next hook point (a held
        pre-hook wakes at once). If it has not started leaving within
        ``EXIT_GRACE`` (bounded by the deadline less a margin) — a long evaluation,
        a gradient accumulation, a stalled loader, a 60 s forward — this thread
        logs the exit, flushes the reports to the daemon and ``os._exit``s with the
        same code. After a commit, an exception that reaches the top of the
        training thread (a peer left first and the user's collective raised) or a
        plain interpreter exit also ends with the committed code (``_excepthook``,
        ``_at_exit``).
        """
        step = self._steps.count if step is None else step
        committed, nothing, code = self._outcome(result, step)
        if result is not None and not result.peers_ok:
            self._log.error(ev.PEERS_LOST, where=lost_where, notice_id=notice.id, error=result.error[:300])
        with self._steps.cv:
            self._life.request_exit(notice, result, step)
            self._steps.cv.notify_all()
        self._install_excepthook(notice, time.monotonic())
        grace = max(0.1, min(EXIT_GRACE, notice.seconds_left() - 0.5))
        end = time.monotonic() + grace
        with self._steps.cv:
            while not self._life.exiting and time.monotonic() < end:
                self._steps.cv.wait(max(0.0, end - time.monotonic()))
        if self._life.exiting:  # the training thread took over; stand by in case its own exit hangs
            backstop = time.monotonic() + max(1.0, notice.seconds_left() - 0.3)
            while time.monotonic() < backstop:
                time.sleep(0.2)  # the process is expected to be gone long before: nothing to await
            self._hard_exit(notice, code, step, committed, nothing, "backstop", late=_late(result))
        self._hard_exit(notice, code, step, committed, nothing, "agreement-thread", late=_late(result))

    def _hard_exit(self, notice: Notice, code: int, step: int, committed: bool, nothing: bool, by: str,
                   late: bool = False) -> NoReturn:
        """Leave now from a non-training thread: log, report, flush, ``os._exit`` (no teardown needed: the
        commit barrier already held every rank until the record was durable)."""
        self._life.begin_exit()
        self._log.info(ev.EXIT, notice_id=notice.id, code=code, step=step, committed=committed,
                       nothing_to_save=nothing, by=by, late=late, **self._timing(notice))
        self._run_exit_callbacks(notice, code, committed)
        self._flush_intake()
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:  # noqa: BLE001 - leaving anyway
                pass
        os._exit(code)

    def on_exit(self, callback: Callable[[int, bool], Any]) -> Callable[[int, bool], Any]:
        """Run ``callback(code, committed)`` right before the process leaves for a notice (usable as a decorator).

        Why: a process leaving from the background (``os._exit`` after
        ``SPOTGUARD_EXIT_GRACE`` while the training thread is elsewhere) skips the
        training thread's ``finally`` blocks and ``atexit`` handlers; flushing a
        W&B/TensorBoard writer or requeueing a Slurm job belongs here. Callbacks
        run in order, on whichever thread leaves, each bounded by
        ``SPOTGUARD_EXIT_CALLBACK_TIMEOUT`` (2 s, less when the deadline is nearer);
        one that raises or overruns is logged and the exit goes on.
        """
        if not callable(callback):
            raise TypeError(f"on_exit takes a callable, got {type(callback).__name__}")
        self.__dict__.setdefault("_life", Lifecycle()).add_exit_callback(callback)  # framework hooks arm later
        return callback

    def _run_exit_callbacks(self, notice: Notice, code: int, committed: bool) -> None:
        for cb in self._life.take_exit_callbacks():
            bound = max(0.1, min(EXIT_CALLBACK_TIMEOUT, notice.seconds_left() - 0.5))
            box: dict[str, Any] = {}

            def run(cb: Any = cb) -> None:
                try:
                    cb(code, committed)
                except BaseException as exc:  # noqa: BLE001 - the user's callback: never stop the exit
                    box["error"] = f"{type(exc).__name__}: {exc}"

            t = threading.Thread(target=run, name="spotguard-on-exit", daemon=True)
            t.start()
            t.join(bound)
            if t.is_alive() or "error" in box:
                self._log.warning("on_exit callback did not finish cleanly", callback=getattr(cb, "__name__", repr(cb)),
                                  error=box.get("error", f"still running after {bound:.1f} s"))

    def _exit_if_requested(self) -> None:
        """Training thread, at a hook point: leave if the agreement thread asked for it."""
        req = self._life.exit_request
        if req is not None and not self._life.exiting:
            notice, result, step = req
            self._exit(notice, result, step)

    def _install_excepthook(self, notice: Notice, t_end: float) -> None:
        """Once an emergency is agreed: an exception that ends the training thread (a peer left first and a
        collective of the user's raised) still exits with the decision's code, after the background save
        ended (bounded by ``t_end``, or the round's hold when later: the survivors of a handed-over save commit
        on their own bound); if it never did, with ``EXIT_SAVE_FAILED``. One log line says why."""
        if getattr(sys.excepthook, "__spotguard__", False):
            return
        prev = sys.excepthook
        hook = self

        def excepthook(tp: Any, value: Any, tb: Any) -> None:
            if isinstance(value, SystemExit):
                prev(tp, value, tb)
                return
            with hook._steps.cv:  # the round's hold may outlast t_end: survivors committing alone (handoff.py)
                while not hook._life.exit_requested and \
                        time.monotonic() < max(t_end, hook._steps.hold_until) + 1.0:
                    hook._steps.cv.wait(max(0.0, max(t_end, hook._steps.hold_until) + 1.0 - time.monotonic()))
                req = hook._life.exit_request
            if req is not None:
                n, result, step = req
                committed, nothing, code = hook._outcome(result, step if step is not None else hook._steps.count)
            else:
                n, step, committed, nothing, code = notice, hook._steps.count, False, False, EXIT_SAVE_FAILED
            hook._log.warning("training thread raised during the emergency checkpoint; exiting with its code",
                              notice_id=n.id, code=code, error=f"{tp.__name__}: {value}"[:300])
            hook._hard_exit(n, code, step if step is not None else hook._steps.count, committed, nothing, "excepthook")

        excepthook.__spotguard__ = True  # type: ignore[attr-defined]
        sys.excepthook = excepthook

    def _flush_intake(self, timeout: float = 0.5) -> None:
        """Give queued reports a moment to reach the daemon before the process goes."""
        it = self._intake
        if it is None or not it.connected.is_set():
            return
        it.flush(timeout)

    def _at_exit(self) -> None:
        """Process exit is the last boundary: a notice seen now came after the last step; keep the exit code.

        A round still in flight (a single process has no ``destroy_process_group()`` to serve it) gets the
        state of the last step here — the loop's work is over — and its decided code ends the process."""
        bg = self._bg
        if bg is not None and bg.busy.is_set() and not self._life.stopping():
            self._serve_last_round(QUIESCE_AGREEMENT_TIMEOUT)
        req = self._life.exit_request
        if req is not None and not self._life.exiting:  # the decision was taken: leave with its code, not the user's
            notice, result, step = req
            committed, nothing, code = self._outcome(result, step)
            self._log.warning("interpreter exiting after the checkpoint decision; exiting with the decided code",
                              notice_id=notice.id, code=code)
            self._hard_exit(notice, code, step, committed, nothing, "atexit", late=_late(result))
        if self._life.closing():
            return
        res = None
        if self._life.torn_down:  # the user destroyed the process group: no collective is possible any more
            res = self._life.last_reduction
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
            self._log.info(ev.NOTICE_AFTER_LAST_STEP, notice_id=nid, step=self._steps.count)
        self.close()  # waits (bounded) for an in-flight periodic upload

    def _serve_last_round(self, timeout: float) -> None:
        """The training thread, in ``destroy_process_group()`` after its last step: the loop's work is over,
        so this is a point where the state of the last step is known. A round in flight that waits for the
        next ``optimizer.step()`` (the exact fallback read, the small state) is served here instead — there
        will be no next step."""
        bg = self._bg
        end = time.monotonic() + timeout
        with self._steps.cv:
            while bg is not None and bg.busy.is_set() and time.monotonic() < end and not self._life.exit_requested:
                if (not self._steps.in_step and not self._anchor_ok(self._steps.count)) or \
                        (self._steps.in_step and self._loop.range_clock and self._loop.many_opts):
                    # an explicit loop left inside an iteration (a `break` after its optimizer step): that
                    # step is no iteration's end; the round hands its notice over (logged at exit)
                    self._break_clock("training ended inside an iteration of an explicit loop (no boundary after "
                                      "its last optimizer step)")
                elif not self._steps.in_step:
                    key = self._steps.count
                    if self._state_at.want_small == key and not self._state_at.has_small(key):
                        self._capture_small_for(key, "end-of-training")
                    if self._state_at.want_state == key and not self._state_at.has_read(key):
                        self._read_for_round(key)
                    elif self._state_at.want_state == key + 1 and not self._state_at.has_read(key):
                        # the exact fallback waits for the end of an iteration that will never come: the state
                        # now is the end of the last one (its post-step work is over)
                        self._read_for_round(key, "end-of-training")
                self._steps.cv.wait(0.05)

    def _quiesce(self) -> None:
        """Runs inside ``torch.distributed.destroy_process_group()`` (every rank), before the groups go.

        Waits (bounded) for the flag reduction launched at the last iteration's
        end — every rank launched the same number, so this cannot deadlock — and
        for an in-flight periodic upload, then destroys the hook's own groups.
        From then on the hook is "after teardown": no collective is launched, and
        a notice only logs ``notice_after_last_step`` at exit.
        """
        if not self._life.mark_torn_down():
            return
        stop_watch(getattr(self, "_peers", None))  # before any group is destroyed
        self._bg_on = False
        if self._bg is not None:  # wait (bounded) for a round in flight, unless we are leaving
            leaving = self._life.leaving()
            if not leaving:
                self._serve_last_round(QUIESCE_AGREEMENT_TIMEOUT / 2)
                if self._life.exit_pending():
                    # the round it served committed: leave now, from this thread (teardown, Preempted out of
                    # destroy_process_group(); its own destroy finds this hook torn down), not after the agreement
                    # thread's EXIT_GRACE (~1 s later)
                    self._exit_if_requested()
            self._bg.close(0.0 if leaving else QUIESCE_AGREEMENT_TIMEOUT / 2)
            if not self._bg.busy.is_set():
                destroy_group(self._bg.group)
                self._bg.group = None
        self._life.note_last_reduction(self._agree.drop(QUIESCE_AGREEMENT_TIMEOUT) if self._agree.pending else None)
        if self._periodic is not None:  # leaving after a notice: never wait out an upload
            self._periodic.quiesce(5.0 if self._life.exiting else QUIESCE_PERIODIC_TIMEOUT, cancel=self._life.exiting)
        destroy_group(self._group)
        # Drop our last references so the C++ group is destroyed now (torch releases the GIL
        # there and joins gloo's worker threads) rather than during interpreter shutdown,
        # where a worker thread still freeing a finished work dies in pthread_exit and the
        # process aborts with -6 ("terminate called without an active exception").
        self._group = None
        self._agree.group = None
