"""Lightning adapter (``lightning.pytorch`` and ``pytorch_lightning``): one callback.

Life cycle (every rank):

- ``install_preemption_hook(trainer)`` appends ``SpotguardCallback`` to
  ``trainer.callbacks`` and, when a committed checkpoint exists, sets
  ``trainer.ckpt_path`` to it (automatic resume). ``trainer.fit(model,
  ckpt_path=hook.latest())`` works as well (the same file; Lightning's
  "two paths" warning is silenced for exactly that case).
- ``setup``: Lightning has initialised ``torch.distributed`` -> the core arms
  (its gloo group, SIGTERM/SIGUSR1 handlers, daemon intake).
- ``on_train_start``: Lightning has restored the checkpoint and installed its
  own SIGTERM handler; spotguard takes SIGTERM/SIGUSR1 back (see "SIGTERM"
  below), logs ``resumed`` and agrees once (replayed notice -> exit at once).
- ``on_train_batch_start`` (first batch after a resume): restores this rank's
  RNG states saved in the checkpoint (Lightning does not save RNG).
- ``on_train_batch_end``: the iteration boundary (optimizer and step-interval
  schedulers have stepped, exactly where Lightning's ``ModelCheckpoint`` saves
  mid-epoch): the agreement launched one boundary earlier is waited; if any
  rank asked, ``trainer.save_checkpoint`` writes ``step-N/lightning.ckpt``
  into spotguard storage (all ranks call it, rank 0 writes, as Lightning
  requires), it is committed, ``trainer.should_stop`` is set and ``Preempted``
  (``SystemExit``) is raised out of ``trainer.fit``.
- ``on_validation_batch_end`` (validation inside ``fit``): the same agreement,
  once per validation batch, acted on at once for the last completed step
  (validation changes no weights): a notice during a long validation loop
  commits and exits without waiting for the loop to end.

SIGTERM: Lightning 2.x's own handler (``_SignalConnector``) broadcasts on the
default process group *from inside the signal handler* and then raises
``SIGTERMException`` on the ranks that saw the signal at the next batch
boundary: a SIGTERM that reaches one rank leaves the other blocked in DDP's
all-reduce. While ``fit`` runs, spotguard therefore re-installs its own
handler over Lightning's at ``on_train_start``; ``trainer.received_sigterm``
stays False and Lightning's per-batch broadcast of it keeps seeing 0.
spotguard's handler chains to the handler that was installed *before*
spotguard (not to Lightning's). Lightning restores the handlers it found when
``fit`` ends, spotguard restores its predecessor when it closes.
"""

from __future__ import annotations

import importlib
import pathlib
import re
import shutil
import signal
import threading
import warnings
from typing import Any, Optional

import torch.distributed as dist

from ...notice import Notice
from ...storage import Storage
from ..elastic import derive_rng
from ..events import ELASTIC_RESUME
from ..state import capture_rng, pack, restore_rng, unpack
from ._base import FrameworkHook
from ._files import report_local, staging_dir, upload_dir

__all__ = ["LightningHook", "install", "CKPT_NAME"]

CKPT_NAME = "lightning.ckpt"
STATE_KEY = "spotguard"


def _root_package(trainer: Any) -> str:
    """``lightning.pytorch`` or ``pytorch_lightning``: whichever package the trainer's class comes from."""
    for cls in type(trainer).__mro__:
        mod = cls.__module__
        if mod.startswith("lightning.pytorch."):
            return "lightning.pytorch"
        if mod.startswith("pytorch_lightning."):
            return "pytorch_lightning"
    raise TypeError(f"{type(trainer).__qualname__} is not a Lightning Trainer")


def _make_callback(base: type, hook: "LightningHook") -> Any:
    class SpotguardCallback(base):  # type: ignore[misc, valid-type]
        """spotguard's preemption callback (see spotguard.hook.adapters.lightning)."""

        def __init__(self) -> None:
            super().__init__()
            self.hook = hook

        @property
        def state_key(self) -> str:
            return "SpotguardCallback"

        def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
            if stage == "fit":
                hook._arm()

        def on_train_start(self, trainer: Any, pl_module: Any) -> None:
            hook._reclaim_signals()
            hook._started(int(trainer.global_step), trainer.ckpt_path)

        def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
            hook._restore_rng_once()

        def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
            step = int(trainer.global_step)
            final = trainer.max_steps is not None and trainer.max_steps > 0 and step >= trainer.max_steps
            hook._framework_boundary(step, final=final)

        def on_validation_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int,
                                    dataloader_idx: int = 0) -> None:
            if trainer.training or getattr(trainer.state, "fn", None) == "fit":
                hook._framework_eval_batch()

        def on_save_checkpoint(self, trainer: Any, pl_module: Any, checkpoint: dict[str, Any]) -> None:
            if hook._saving:
                checkpoint[STATE_KEY] = hook._gather_rng()

        def on_load_checkpoint(self, trainer: Any, pl_module: Any, checkpoint: dict[str, Any]) -> None:
            hook._pending_rng = checkpoint.get(STATE_KEY)

        def teardown(self, trainer: Any, pl_module: Any, stage: str) -> None:
            hook._release_ckpt_path()

    return SpotguardCallback()


