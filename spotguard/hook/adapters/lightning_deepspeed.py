"""Lightning's ``DeepSpeedStrategy``: the Lightning adapter, with the checkpoint written by DeepSpeed's own writer.

``install_preemption_hook(trainer)`` with ``strategy=DeepSpeedStrategy(...)`` (or ``"deepspeed_stage_2"``...)
returns this hook. Everything Lightning-side is the Lightning adapter's (callback, boundaries, signals, RNG,
automatic resume, ``every=``); what differs is the checkpoint: under DeepSpeed ``trainer.save_checkpoint(path)``
makes *every* rank call ``engine.save_checkpoint(path, client_state=<Lightning's dict>, tag="checkpoint")``,
which writes a folder: ``checkpoint/mp_rank_00_model_states.pt`` (rank 0: weights, Lightning's dict) and one
``checkpoint/zero_pp_rank_<r>_mp_rank_00_optim_states.pt`` per rank (its ZeRO partition).

How the bytes go: as in the DeepSpeed engine adapter, spotguard's ``CheckpointEngine`` is swapped in for the
save only, so each rank streams its own files into ``<storage>/step-N/lightning.ckpt/`` (multipart upload for an
object store, never staged whole on local disk), checksummed as they go and named in the commit record; rank 0
adds DeepSpeed's ``latest`` (``checkpoint``), which ``engine.load_checkpoint`` reads to find the tag. Lightning's
own resume (``trainer.ckpt_path = <step-N>/lightning.ckpt``, a folder) loads it through the same engine: every
file with ``torch.load(weights_only=True)`` and the DeepSpeed allowlist.

When: as the engine adapter, at the end of the optimizer step a notice arrived in (``_read_at_boundary``: the
agreement read at the boundary that launched it, not one step later).

Limits: gradient accumulation acts at the step boundary only (ZeRO's partly reduced gradients are not in a
checkpoint: the engine adapter's rule); another world size at resume is refused before anything loads
(``DeepSpeedWorldSizeChanged``).

Lightning 2.6 itself runs ``DeepSpeedStrategy`` only on CUDA (``setup_environment`` refuses another accelerator,
``setup_distributed`` wants device indices, ``deepspeed.initialize`` gets ``device_rank=None`` on CPU); the
tests run it on CPU through a test-only subclass (``tests/hook/adapters/lightning_ds_train.py``).
"""

from __future__ import annotations

import pathlib
import shutil
from typing import TYPE_CHECKING, Any

from ...storage.base import join_key
from ...storage.record import COMMIT_NAME, CommitRecord
from ...storage.verify import cache_root
from .lightning import CKPT_NAME, LightningHook, uses_deepspeed
from .lightning import install as install_lightning

if TYPE_CHECKING:
    from .deepspeed import SpotguardCheckpointEngine

__all__ = ["LightningDeepSpeedHook", "install"]

_TAG = "checkpoint"  # Lightning's tag for engine.save_checkpoint


