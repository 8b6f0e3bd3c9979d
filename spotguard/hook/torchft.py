"""Old home of the torchft engine, kept so ``spotguard.hook.torchft.ReplicaGuard`` (README, docs, user code)
still imports: the engine lives in ``spotguard/torchft/engine.py``."""

from __future__ import annotations

from ..torchft.engine import *  # noqa: F401,F403 - the public names, re-exported
from ..torchft.engine import __all__  # noqa: F401
