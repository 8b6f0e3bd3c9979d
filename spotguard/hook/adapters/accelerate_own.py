"""Accelerate: the user's own automatically named ``save_state()`` done again after a resume.

Why: with gradient accumulation the micro-batches after the agreed step S run on while S is written (held only at
the next micro-batch's forward, or never: an ordinary notice lets training go on). A ``save_state()`` of the
user's own among them wrote ``checkpoint_<n>`` into the project folder. The resumed run restores
``project_configuration.iteration`` as of S (``spotguard_iteration.json``), n, recomputes those micro-batches and
calls the same ``save_state()``: Accelerate raised ``ValueError: Checkpoint directory .../checkpoint_<n> already
exists``. The folders ``checkpoint_<k>``, k >= n, found at the resume are that thrown-away work's (the
uninterrupted run had none of them at S); the resumed run's first automatically named ``save_state`` removes them
on every rank right before Accelerate's own check (no rank creates its folder before every rank has passed that
check: Accelerate's ``wait_for_everyone``), then writes ``checkpoint_<n>`` again — logged once
(``own_checkpoints_replaced``).
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
    stale = sorted(p for p in base.iterdir() if (m := _NAME.match(p.name)) and int(m.group(1)) >= iteration)
    if not stale:
        return
    orig = accelerator.save_state

    def save_state(*args: Any, **kwargs: Any) -> Any:
        if accelerator.project_configuration.automatic_checkpoint_naming:  # not spotguard's own (explicit folder)
            accelerator.__dict__.pop("save_state", None)
            for p in stale:
                shutil.rmtree(p, ignore_errors=True)
            log().info(ev.OWN_CHECKPOINTS_REPLACED, iteration=iteration, folders=[p.name for p in stale],
                       why="written after the resumed step by the interrupted run's thrown-away micro-batches")
        return orig(*args, **kwargs)

    accelerator.save_state = save_state
