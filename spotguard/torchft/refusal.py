"""torchft loops the leave vote cannot ride on, refused when the guard is built or at the first step.

Why refuse, not support (issue 25): torchft's ``LocalSGD`` and ``DiLoCo`` call ``manager.should_commit()``
inside the inner optimizer's step post-hook every ``sync_every`` steps, so ``ReplicaGuard.vote()`` never
runs and a noticed group cannot leave at a committed step. Between two syncs every group trains on its own
(its parameters drift, its inner optimizer state and data position are its own and are never synchronised),
so a whole-job checkpoint written by one group cannot resume the others exactly: that needs each group's
inner state in storage (per-replica-group shards), and a deadline fallback between syncs needs a copy of
the last sync's state. Before, this was said only at the notice (``replica_not_voting``), when the job had
trained for hours with a guard that could not act; now ``ReplicaGuard(...)`` raises, or the first optimizer
step does when ``LocalSGD``/``DiLoCo`` is entered after it, and any ``should_commit()`` not preceded by
``vote()`` (torchft's own ``OptimizerWrapper``, a hand-written loop that forgot it) raises at that call.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, Optional

__all__ = ["REFUSED", "UnsupportedLoop", "CommitGate", "StepCheck", "local_sync_in_use", "refusal",
           "wrapper_in_state"]

REFUSED = "replica_refused"  # what, why, fix: a loop the leave vote cannot ride on (then UnsupportedLoop)

_WHY_LOCAL = ("{what} calls manager.should_commit() inside the inner optimizer's post-hook every sync_every "
              "steps, so the leave vote never runs and a noticed group cannot leave at a committed step; between "
              "syncs each group's parameters, inner optimizer state and data position are its own, so one "
              "group's checkpoint cannot resume the others exactly")
_FIX_LOCAL = ("train with per-step commits (guard.optimizer(opt), gradients all-reduced through the manager or "
              "torchft's DDP), or run LocalSGD/DiLoCo without ReplicaGuard (docs/torchft.md, Limits)")
_WHY_UNVOTED = ("manager.should_commit() was called without guard.vote() before it (torchft's OptimizerWrapper, "
                "LocalSGD/DiLoCo on an optimizer the guard does not hold, or a loop of your own): the step would "
                "commit without the leave vote, so a noticed group could not leave at a committed step")
_FIX_UNVOTED = ("use guard.optimizer(opt), or call guard.vote() right before every manager.should_commit() "
                "and guard.after_step(committed) after it")
_WHY_WRAPPER = ("torchft's OptimizerWrapper in the guard's dict commits each step with manager.should_commit() "
                "and no leave vote before it, so a noticed group could not leave at a committed step")
_FIX_WRAPPER = ("put the inner optimizer in the dict and train with guard.optimizer(inner) in place of "
                "OptimizerWrapper(manager, inner): it starts the quorum, votes and commits the same way")


class UnsupportedLoop(RuntimeError):
    """The training loop commits steps where ``ReplicaGuard`` cannot vote (``what``, ``why``, ``fix``)."""

    def __init__(self, what: str, why: str, fix: str) -> None:
        super().__init__(f"spotguard ReplicaGuard cannot guard this loop ({what}): {why}. Fix: {fix}")
        self.what, self.why, self.fix = what, why, fix


def _local_sync_owner(hook: Any, manager: Any) -> Optional[str]:
    """The class name when ``hook`` is a bound method of torchft's LocalSGD/DiLoCo (or a subclass) on this
    ``manager`` (every optimizer of the process is looked at: another manager's loop is none of this guard's)."""
    owner = getattr(hook, "__self__", None)
    if owner is None or getattr(owner, "_manager", manager) is not manager:
        return None
    try:
        from torchft.local_sgd import DiLoCo, LocalSGD  # noqa: PLC0415
    except ImportError:  # pragma: no cover - torchft is what this engine runs on
        return None
    for cls in (LocalSGD, DiLoCo):
        if isinstance(owner, cls):
            return cls.__name__
    return None


def local_sync_in_use(manager: Any, optimizers: Iterable[Any]) -> Optional[str]:
    """``"LocalSGD"``/``"DiLoCo"`` when one is attached to these optimizers (its step hooks, registered at
    ``__enter__``) or DiLoCo was built on this manager (it registers ``StreamingDiLoCoFragment_*`` state)."""
    for opt in optimizers:
        for hooks in (getattr(opt, "_optimizer_step_pre_hooks", {}), getattr(opt, "_optimizer_step_post_hooks", {})):
            for h in list(hooks.values()):
                name = _local_sync_owner(h, manager)
                if name is not None:
                    return name
    keys = getattr(manager, "_user_state_dicts", None) or {}
    if any(str(k).startswith("StreamingDiLoCoFragment_") for k in list(keys)):
        return "DiLoCo"
    return None


class CommitGate:
    """Wraps the manager's ``should_commit`` (an instance attribute, one gate per manager, shared by the guards
    on it): a call that no ``vote()`` armed is refused, whoever makes it. ``vote()`` arms it; each
    ``should_commit`` disarms it. It stands while one of its guards is open; once the last one closed it
    passes every call through (a wrapper installed over it afterwards still calls it)."""

    def __init__(self, manager: Any, unvoted: Callable[[], None]) -> None:
        self.manager = manager
        self.armed = False
        self._users: list[Callable[[], None]] = [unvoted]  # the open guards' refusals (the newest speaks)
        self._had_own = "should_commit" in vars(manager)  # a wrapper set before the gate: close() restores it
        self._real = manager.should_commit

        def should_commit(*args: Any, **kwargs: Any) -> Any:
            if self._users and not self.armed:
                self._users[-1]()  # raises UnsupportedLoop
            self.armed = False
            return self._real(*args, **kwargs)

        should_commit.__spotguard_gate__ = self  # type: ignore[attr-defined]
        manager.should_commit = should_commit

    @classmethod
    def on(cls, manager: Any, unvoted: Callable[[], None]) -> tuple["CommitGate", bool]:
        """The manager's gate: the one an earlier guard installed (now this guard's too), else a new one."""
        gate = getattr(getattr(manager, "should_commit", None), "__spotguard_gate__", None)
        if isinstance(gate, CommitGate) and gate._users:
            gate._users.append(unvoted)
            return gate, False
        return cls(manager, unvoted), True

    def release(self, unvoted: Callable[[], None]) -> None:
        """A guard's ``close()``: the last open guard gives the manager its ``should_commit`` back."""
        if unvoted in self._users:
            self._users.remove(unvoted)
        if self._users:
            return
        self.armed = False
        if getattr(getattr(self.manager, "should_commit", None), "__spotguard_gate__", None) is self:
            if self._had_own:
                self.manager.should_commit = self._real
            else:
                try:
                    del self.manager.should_commit
                except AttributeError:
                    self.manager.should_commit = self._real


