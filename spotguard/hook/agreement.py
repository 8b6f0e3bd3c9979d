"""Acting on an agreed level: share the notice, plan the action, carry it out.

After every rank has read the same agreed (level, earliest deadline), each
enters ``_plan`` (all-gather of the notice to act on, the ``agreed`` log line)
and ``_carry_out`` (exit, emergency save + exit, or an ordinary save). Split
so that a framework adapter can let its trainer write between the two.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any, Optional

import torch.distributed as dist

from ..notice import Notice
from ..timefmt import utcnow
from . import events as ev
from .dist import (
    NO_DEADLINE_MS,
    group_alive,
    set_group_timeout,
)
from .save import _Result
from .settings import _ACTIONS, LEVEL_EMERGENCY, LEVEL_REPLAY, SIGNAL_GRACE, _ms
from .state import Snapshot


class AgreementMixin:
    """Part of ``Hook`` (``core.py``); see the module docstring."""

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
