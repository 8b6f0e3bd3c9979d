"""Run a script (``python _slow_script.py SCRIPT ARGS...``) with every ``optimizer.step()`` taking 20 ms longer.

Lets a test preempt a fast script, such as the README's, mid-run without editing it.
"""

from __future__ import annotations

import runpy
import sys
import time

from torch.optim.optimizer import register_optimizer_step_post_hook


def _slow(*_: object) -> None:
    time.sleep(0.02)  # simulated work per step


register_optimizer_step_post_hook(_slow)
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