def wrapper_in_state(state: Any) -> Optional[str]:
    """The key of a torchft ``OptimizerWrapper`` in the guard's dict (its ``step()`` commits without the vote,
    and it is an ``Optimizer`` whose ``__init__`` never ran: no step hooks can be put on it)."""
    try:
        from torchft.optim import OptimizerWrapper  # noqa: PLC0415
    except ImportError:  # pragma: no cover - torchft is what this engine runs on
        return None
    for key, value in dict(state).items():
        if isinstance(value, OptimizerWrapper):
            return str(key)
    return None


def refusal(what: Optional[str]) -> tuple[str, str, str]:
    """(what, why, fix) for a LocalSGD/DiLoCo loop (``what`` its class name) or, with None, a
    ``should_commit()`` that no vote preceded."""
    if what == "OptimizerWrapper":
        return what, _WHY_WRAPPER, _FIX_WRAPPER
    if what is not None:
        return what, _WHY_LOCAL.format(what=what), _FIX_LOCAL
    return "should_commit without vote", _WHY_UNVOTED, _FIX_UNVOTED


class StepCheck:
    """At each optimizer step (the guard's pre-hook), look again for LocalSGD/DiLoCo only when the
    optimizer's hooks or the manager's state callbacks changed since the last look (a few ``len()`` calls)."""

    def __init__(self, manager: Any) -> None:
        self.manager = manager
        self._seen: dict[int, tuple[int, int, int]] = {}

    def __call__(self, optimizer: Any) -> Optional[str]:
        sig = (len(getattr(optimizer, "_optimizer_step_pre_hooks", ())),
               len(getattr(optimizer, "_optimizer_step_post_hooks", ())),
               len(getattr(self.manager, "_user_state_dicts", None) or ()))
        if self._seen.get(id(optimizer)) == sig:
            return None
        found = local_sync_in_use(self.manager, (optimizer,))
        if found is None:  # a refused loop that goes on (the error caught) is refused again at its next step
            self._seen[id(optimizer)] = sig
        return found
