"""What every framework adapter shares: the core ``Hook`` with the framework writing the checkpoint.

An adapter *is* a ``spotguard.hook.core.Hook`` over an empty state dict, so it
reuses, unchanged: the notice intake (daemon socket), the SIGTERM/SIGUSR1
handlers, the non-blocking agreement on the hook's own gloo group, the commit
protocol (``prepare_attempt`` -> every rank writes -> all-ok barrier -> rank 0
commits -> commit barrier), the bounded teardown, replay detection and the
timeline events. What differs per framework:

- **when** the iteration boundary is: the framework's own batch/step-end
  callback instead of optimizer hooks (``_framework_boundary``);
- **how** the checkpoint is written: ``_write(key, snap)`` lets the framework
  write its native folder (``trainer.save_checkpoint``, ``Trainer._save_checkpoint``,
  ``Accelerator.save_state``) straight into a local store, or into a staging
  folder that is uploaded with ``Storage.write_bytes`` for object stores;
- **how** it is loaded: ``latest()`` gives the path the framework's own
  resume argument takes (downloaded to a local cache for object stores).

The core is armed (``Hook.__init__``) once ``torch.distributed`` is
initialised, because several frameworks create the process group inside
``fit``/``train``: before that there is no rank and no group to agree on.
"""

from __future__ import annotations

import contextlib
import os
import pathlib
import time
from typing import Any, Callable, Iterator, Optional

import torch.distributed as dist

from ...notice import Notice
from ...logs import get_logger
from ...storage import Storage, StorageError, open_storage
from ...storage.verify import latest_verified
from .. import events as ev
from ..core import Hook, periodic_notice
from ..preflight import probe_writable, unwritable_message

__all__ = ["FrameworkHook"]


def _configure_logging() -> None:
    import structlog

    from ...logs import configure_logging

    if not structlog.is_configured():
        configure_logging(os.environ.get("SPOTGUARD_LOG_FORMAT", "json"), os.environ.get("SPOTGUARD_LOG_LEVEL", "info"))


