"""spotguard: spot/preemptible VM termination notice -> committed checkpoint -> clean exit.

The package root must stay importable without torch (the daemon never needs it);
the hook is imported lazily on first use, and so are ``Notice``/``Cancel``: the liveness
probe (``spotguard status --live``, spotguard/live.py) runs every few seconds in a fresh
interpreter and imports nothing beyond the standard library's ``socket`` and ``json``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .version import __version__

if TYPE_CHECKING:
    from .notice import Cancel, Notice

__all__ = ["Notice", "Cancel", "install_preemption_hook", "Preempted", "__version__"]


def __getattr__(name: str) -> Any:
    if name in ("Notice", "Cancel"):
        from . import notice

        return getattr(notice, name)
    if name in ("install_preemption_hook", "Preempted"):
        from . import hook

        return getattr(hook, name)
    raise AttributeError(f"module 'spotguard' has no attribute {name!r}")
