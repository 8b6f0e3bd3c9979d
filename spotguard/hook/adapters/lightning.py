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
- DDP or one device, one optimizer, automatic optimization, with or without
  accumulation (``lightning_anymoment.py``): **any moment**. ``on_before_optimizer_step``
  holds the next step while the agreement thread writes the last completed step S from
  the background (Lightning's own dict with S's step-end copies of RNG, buffers,
  loops and callbacks, taken at S's last micro-batch's ``on_train_batch_end``); the
  micro-batches after S are thrown away. Anything else (FSDP/DeepSpeed, manual
  optimization, several optimizers, ``every=``, accumulation with a validation between
  micro-batches, a notice after validation or an epoch end since S) takes the boundary
  path below and says why in ``notice_path``. Notice -> committed, 2 ranks, 64 MiB,
  10 s steps: docs/performance.md.
- ``on_train_batch_end`` (boundary path): the iteration boundary (optimizer and step-interval
  schedulers have stepped, exactly where Lightning's ``ModelCheckpoint`` saves
  mid-epoch): the agreement launched one boundary earlier is waited; if any
  rank asked, ``trainer.save_checkpoint`` writes ``step-N/lightning.ckpt``
  into spotguard storage (all ranks call it, rank 0 writes, as Lightning
  requires), it is committed, ``trainer.should_stop`` is set and ``Preempted``
  (``SystemExit``) is raised out of ``trainer.fit``.
- ``on_train_batch_end`` of a gradient-accumulation micro-batch (global step
  unchanged): also an agreement point, acted on for the last completed
  optimizer step S (see "Accumulation" below).
- ``on_validation_batch_end`` (validation inside ``fit``): the same agreement,
  once per validation batch, acted on at once for the last completed step
  (validation changes no weights): a notice during a long validation loop
  commits and exits without waiting for the loop to end.

Accumulation on the boundary path (the any-moment path handed over or refused): with
``accumulate_grad_batches`` > 1 the step boundary can be
minutes away, and Lightning writes its checkpoint from the training thread (no
background read as in the plain hook). At each step's end the callback takes
what the micro-batches after it move — this rank's RNG, the module's persistent
buffers (running statistics, spectral norm's ``_u``/``_v``), Lightning's loop progress (``checkpoint["loops"]``) and
the callbacks' ``state_dict``s; weights, optimizer, schedulers and the precision
plugin do not move until the next step. An agreed notice at a micro-batch's end
is saved with RNG and buffers put back to S and the loops/callbacks entries
replaced by S's in ``on_save_checkpoint`` (``_rewound``; live values restored
afterwards): the file a save at S's ``on_train_batch_end`` would have written,
so Lightning resumes at the first micro-batch of step S+1 and the thrown-away
micro-batches are recomputed. Not in the first accumulation of a run (no step
taken yet) nor of an epoch (epoch-end hooks and validation ran since S): there
the micro-batches stay out of the agreement on every rank alike and the step
boundary acts, as without accumulation.

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

import contextlib
import copy
import importlib
import pathlib
import re
import shutil
import signal
import threading
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional

import torch
import torch.distributed as dist

from ...notice import Notice
from ...storage import Storage
from ..elastic import derive_rng
from ..events import ELASTIC_RESUME
from ..state import capture_rng, pack, restore_rng, rng_and_buffers_at, unpack
from ..watch import SNAPSHOT_ALL_BUFFERS, model_snapshot_buffers
from ._base import FrameworkHook
from ._files import report_local, staging_dir, upload_dir
from .lightning_anymoment import STATE_KEY, AnyMomentMixin, own_save_hooks

__all__ = ["LightningHook", "install", "CKPT_NAME"]