class LightningHook(FrameworkHook):
    framework = "lightning"

    def __init__(self, trainer: Any, storage: str | Storage | None = None, *, socket: str | None = None,
                 keep: int | None = None, exit_code: int = 143,
                 on_notice: Optional[Any] = None, every: Optional[float] = None) -> None:
        root = _root_package(trainer)
        callback_cls = importlib.import_module(f"{root}.callbacks").Callback
        super().__init__(storage, socket=socket, keep=keep, exit_code=exit_code, on_notice=on_notice, arm=False,
                         every=every)
        self.trainer = trainer
        self._saving = False
        self._pending_rng: Optional[dict[str, Any]] = None
        self._auto_ckpt: Optional[str] = None
        self.callback = _make_callback(callback_cls, self)
        trainer.callbacks.append(self.callback)
        if dist.is_available() and dist.is_initialized():
            self._arm()
        self._arrange_resume()

    # ------------------------------------------------------------- resume

    def _resume_target(self, folder: pathlib.Path) -> pathlib.Path:
        return folder / CKPT_NAME

    def _arrange_resume(self) -> None:
        """Automatic resume: ``trainer.ckpt_path = <newest committed>`` unless the user set one."""
        if self.trainer.ckpt_path is not None:
            return
        path = self.latest()
        if path is None:
            return
        self.trainer.ckpt_path = path
        self._auto_ckpt = path
        # fit(ckpt_path=hook.latest()) names the same file: Lightning's "two paths" warning is noise then.
        warnings.filterwarnings("ignore", message=re.escape(f"`trainer.ckpt_path = {path!r}` was called but then you"))

    def _release_ckpt_path(self) -> None:
        """After fit, stop being 'user managed' so a later trainer.test() does not reload our checkpoint."""
        conn = getattr(self.trainer, "_checkpoint_connector", None)
        if self._auto_ckpt is not None and conn is not None and getattr(conn, "_user_managed", False) \
                and conn._ckpt_path == self._auto_ckpt:
            self.trainer.ckpt_path = None
        self._auto_ckpt = None

    # ------------------------------------------------------------- signals

    def _reclaim_signals(self) -> None:
        """Put spotguard's handler back over Lightning's (see the module docstring); predecessors unchanged."""
        if threading.current_thread() is not threading.main_thread() or self._closed:
            return
        for sig in list(self._prev_handlers):
            try:
                if signal.getsignal(sig) != self._on_signal:
                    signal.signal(sig, self._on_signal)
            except (ValueError, OSError):
                pass

    # ------------------------------------------------------------- RNG

    def _gather_rng(self) -> dict[str, Any]:
        """Every rank's RNG states (python, numpy, torch CPU/CUDA), gathered on the hook's gloo group."""
        mine = capture_rng()
        if self._dist:
            allv: list[Any] = [None] * self._world
            dist.all_gather_object(allv, mine, group=self._group)
        else:
            allv = [mine]
        # One opaque blob: Lightning loads checkpoints with torch.load(weights_only=True), which
        # refuses numpy's RNG state; bytes pass, and only spotguard unpacks them.
        return {"rng": pack(allv), "world_size": self._world}

    def _restore_rng_once(self) -> None:
        st, self._pending_rng = self._pending_rng, None
        if not st:
            return
        states = unpack(st["rng"]) if st.get("rng") else []
        if self._rank < len(states):  # the rank existed: its own streams (same rule as the plain hook)
            restore_rng(states[self._rank])
            how = "own"
        elif states:  # a new rank (the job grew): derived streams, never a copy of another rank's
            derive_rng(states[0], int(getattr(self.trainer, "global_step", 0)), self._rank)
            how = "derived"
        else:
            how = "none"
        if st.get("world_size") != self._world:
            self._log.info(ELASTIC_RESUME, old_world_size=st.get("world_size"), world_size=self._world, rng=how)

    # ------------------------------------------------------------- writing

    def _write(self, key: str, snap: Any) -> None:
        """All ranks call ``trainer.save_checkpoint`` (rank 0 writes, Lightning barriers)."""
        local = self._storage.local_path(key)
        stage = None
        if local is not None:
            target = pathlib.Path(local) / CKPT_NAME
        else:
            stage = staging_dir(f"lightning-{self._rank}")
            target = stage / CKPT_NAME
        self._saving = True
        try:
            self.trainer.save_checkpoint(str(target))
        finally:
            self._saving = False
        if stage is not None:
            try:
                if self._rank == 0:
                    upload_dir(self._storage, stage, key)
            finally:
                shutil.rmtree(stage, ignore_errors=True)
        elif self._rank == 0:  # written in place (rank 0 writes): report it for the commit record
            report_local(self._storage, key, select=lambda rel: rel == CKPT_NAME)

    def _exit(self, notice: Notice, result: Any) -> Any:
        self.trainer.should_stop = True
        return super()._exit(notice, result)


def install(trainer: Any, storage: Any = None, *, socket: str | None = None, every: Any = None,
            keep: int | None = None, exit_code: int = 143, on_notice: Any = None) -> LightningHook:
    return LightningHook(trainer, storage, socket=socket, keep=keep, exit_code=exit_code, on_notice=on_notice,
                         every=every)

