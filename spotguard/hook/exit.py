"""Leaving: bounded teardown, exit code, ``Preempted``; the process-exit and destroy guards.

Exit codes: ``exit_code`` (143) when this run's state is committed (or there
was nothing to save), ``EXIT_SAVE_FAILED`` (75) when the save failed.
"""

from __future__ import annotations

import gc
import os
import signal
import sys
from typing import Any, NoReturn, Optional

from ..notice import Notice
from . import events as ev
from .dist import (
    destroy_group,
    group_alive,
    run_bounded,
    teardown,
)
from .save import _Result
from .settings import (
    EXIT_SAVE_FAILED,
    QUIESCE_AGREEMENT_TIMEOUT,
    QUIESCE_PERIODIC_TIMEOUT,
)


class Preempted(SystemExit):
    """Raised after the emergency checkpoint (or its failure): the process should exit so the launcher restarts it."""

    def __init__(self, code: int = 143, *, notice_id: str | None = None, step: int | None = None,
                 uri: str | None = None, committed: bool = False) -> None:
        super().__init__(code)
        self.notice_id = notice_id
        self.step = step
        self.uri = uri
        self.committed = committed



class ExitMixin:
    """Part of ``Hook`` (``core.py``); see the module docstring."""

    def emergency_exit(self, notice: Notice, step: int) -> NoReturn:
        """Write the emergency checkpoint for ``notice`` as completed iteration ``step`` now, then exit.

        For engines that decide themselves when to act on a notice their
        ``on_notice`` deferred (torchft: only when every replica group leaves);
        every rank of this process group calls it at the same boundary.
        """
        self._count = step
        self._internal = True
        self._exit(notice, self._save(notice, "emergency", None))

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
