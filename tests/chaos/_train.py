"""Chaos-run worker: ``examples/torchrun_train.py`` unchanged, with two test-only knobs set from the env.

- ``SG_TEST_SOCKET_RANK<LOCAL_RANK>``: this worker's daemon socket ("two nodes" on one machine:
  torchrun gives every worker the same environment, so it cannot do this itself);
- ``SG_CHAOS_EVERY``: passed as ``every=`` to ``install_preemption_hook`` (periodic checkpoints).
"""

from __future__ import annotations

import os
import runpy
import sys
from pathlib import Path

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "torchrun_train.py"

if __name__ == "__main__":
    sock = os.environ.get(f"SG_TEST_SOCKET_RANK{os.environ.get('LOCAL_RANK', '0')}")
    if sock:
        os.environ["SPOTGUARD_SOCKET"] = sock
    every = os.environ.get("SG_CHAOS_EVERY")
    if every:
        import spotguard

        _install = spotguard.install_preemption_hook

        def install_preemption_hook(*args, **kwargs):  # type: ignore[no-untyped-def]
            kwargs.setdefault("every", every)
            return _install(*args, **kwargs)

        spotguard.install_preemption_hook = install_preemption_hook  # type: ignore[assignment]
    sys.argv[0] = str(EXAMPLE)
    runpy.run_path(str(EXAMPLE), run_name="__main__")
