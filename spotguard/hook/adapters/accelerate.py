"""``accelerate.Accelerator`` adapter: the plain hook's boundaries, Accelerate's checkpoint format.

Install after ``accelerator.prepare(...)`` (the hook needs the prepared
optimizers), on every process::

    model, opt, sched = accelerator.prepare(model, opt, sched)
    hook = install_preemption_hook(accelerator, storage="s3://bucket/run")
    start = hook.resume()          # accelerator.load_state(<newest committed>) -> its step, 0 if none

The user's loop stays as it is. Exactly like the plain-PyTorch hook (same
code): the ranks decide at each real ``optimizer.step()`` (the post-hook of
the torch optimizer inside Accelerate's wrapper, so gradient-accumulation
micro-steps, where Accelerate skips the step, never count), launching the
flag's all-reduce on the hook's own gloo group; at the next step's pre-hook
(the end of the deciding iteration: the scheduler has stepped) the reduction
is waited and, if any rank asked, ``accelerator.save_state`` writes the
checkpoint on every process into ``<storage>/step-N/`` (directly for a local
store, via a staging folder + upload for an object store), with the RNG
states and normalisation-layer running statistics put back to what they were
right after the deciding step. Rank 0 commits, every rank tears down and
raises ``Preempted`` (exit 143). ``hook.step()`` / ``hook.range(total)`` give an
explicit boundary instead, as for the plain hook.

Data position: Accelerate's ``save_state`` saves the sampler's seed/epoch
but not a position inside the epoch; continue with
``accelerator.skip_first_batches(loader, start % len(loader))`` (or a
``use_stateful_dataloader`` loader), as the Accelerate docs describe.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
from typing import Any, Iterator, Optional

import torch

from ...storage import Storage
from ..core import Hook
from ..state import Snapshot, capture_rng, clone_buffers, copy_buffers, restore_rng
from ._base import FrameworkHook
from ...storage.integrity import DamagedCheckpoint
from ...storage.verify import verified_folder
from ._files import report_local, staging_dir, upload_dir

__all__ = ["AccelerateHook", "install"]

_RANK_FILE = re.compile(r"^random_states_(\d+)\.pkl$")


def _prepared_state(accelerator: Any) -> dict[str, Any]:
    """``{"model0": ..., "optimizer0": <torch optimizer inside the wrapper>, ...}`` for the step hooks."""
    state: dict[str, Any] = {}
    for i, m in enumerate(getattr(accelerator, "_models", [])):
        state[f"model{i}"] = m
    for i, o in enumerate(getattr(accelerator, "_optimizers", [])):
        state[f"optimizer{i}"] = getattr(o, "optimizer", o)
    return state


class AccelerateHook(FrameworkHook):
    framework = "accelerate"

    # The loop is the user's: the plain hook's resume/range apply (FrameworkHook forbids them).
    resume = Hook.resume
    range = Hook.range

    def __init__(self, accelerator: Any, storage: str | Storage | None = None, *, socket: str | None = None,
                 keep: int | None = None, exit_code: int = 143, on_notice: Optional[Any] = None,
                 every: Optional[float] = None) -> None:
        state = _prepared_state(accelerator)
        if not any(k.startswith("optimizer") for k in state):
            raise TypeError(
                "install_preemption_hook(accelerator) needs the prepared optimizer: call it after "
                "accelerator.prepare(model, optimizer, ...)"
            )
        super().__init__(storage, socket=socket, keep=keep, exit_code=exit_code, on_notice=on_notice, arm=False,
                         every=every)
        self.accelerator = accelerator
        self._arm(state)

    # ------------------------------------------------------------- state <-> Accelerate

    @contextlib.contextmanager
    def _as_of(self, snap: Optional[Snapshot]) -> Iterator[None]:
        """RNG and running-stat buffers as they were right after the deciding step, for the duration of a save."""
        if snap is None:
            yield
            return
        now_rng = capture_rng()
        now_bufs = clone_buffers(self._buffers)
        restore_rng(snap.rng)
        self._copy_buffers(self._end_buffers(self._count))
        try:
            yield
        finally:
            self._copy_buffers(now_bufs)
            restore_rng(now_rng)

    def _copy_buffers(self, values: dict[str, dict[str, torch.Tensor]]) -> None:
        copy_buffers(self._buffers, values)

    @contextlib.contextmanager
    def _explicit_dirs(self) -> Iterator[None]:
        """``save_state``/``load_state`` ignore their folder under automatic_checkpoint_naming: switch it off meanwhile."""
        cfg = getattr(self.accelerator, "project_configuration", None)
        auto = bool(getattr(cfg, "automatic_checkpoint_naming", False))
        if auto:
            cfg.automatic_checkpoint_naming = False
        try:
            yield
        finally:
            if auto:
                cfg.automatic_checkpoint_naming = True

    def _write(self, key: str, snap: Optional[Snapshot]) -> None:
        local = self._storage.local_path(key)
        stage = None
        if local is not None:
            target = str(local)
        else:
            stage = staging_dir(f"accelerate-{self._rank}")
            target = str(stage)
        try:
            with self._as_of(snap), self._explicit_dirs():
                self.accelerator.save_state(target)
            rank = self._rank

            def mine(rel: str) -> bool:
                m = _RANK_FILE.match(rel)
                return int(m.group(1)) == rank if m else rank == 0

            if stage is not None:
                upload_dir(self._storage, stage, key, select=mine)
            else:  # written in place: report this rank's files for the commit record
                report_local(self._storage, key, select=mine)
        finally:
            if stage is not None:
                shutil.rmtree(stage, ignore_errors=True)

    def _load(self, dirkey: str, digests: Any = None) -> Optional[DamagedCheckpoint]:
        """Every rank: verify (or download verified), agree, then let Accelerate load; damage is returned."""
        damage: Optional[DamagedCheckpoint] = None
        try:
            folder = verified_folder(self._storage, dirkey, self._log)
        except DamagedCheckpoint as exc:
            damage = exc
        if not self._all_ok(damage is None):
            return damage or DamagedCheckpoint(f"{self._storage.uri}/{dirkey}", "another rank found it damaged")
        with self._explicit_dirs():
            self.accelerator.load_state(os.fspath(folder))
        return None


def install(accelerator: Any, storage: Any = None, *, socket: str | None = None, every: Any = None,
            keep: int | None = None, exit_code: int = 143, on_notice: Any = None) -> AccelerateHook:
    return AccelerateHook(accelerator, storage, socket=socket, keep=keep, exit_code=exit_code, on_notice=on_notice,
                          every=every)