CKPT_NAME = "lightning.ckpt"


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
            hook._lt_begin()  # lightning_anymoment.py: the optimizers exist now

        def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
            hook._lt_step_begin()  # the any-moment path's hold: the weights of the next step do not change yet

        def on_validation_start(self, trainer: Any, pl_module: Any) -> None:
            # held like an epoch end: a validation hook may change the weights in place (WeightAveraging swaps the
            # average in) while a round writes S from the background
            hook._lt_unsafe("validation ran since the last optimizer step", hold=True)

        def on_train_epoch_end(self, trainer: Any, pl_module: Any) -> None:
            hook._lt_unsafe("an epoch ended since the last optimizer step", hold=True)

        def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
            hook._restore_rng_once()
            hook._exit_if_requested()

        def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
            step = int(trainer.global_step)
            final = trainer.max_steps is not None and trainer.max_steps > 0 and step >= trainer.max_steps
            if hook._lt_step_end(step, final, hook._snapshot):
                return  # the any-moment path: the agreement thread acts
            if hook._last_boundary is not None and step == hook._last_boundary and not final:
                hook._microbatch()  # accumulation: no optimizer step in this batch
                return
            hook._remember_step(step, final)
            hook._framework_boundary(step, final=final)

        def on_validation_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int,
                                    dataloader_idx: int = 0) -> None:
            in_fit = trainer.training or getattr(trainer.state, "fn", None) == "fit"
            if hook._lt_any:
                hook._exit_if_requested()
                if in_fit and not getattr(trainer, "sanity_checking", False):
                    hook._framework_eval_batch()  # only a handed-over notice rides on it (_eval_level)
                return
            if in_fit and hook._may_act_now():
                hook._framework_eval_batch()

        def on_validation_end(self, trainer: Any, pl_module: Any) -> None:
            hook._lt_eval_end()

        def on_save_checkpoint(self, trainer: Any, pl_module: Any, checkpoint: dict[str, Any]) -> None:
            if hook._saving:
                checkpoint[STATE_KEY] = hook._gather_rng()  # inside _rewound: step S's RNG on every rank
                at = hook._rewinding
                if at is not None:  # what Lightning's own dump took now moved since S: S's copies instead
                    checkpoint["loops"] = at.loops
                    if "callbacks" in checkpoint:
                        checkpoint["callbacks"] = at.callbacks

        def on_load_checkpoint(self, trainer: Any, pl_module: Any, checkpoint: dict[str, Any]) -> None:
            hook._pending_rng = checkpoint.get(STATE_KEY)

        def teardown(self, trainer: Any, pl_module: Any, stage: str) -> None:
            hook._release_ckpt_path()

    return SpotguardCallback()


@dataclass
class _AtStep:
    """What moves between optimizer step S's end and the next micro-batches, as it was at S's end."""

    step: int
    epoch: int
    rng: dict[str, Any]
    buffers: dict[str, torch.Tensor]
    loops: dict[str, Any]
    callbacks: dict[str, Any]


def _copy_containers(obj: Any, budget: list[int]) -> Any:
    """Dicts/lists/tuples copied, other leaves deep-copied; tensors cloned while ``budget[0]`` (bytes) lasts —
    a callback may update one in place at every batch (a running loss, an EMA), micro-batches included — and
    shared beyond it (a callback's EMA of the weights: not copied at every step). Whether to act between
    micro-batches never depends on these sizes: a rank-local answer would split the ranks' collectives."""
    if isinstance(obj, dict):
        return {k: _copy_containers(v, budget) for k, v in obj.items()}
    if type(obj) in (list, tuple):
        return type(obj)(_copy_containers(v, budget) for v in obj)
    if isinstance(obj, torch.Tensor):
        budget[0] -= obj.numel() * obj.element_size()
        return obj.detach().clone() if budget[0] >= 0 else obj
    return copy.deepcopy(obj)