class FrameworkHook(Hook):
    """Base of the Lightning / Hugging Face / Accelerate adapters (see the module docstring)."""

    framework = "framework"
    _launcher_check = False  # the trainer creates the process group itself (inside fit/train)
    # The framework writes its own checkpoint between two of its callbacks: notices are agreed and
    # written at the framework's step boundary (the core's boundary path), not in the background.
    _background_capable = False
    # DeepSpeed (the engine, Lightning's strategy): the reduction a boundary launches is read there at once
    # (``_framework_boundary``), so a notice is written for the step it arrived in, not one step later.
    _read_at_boundary = False

    def __init__(
        self,
        storage: str | Storage | None = None,
        *,
        socket: str | None = None,
        keep: int | None = None,
        exit_code: int = 143,
        on_notice: Callable[[Notice], Any] | None = None,
        arm: bool = True,
        every: float | None = None,
    ) -> None:
        if keep is not None and (isinstance(keep, bool) or not isinstance(keep, int) or keep < 1):
            raise ValueError(f"keep must be a positive integer or None, got {keep!r}")
        if isinstance(exit_code, bool) or not isinstance(exit_code, int) or not 0 <= exit_code <= 255:
            raise ValueError(f"exit_code must be an integer in 0..255, got {exit_code!r}")
        _configure_logging()
        self._storage = storage if isinstance(storage, Storage) else open_storage(storage)
        self._armed = False
        if not (arm or (dist.is_available() and dist.is_initialized())):
            # Arming (with its collective probe) waits for the trainer's process group: probe this
            # rank's access now, so a wrong path or missing credentials fail at install.
            err = probe_writable(self._storage)
            if err:
                rank = int(os.environ.get("RANK", "0") or 0)
                raise StorageError(unwritable_message(self._storage.uri, [(rank, err)]))
            self._probed = True
        self._init_kw: dict[str, Any] = dict(socket=socket, keep=keep, exit_code=exit_code, on_notice=on_notice)
        # (local path handed to the framework, step, notice id of its commit record, storage folder, lineage)
        self._latest: Optional[tuple[str, int, Optional[str], str, Optional[str]]] = None
        self._last_boundary: Optional[int] = None
        self._finished = False  # the last optimizer step is done: evaluation after it is not acted on
        self._early: list[Notice] = []  # notify() before the core is armed
        # every=: the framework writes its own checkpoint at a boundary (synchronously: its format
        # cannot be staged and uploaded in the background like the plain hook's DCP state).
        from .. import parse_every  # noqa: PLC0415 - the package imports this module

        self._every: Optional[float] = parse_every(every)
        self._every_due = float("inf")
        if arm:
            self._arm()

    # ------------------------------------------------------------------ arming

    def _arm(self, state: Optional[dict[str, Any]] = None) -> None:
        """Start the core (signals, intake, gloo group): every rank, once, after init_process_group."""
        if self._armed:
            return
        Hook.__init__(self, state or {}, self._storage, **self._init_kw)
        self._armed = True
        self._restart_every()
        early, self._early = self._early, []
        for notice in early:
            self._receive(notice, via="api")

    @property
    def armed(self) -> bool:
        return self._armed

    # ------------------------------------------------------------------ public

    def latest(self) -> Optional[str]:
        """What the framework's resume argument takes for the newest committed checkpoint, or None.

        Object stores: the committed folder is downloaded to ``$SPOTGUARD_CACHE``
        (default ``~/.cache/spotguard``) first; a complete copy there is reused.
        """
        log = getattr(self, "_log", None) or get_logger("spotguard.hook", component="hook")  # before arming too
        found = latest_verified(self._storage, log)  # a damaged one is skipped for the previous
        if found is None:
            self._latest = None
            return None
        info, folder = found
        target = str(self._resume_target(pathlib.Path(folder)))
        rec = info.record
        self._latest = (target, info.step, rec.notice_id if rec else None, info.dir,
                        (rec.extra.get("lineage") if rec else None) or None)
        return target

    def notify(self, notice: Notice) -> None:
        """Hand the hook a notice yourself; kept until the core is armed if it is not yet."""
        if not self._armed:
            self._early.append(notice)
            return
        super().notify(notice)

    def close(self) -> None:
        if self._armed:
            super().close()

    def resume(self) -> int:  # the framework resumes itself
        raise TypeError(
            f"the {self.framework} adapter resumes through the framework: pass hook.latest() to its resume "
            "argument (see docs/frameworks.md); hook.resume() is for the plain-PyTorch dict"
        )

    def range(self, total: int) -> Any:
        raise TypeError(f"hook.range() is for the plain-PyTorch dict; the {self.framework} trainer owns the loop")

    # ------------------------------------------------------------ every=

    def _restart_every(self) -> None:
        if self._every is not None:
            self._every_due = time.monotonic() + self._every

    def _periodic_flags(self) -> tuple[int, int]:
        """(due, busy) for the flag reduction: due once ``every`` seconds passed since the last commit."""
        if self._every is None or self._life.detached():
            return 0, 0
        return (1 if time.monotonic() >= self._every_due else 0), 0

    def _maybe_periodic(self, snap: Any) -> None:
        """At a boundary with no notice and some rank due: every rank writes the framework's checkpoint now."""
        if self._every is None or self._life.detached() or not self._agree.flags[0]:
            return
        self._internal = True
        try:
            self._carry_out((periodic_notice(self._steps.count), [], "periodic"), snap)
        finally:
            self._internal = False
        self._restart_every()  # also after a failure: retry one period later, not at every step

    def _finish_ok(self, notice: Notice, step: int, uri: str, nbytes: int, t0: float, already: bool = False) -> Any:
        res = super()._finish_ok(notice, step, uri, nbytes, t0, already)
        self._restart_every()
        return res

    # ------------------------------------------------------------ for subclasses

    def _resume_target(self, folder: pathlib.Path) -> pathlib.Path:
        """The path inside a committed folder that the framework's resume argument wants (default: the folder)."""
        return folder

    def _started(self, step: int, resumed_from: Optional[str]) -> None:
        """The framework restored its state and is about to train (every rank): log it, agree once.

        Like ``Hook.resume``: the notice the resumed checkpoint was written for is
        remembered, so that the daemon replaying it to the restarted process makes
        every rank exit at once instead of training and saving again.
        """
        self._steps.set_count(step)
        self._resumed_step = step
        self._last_boundary = step
        from_notice = None
        uri = None
        if resumed_from is not None and self._latest is not None and \
                os.path.realpath(resumed_from) == os.path.realpath(self._latest[0]):
            from_notice = self._latest[2]
            uri = f"{self._storage.uri}/{self._latest[3]}"
            self._resumed_dir = self._latest[3]
            if self._latest[4]:
                self._lineage = self._latest[4]
        elif resumed_from is not None:
            uri = str(resumed_from)
        if from_notice:
            self._committed_ids.add(from_notice)
        self._resumed = True
        if resumed_from is None:
            self._warn_unresumed()
        self._loop.check_fresh()
        self._log.info(ev.RESUMED, step=step if resumed_from else 0, uri=uri, from_notice_id=from_notice,
                       seconds=0.0, framework=self.framework)
        self._agree_at_start()

    def _framework_boundary(self, step: int, *, final: bool = False) -> None:
        """End of an optimizer step as the framework reports it (every rank, same step numbers).

        Waits the reduction launched at the previous boundary (finished long
        ago), acts on it (an emergency never returns: ``Preempted``), then launches
        this step's. Boundaries where the step did not advance (gradient
        accumulation micro-batches) are skipped, so a checkpoint is never taken
        with half-accumulated gradients.
        """
        if self._life.closing():
            return
        if self._last_boundary is not None and step == self._last_boundary and not final:
            return
        self._last_boundary = step
        self._finished = final
        self._steps.set_count(step)
        self._explicit_boundary(final=final)
        if self._read_at_boundary and not final:
            self._read_now()

    def _read_now(self) -> None:
        """The reduction this boundary launched, read at once: act at this step, not the next.

        Why only where ``_read_at_boundary``: a DeepSpeed step ends with ZeRO's collectives, so the ranks leave
        it together and a blocking MAX of three integers costs one small round trip, against a whole step
        (seconds on a fine-tuning job) that a notice otherwise waits for the reduction to be read at the next
        boundary. Every rank reads it at the same boundary, so they still act at the same step."""
        if self._life.over() or not self._agree.pending:
            return
        res = self._agree.collect()
        if res is not None and res[0] > 0:
            self._act(res[0], res[1], snap=None, final=False)
        elif res is not None:
            self._maybe_periodic(None)

    def _framework_eval_batch(self) -> None:
        """A batch of the framework's evaluation inside training (every rank, once per batch; frameworks
        give every rank the same number of evaluation batches).

        Evaluation changes neither weights nor optimizer state, so the state is still that of the
        last completed step (``self._steps.count``): the reduction launched at the previous boundary or
        evaluation batch is collected and an agreed notice is carried out now for that step (an
        emergency never returns: ``Preempted``), instead of after the whole evaluation. Then a new
        reduction is launched, carrying notices only: a periodic ``every=`` checkpoint waits for the
        next training boundary. Not before training started (sanity checks) nor after its last step.
        """
        if self._life.over() or self._last_boundary is None or self._finished:
            return
        res = self._agree.collect()
        if res is not None and res[0] > 0:
            self._act_in_eval(res[0], res[1])
        level, deadline_ms = self._eval_level()
        self._agree.launch(level, deadline_ms)

    def _eval_level(self) -> tuple[int, int]:
        """What this rank carries into an evaluation batch's reduction; adapters with a background path narrow it."""
        return self._local_level()

    def _act_in_eval(self, level: int, deadline_ms: int) -> None:
        """Carry out an agreed notice during evaluation; adapters whose framework must write first override it."""
        self._act(level, deadline_ms, snap=None, final=False)

    def _framework_microbatch(self) -> None:
        """A micro-batch of gradient accumulation ended without an optimizer step (every rank, same count).

        Weights, optimizer and scheduler are still those of the last completed step S
        (``self._steps.count``); what moved since S (RNG, running statistics, the framework's
        loop position) the adapter puts back for the duration of the save
        (``_rewound``). So an agreed notice is carried out one micro-batch after it was
        agreed, not at the end of the accumulation (which can be minutes away): the
        micro-batches after S are thrown away and recomputed after the resume. Same
        collect-then-launch rhythm as a boundary (one non-blocking reduction per
        micro-batch); periodic ``every=`` saves wait for the next optimizer step (their votes are
        carried to it).
        """
        if self._life.over() or self._last_boundary is None or self._finished:
            return
        self._tick()  # the deadline_at_risk estimate: the next point to act at is a micro-batch away, not a step
        res = self._agree.collect()
        if res is not None and res[0] > 0:
            with self._rewound():
                self._act_in_microbatch(res[0], res[1])
        level, deadline_ms = self._local_level()
        # every=: a rank's "due" rides along (not acted on here), so the optimizer step's collect still sees it
        self._agree.launch(level, deadline_ms, self._periodic_flags())

    def _act_in_microbatch(self, level: int, deadline_ms: int) -> None:
        """Carry out an agreed notice between two micro-batches (inside ``_rewound``); default as in evaluation."""
        self._act_in_eval(level, deadline_ms)

    @contextlib.contextmanager
    def _rewound(self) -> Iterator[None]:
        """The state that moved since the last optimizer step put back as it was then, for one save.

        Adapters that call ``_framework_microbatch`` override it (RNG, running-stat
        buffers, loop counters captured at the step's end); the live values are
        restored on the way out, also when the save raises."""
        yield
