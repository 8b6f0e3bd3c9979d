"""Accelerate: the user's own automatically named ``save_state()`` done again after a resume.

Why: with gradient accumulation the micro-batches after the agreed step S run on while S is written (held only at
the next micro-batch's forward, or never: an ordinary notice lets training go on). A ``save_state()`` of the
user's own among them wrote ``checkpoint_<n>`` into the project folder. The resumed run restores
``project_configuration.iteration`` as of S (``spotguard_iteration.json``), n, recomputes those micro-batches and
calls the same ``save_state()``: Accelerate raised ``ValueError: Checkpoint directory .../checkpoint_<n> already
exists``. The folders ``checkpoint_<k>``, k >= n, found at the resume are that thrown-away work's (the
uninterrupted run had none of them at S); each automatically named ``save_state`` of the resumed run removes the one
it writes, ``checkpoint_<its iteration>``, on every rank right before Accelerate's own check (no rank creates its
folder before every rank has passed that check: Accelerate's ``wait_for_everyone``), then writes it again — logged
(``own_checkpoints_replaced``). Only that one (review obrev): resumed from a checkpoint after which the run went on
(an ordinary or periodic one, then a crash), the later folders are that run's progress, kept until redone.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path
from typing import Any, Callable

from .. import events as ev

__all__ = ["replace_stale_own_checkpoints"]

_NAME = re.compile(r"^checkpoint_(\d+)$")


def replace_stale_own_checkpoints(accelerator: Any, iteration: int, log: Callable[[], Any]) -> None:
    """After a resume restored ``project_configuration.iteration`` to ``iteration``: see the module docstring."""
    cfg = getattr(accelerator, "project_configuration", None)
    base = Path(getattr(accelerator, "project_dir", None) or ".") / "checkpoints"
    if not getattr(cfg, "automatic_checkpoint_naming", False) or not base.is_dir():
        return
    stale = {int(m.group(1)): p for p in base.iterdir() if (m := _NAME.match(p.name)) and int(m.group(1)) >= iteration}
    if not stale:
        return
    orig = accelerator.save_state

    def save_state(*args: Any, **kwargs: Any) -> Any:
        cfg = accelerator.project_configuration
        if cfg.automatic_checkpoint_naming:  # not spotguard's own (explicit folder)
            p = stale.pop(int(cfg.iteration), None)  # only the folder this save writes: the others wait for theirs
            if p is not None:
                shutil.rmtree(p, ignore_errors=True)
                log().info(ev.OWN_CHECKPOINTS_REPLACED, iteration=int(cfg.iteration), folders=[p.name],
                           why="written after the resumed step by the interrupted run")
            if not stale:
                accelerator.__dict__.pop("save_state", None)
        return orig(*args, **kwargs)

    accelerator.save_state = save_state