class LightningHook(AnyMomentMixin, FrameworkHook):
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
        self._at_step: Optional[_AtStep] = None  # taken at each optimizer step's end under accumulation
        self._rewinding: Optional[_AtStep] = None  # set while a save stands for _at_step's step
        self._micro_since = 0  # accumulation micro-batches since the last optimizer step
        self._own_hooks: Optional[str] = None  # lightning_anymoment.own_save_hooks, once asked ("" : none)
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
        if threading.current_thread() is not threading.main_thread() or self._life.closed:
            return
        for sig in list(self._life.signal_handlers()):
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

    # ------------------------------------------------------------- accumulation

    def _remember_step(self, step: int, final: bool) -> None:
        """Optimizer step ``step`` just ended (every rank, before the boundary acts): under gradient
        accumulation take what the next micro-batches move — this rank's RNG, running-stat buffers,
        Lightning's loop progress and the callbacks' state — as a save right now would write it."""
        self._micro_since = 0
        trainer = self.trainer
        if final or int(getattr(trainer, "accumulate_grad_batches", 1) or 1) <= 1:
            self._at_step = None  # no micro-batches to act in: nothing to pay per step
            return
        self._at_step = self._snapshot(step)

    def _snapshot(self, step: int) -> Optional[_AtStep]:
        """What moves between this step's end and the next step's weights change, copied (None: another
        Lightning, whose loops' state this cannot take: act at the step boundary only, every rank alike)."""
        trainer = self.trainer
        conn = getattr(trainer, "_checkpoint_connector", None)
        loops_of = getattr(conn, "_get_loops_state_dict", None)
        if loops_of is None:
            return None
        module = trainer.lightning_module
        budget = [SNAPSHOT_ALL_BUFFERS]
        return _AtStep(
            step=step, epoch=int(trainer.current_epoch), rng=capture_rng(),
            buffers={n: b.detach().clone() for n, b in model_snapshot_buffers(module).items()},
            loops=_copy_containers(loops_of(), budget),
            callbacks={cb.state_key: _copy_containers(sd, budget) for cb in trainer.callbacks
                       if (sd := cb.state_dict())},
        )

    def _rewindable(self) -> bool:
        """Can a save now stand for the last optimizer step? The same answer on every rank (same step,
        epoch and history): a step of this run taken at its end, and no epoch end since (the epoch-end
        hooks, validation and plateau schedulers may change what is not rewound)."""
        at = self._at_step
        if self._own_hooks is None:  # a user's save hook writes what it reads live: never mid-accumulation
            self._own_hooks = own_save_hooks(self.trainer) or ""
        return (at is not None and at.step == self._last_boundary and at.epoch == int(self.trainer.current_epoch)
                and not self._own_hooks)

    def _microbatch(self) -> None:
        """An accumulation micro-batch ended: agree and act here when the save can stand for step S;
        otherwise stay out of the agreement (every rank alike) and act at the step's end as before."""
        self._micro_since += 1
        if self._rewindable():
            self._framework_microbatch()  # ticks too: the acting distance is one micro-batch now

    def _may_act_now(self) -> bool:
        """Validation inside fit: at a step's end, or mid-accumulation when the save can be rewound."""
        return self._micro_since == 0 or self._rewindable()

    def _act_in_eval(self, level: int, deadline_ms: int) -> None:
        """Validation between two micro-batches saves as a micro-batch does: rewound to step S (Lightning's
        loop position there is mid-accumulation, which its resume would take for completed batches)."""
        if self._micro_since and self._rewinding is None:  # validation between two micro-batches
            with self._rewound():
                super()._act_in_eval(level, deadline_ms)
        else:
            super()._act_in_eval(level, deadline_ms)

    @contextlib.contextmanager
    def _rewound(self) -> Iterator[None]:
        """RNG and running-stat buffers as at step S's end for the save; the loops' and callbacks' state
        of S replace Lightning's in ``on_save_checkpoint``. The live values come back afterwards."""
        at = self._at_step
        if at is None:
            yield
            return
        with rng_and_buffers_at(at.rng, {"m": model_snapshot_buffers(self.trainer.lightning_module)},
                                {"m": at.buffers}):
            self._rewinding = at
            try:
                yield
            finally:
                self._rewinding = None

    # ------------------------------------------------------------- writing

    def _write(self, key: str, snap: Any) -> None:
        """All ranks call ``trainer.save_checkpoint`` (rank 0 writes, Lightning barriers)."""
        self._saving = True
        try:
            self._place(key, lambda target: self.trainer.save_checkpoint(str(target)))
        finally:
            self._saving = False

    def _place(self, key: str, save: Callable[[pathlib.Path], Any]) -> None:
        """``save(path)`` writes ``lightning.ckpt`` in place (a local store) or into a staging folder that rank 0
        uploads; rank 0 reports what it wrote for the commit record."""
        local = self._storage.local_path(key)
        stage = None
        if local is not None:
            target = pathlib.Path(local) / CKPT_NAME
        else:
            stage = staging_dir(f"lightning-{self._rank}")
            target = stage / CKPT_NAME
        save(target)
        if stage is not None:
            try:
                if self._rank == 0:
                    upload_dir(self._storage, stage, key)
            finally:
                shutil.rmtree(stage, ignore_errors=True)
        elif self._rank == 0:  # written in place (rank 0 writes): report it for the commit record
            report_local(self._storage, key, select=lambda rel: rel == CKPT_NAME)

    def _exit(self, notice: Notice, result: Any, step: Optional[int] = None) -> Any:
        self.trainer.should_stop = True
        return super()._exit(notice, result, step)


def uses_deepspeed(trainer: Any) -> bool:
    """The Trainer's strategy is (a subclass of) Lightning's ``DeepSpeedStrategy`` (named, not imported: deepspeed
    may not be installed)."""
    return any(c.__name__ == "DeepSpeedStrategy" for c in type(getattr(trainer, "strategy", None)).__mro__)


def install(trainer: Any, storage: Any = None, *, socket: str | None = None, every: Any = None,
            keep: int | None = None, exit_code: int = 143, on_notice: Any = None) -> LightningHook:
    """The Lightning adapter for a Trainer whose strategy is not DeepSpeed's (``install_preemption_hook`` goes
    through ``lightning_deepspeed.install``, which picks)."""
    if uses_deepspeed(trainer):
        raise TypeError("a Trainer with DeepSpeedStrategy: use install_preemption_hook(trainer) (its checkpoint is "
                        "written by spotguard.hook.adapters.lightning_deepspeed)")
    return LightningHook(trainer, storage, socket=socket, keep=keep, exit_code=exit_code, on_notice=on_notice,
                         every=every)
