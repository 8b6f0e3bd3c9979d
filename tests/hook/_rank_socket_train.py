"""Test-only launcher: one daemon socket per worker, for "two nodes" on one machine.

torchrun hands every worker the same environment, so it cannot give rank 0 the
socket of daemon A and rank 1 the socket of daemon B. This wrapper runs under
torchrun in place of ``examples/torchrun_train.py``: it sets ``SPOTGUARD_SOCKET``
from ``SG_TEST_SOCKET_RANK<LOCAL_RANK>`` (when set), then runs the example
unchanged as ``__main__`` with the same arguments.
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
    sys.argv[0] = str(EXAMPLE)
    runpy.run_path(str(EXAMPLE), run_name="__main__")
