"""Notices into the hook: daemon intake, SIGTERM/SIGUSR1, bookkeeping and the local level.

Every source (daemon socket thread, signal handler, ``Hook.notify``) ends in
``_receive``, which records the notice in ``_pending`` under a lock; the
training side only reads the local level (``_local_level``: a dict truth test
when nothing is pending). Levels: 0 nothing, 1 ordinary checkpoint
(rebalance/maintenance), 2 emergency (preemption/termination, signals),
3 a replay of the notice the newest committed checkpoint was written for.
"""

from __future__ import annotations

import os
import signal
import socket as _socket
import threading
import time
from datetime import timedelta
from typing import Any, Optional

from ..notice import Notice
from ..timefmt import to_rfc3339, utcnow
from . import events as ev
from .dist import (
    NO_DEADLINE_MS,
)
from .settings import (
    EMERGENCY_LEAD,
    LEVEL_CHECKPOINT,
    LEVEL_EMERGENCY,
    LEVEL_NONE,
    LEVEL_REPLAY,
    SIGNAL_GRACE,
    _ms,
)


class NoticesMixin:
    """Part of ``Hook`` (``core.py``); see the module docstring."""

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
                self._life.keep_handler(sig, signal.getsignal(sig))
                signal.signal(sig, self._on_signal)
            except (ValueError, OSError) as exc:
                self._log.warning("cannot install signal handler", signal=int(sig), error=str(exc))

    def _on_signal(self, signum: int, frame: Any) -> None:
        """Runs in the main thread between bytecodes: only hand off (no locks, no I/O here)."""
        if not self._life.closing():
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
        prev = self._life.prev_handler(signum)
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
        life = getattr(self, "_life", None)
        if life is not None and life.detached() and not life.exiting:
            # the loop is over (destroy_process_group() or close() came first): nothing is left to agree on or
            # to save, and no exit hook will look at this notice again — say so now (the oracle found a notice
            # 65 ms after the last step that left no line at all)
            self._log.info(ev.NOTICE_AFTER_LAST_STEP, notice_id=notice.id, step=self._steps.count,
                           why="the training loop had ended: destroy_process_group() or hook.close() came first")
            return
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
        if self._bg_on:
            self._arm_wake(notice)
        elif notice.emergency:
            self._warn_if_boundary_too_far(notice)

    def _warn_if_boundary_too_far(self, notice: Notice) -> None:
        """Boundary path: say at once when the iteration boundary (plus the save) is further off than the
        deadline — the commit would be late, and the user learns it now rather than from a lost VM."""
        last, took = getattr(self, "_boundary_at", None), getattr(self, "_iteration_seconds", None)
        if last is None or took is None:
            return  # no iteration timed yet
        into = time.monotonic() - last
        wait = max(0.0, took - into) + (took if self._dist else 0.0)  # + one boundary for the flag reduction
        estimate = wait + float(getattr(self, "_last_save_seconds", None) or 1.0)
        left = notice.seconds_left()
        if estimate > left:
            self._log.warning(ev.DEADLINE_AT_RISK, notice_id=notice.id, seconds_left=round(left, 3),
                              estimate=round(estimate, 3), iteration_seconds=round(took, 3),
                              why="this loop is acted on at iteration boundaries, and the next one plus the save "
                                  "is further off than the deadline",
                              fix="a loop the hook can act in at any moment (docs/api.md, the per-pattern table), "
                                  "shorter iterations, or a periodic checkpoint (every=)")

    def _arm_wake(self, notice: Notice) -> None:
        """Background mode: wake every rank's agreement thread now, or at ``deadline - EMERGENCY_LEAD``."""
        bg = self._bg
        if bg is None:
            return
        level = self._level_of(notice)
        if level > 0:
            if bg.busy.is_set():
                if level >= LEVEL_EMERGENCY and self._round_action == "checkpoint":
                    self._log.info("an emergency pre-empts the ordinary checkpoint in flight", notice_id=notice.id)
                    self._ordinary_cancel.set()  # the next round saves the emergency's step instead
                    bg.cancel_round()  # ... on every rank
                self._bound_running_round(notice, level)
            bg.wake(_ms(notice.deadline))
        elif notice.emergency and notice.id not in self._committed_ids:
            bg.wake_at(notice.seconds_left() - EMERGENCY_LEAD, _ms(notice.deadline))

    def _bound_running_round(self, notice: Notice, level: int) -> None:
        """A notice that arrives while a round runs (woken by another, maybe far-off, notice): the round's
        holds are bounded by this notice's deadline from now on, and an emergency whose deadline comes before
        the round is over ends the process there (exit 75, nothing committed for it) instead of waiting for
        a round whose peer may never join."""
        from .agreement import _round_end  # noqa: PLC0415 - agreement imports this module's users

        end = _round_end(_ms(notice.deadline))
        if not self._steps.shorten_hold(end):
            return
        if level < LEVEL_EMERGENCY:
            return
        bg = self._bg
        gen = bg.gen

        def overdue() -> None:
            if bg.gen != gen or not bg.busy.is_set() or self._life.leaving():
                return  # that round is over: the next one acts on this notice
            from .save import _Result  # noqa: PLC0415

            self._exit_from_background(notice, _Result(committed=False, peers_ok=False, error=(
                f"the running agreement round did not finish before the deadline of notice {notice.id}")),
                None, lost_where="agreement")

        t = threading.Timer(max(0.0, end - time.monotonic()), overdue)
        t.daemon = True
        t.name = "spotguard-round-deadline"
        t.start()

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

    def _doomed_here(self) -> bool:
        """Whether this rank holds a notice that its VM is going (an emergency, whatever its deadline): the
        save plan then gives the replicated items to the ranks without one (``doomed.py``)."""
        with self._lock:
            return any(n.emergency for n in self._pending.values())

    def _best_local(self) -> Optional[tuple[int, int, dict[str, Any]]]:
        with self._lock:
            notices = list(self._pending.values())
        if not notices:
            return None
        n = max(notices, key=lambda x: (self._level_of(x), -_ms(x.deadline)))
        return self._level_of(n), _ms(n.deadline), n.to_wire()

    def _forget(self, ids: list[str]) -> None:
        with self._lock:
            for i in ids:
                self._pending.pop(i, None)
                self._seen.add(i)

    def _timing(self, notice: Notice) -> dict[str, float]:
        now = utcnow()
        return {
            "seconds_since_notice": round((now - notice.received_at).total_seconds(), 3),
            "seconds_left": round((notice.deadline - now).total_seconds(), 3),
        }