class LightningDeepSpeedHook(LightningHook):
    framework = "lightning-deepspeed"
    _read_at_boundary = True  # as the engine adapter: a notice is written for the step it arrived in

    def _arm(self, state: Any = None) -> None:
        first = not self._armed
        super()._arm(state)
        if first:  # the core exists now (its _book of shadowed methods); Lightning loads the checkpoint after setup
            self._wrap_load()

    # ------------------------------------------------------------- resume

    def _arrange_resume(self) -> None:
        super()._arrange_resume()
        if self._auto_ckpt is not None and self._latest is not None:
            self._check_world(self._latest[3])

    def _check_world(self, dirkey: str) -> None:
        from .deepspeed import check_world  # noqa: PLC0415 - imports deepspeed

        world = int(getattr(self.trainer, "world_size", 0) or 0)
        if world:
            check_world(self._storage, dirkey, world)

    def _wrap_load(self) -> None:
        """``strategy.load_checkpoint`` reads through spotguard's engine (``weights_only=True`` + allowlist)."""
        from .deepspeed import SpotguardCheckpointEngine  # noqa: PLC0415 - imports deepspeed

        strategy, hook = self.trainer.strategy, self
        orig = strategy.load_checkpoint

        def load_checkpoint(checkpoint_path: Any, *args: Any, **kwargs: Any) -> Any:
            hook._check_world_of(checkpoint_path)
            ce = SpotguardCheckpointEngine(hook._storage, "", str(checkpoint_path))
            with hook._swapped(ce):
                out = orig(checkpoint_path, *args, **kwargs)
            hook._log.info("deepspeed_checkpoint_loaded", path=str(checkpoint_path),
                           reader="spotguard CheckpointEngine (torch.load weights_only=True + DeepSpeed allowlist)")
            return out

        strategy.load_checkpoint = load_checkpoint
        self._book.shadow(strategy, "load_checkpoint")

    def _check_world_of(self, checkpoint_path: Any) -> None:
        """Whatever path Lightning loads (the automatic resume's, the user's own ``ckpt_path``, another run's):
        a spotguard checkpoint, recognised by the commit record beside ``lightning.ckpt`` (in the store's folder
        or its verified download), is refused when another world size wrote it, before DeepSpeed reads a byte."""
        from .deepspeed import refuse_other_world  # noqa: PLC0415 - imports deepspeed

        folder = pathlib.Path(str(checkpoint_path)).parent
        try:
            saved = CommitRecord.from_json((folder / COMMIT_NAME).read_bytes()).world_size
        except (OSError, ValueError):
            return  # not a spotguard checkpoint (or no readable record): DeepSpeed's own checks apply
        refuse_other_world(str(checkpoint_path), saved, int(getattr(self.trainer, "world_size", 0) or 0))

    def _swapped(self, ce: "SpotguardCheckpointEngine") -> Any:
        from .deepspeed import swapped  # noqa: PLC0415 - imports deepspeed

        return swapped(self.trainer.strategy.deepspeed_engine, ce)

    # ------------------------------------------------------------- accumulation: the step boundary only

    def _started(self, step: int, resumed_from: Any) -> None:
        super()._started(step, resumed_from)
        self._warn_misaligned_accumulation()

    def _warn_misaligned_accumulation(self) -> None:
        """Lightning counts ``accumulate_grad_batches`` per epoch (its step ends restart at each epoch's first
        batch), DeepSpeed across epochs (``engine.micro_steps``, in no checkpoint): when the epoch is not a whole
        number of steps, from the second epoch on Lightning's step ends fall where ZeRO holds partly reduced
        gradients, so no checkpoint there resumes bitwise. Said at train start, with the fix."""
        trainer = self.trainer
        acc = int(getattr(trainer, "accumulate_grad_batches", 1) or 1)
        batches = getattr(trainer, "num_training_batches", None)
        if acc <= 1 or not isinstance(batches, int) or batches <= 0 or batches % acc == 0:
            return
        self._log.warning("lightning_deepspeed_accumulation_misaligned", batches_per_epoch=batches,
                          accumulate_grad_batches=acc,
                          why="Lightning counts accumulation per epoch, DeepSpeed across epochs: after the first "
                              "epoch a step end of Lightning's is mid-accumulation for DeepSpeed, whose partly "
                              "reduced gradients no checkpoint holds; a resume from there is not exact",
                          fix="batches per epoch a multiple of accumulate_grad_batches (limit_train_batches or the "
                              "dataset's size)")

    def _remember_step(self, step: int, final: bool) -> None:
        self._micro_since, self._at_step = 0, None  # nothing to rewind to: no snapshot per step

    def _microbatch(self) -> None:
        self._micro_since += 1  # no agreement between micro-batches (ZeRO's gradient buffers are not saved)

    def _may_act_now(self) -> bool:
        return self._micro_since == 0

    # ------------------------------------------------------------- writing

    def _write(self, key: str, snap: Any) -> None:
        """Every rank: ``trainer.save_checkpoint`` with spotguard's engine swapped in, each file streamed to
        ``<key>/lightning.ckpt/``. Lightning broadcasts rank 0's path to every rank, so the throw-away folder
        DeepSpeed is pointed at (it receives only ``latest`` and the recovery scripts, from rank 0) is named the
        same on every rank; each removes its host's copy after Lightning's closing barrier."""
        from .deepspeed import SpotguardCheckpointEngine  # noqa: PLC0415 - imports deepspeed

        stage = cache_root() / "staging" / f"lightning-deepspeed-{key.replace('/', '_')}"
        target = stage / CKPT_NAME
        ce = SpotguardCheckpointEngine(self._storage, join_key(key, CKPT_NAME), str(target))
        self._saving = True
        try:
            with self._swapped(ce):
                self.trainer.save_checkpoint(str(target))
        finally:
            self._saving = False
            shutil.rmtree(stage, ignore_errors=True)
        if self._rank == 0:
            self._storage.write_bytes(join_key(key, CKPT_NAME, "latest"), _TAG.encode())


def install(trainer: Any, storage: Any = None, *, socket: str | None = None, every: Any = None,
            keep: int | None = None, exit_code: int = 143, on_notice: Any = None) -> LightningHook:
    """``install_preemption_hook(trainer)`` for any Lightning Trainer: this hook under ``DeepSpeedStrategy``
    (deepspeed imported only then), else the Lightning adapter's."""
    if not uses_deepspeed(trainer):
        return install_lightning(trainer, storage, socket=socket, every=every, keep=keep, exit_code=exit_code,
                                 on_notice=on_notice)
    return LightningDeepSpeedHook(trainer, storage, socket=socket, keep=keep, exit_code=exit_code,
                                  on_notice=on_notice, every=every)
