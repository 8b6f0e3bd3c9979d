"""What one save comes to (``_Result``), shared by the save, the agreement, the exit and the adapters.

A module of its own so that each of them imports it without importing the others (issue 28: no circles).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

__all__ = ["_Result", "_OWN"]

#: "the hook's own group" (the training thread's) as a default argument
_OWN: Any = object()


@dataclass
class _Result:
    """The outcome of one checkpoint write (``SaveMixin._save``): committed or why not, where, how big."""

    committed: bool
    peers_ok: bool = True
    uri: str = ""
    bytes: int = 0
    seconds: float = 0.0
    error: str = ""
    late_seconds: float = 0.0  # > 0: committed that long after the emergency notice's deadline
    step: Optional[int] = None  # the step this result stands for when not the agreed one (the exact fallback)
