"""Old home of the torchft replica worker and its launch helpers, kept so ``spotguard.ftreplica`` imports and
``python -m spotguard.ftreplica`` runs: they live in ``spotguard/torchft/worker.py`` and ``launch.py``."""

from __future__ import annotations

import sys

from .torchft.launch import (  # noqa: F401 - re-exported
    Group,
    Lighthouse,
    ReplicaJob,
    drill,
    lighthouse_binary,
    start_group,
    start_lighthouse,
)
from .torchft.worker import LR, digest, lr_factor, main, worker  # noqa: F401 - re-exported

__all__ = ["Lighthouse", "Group", "ReplicaJob", "start_lighthouse", "start_group", "drill", "lighthouse_binary",
           "main", "LR", "lr_factor", "digest", "worker"]

if __name__ == "__main__":
    sys.exit(main())
