"""spotguard: spot/preemptible VM termination notice -> committed checkpoint -> clean exit.

The package root must stay importable without torch (the daemon never needs it);
the hook is imported lazily on first use.
"""

from __future__ import annotations

from typing import Any

from .notice import Cancel, Notice

__version__ = "0.1.0"
__all__ = ["Notice", "Cancel", "install_preemption_hook", "Preempted", "__version__"]


def __getattr__(name: str) -> Any:
    if name in ("install_preemption_hook", "Preempted"):
        from . import hook

        return getattr(hook, name)
    raise AttributeError(f"module 'spotguard' has no attribute {name!r}")
