"""Loopback metadata emulator for AWS IMDSv2, GCP metadata and Azure Scheduled Events.

See docs/emulator.md for the endpoints, the control API and fault injection.
``server`` is the CLI module; ``running_emulator`` is the in-process entry for tests.
Names are imported lazily so ``python -m spotguard.emulator.server`` runs cleanly.
"""

from __future__ import annotations

from typing import Any

__all__ = ["Emulator", "EmulatorConfig", "EmulatorState", "STATE_KEY", "create_app", "running_emulator"]


def __getattr__(name: str) -> Any:
    if name in ("Emulator", "create_app", "running_emulator"):
        from . import server

        return getattr(server, name)
    if name in ("EmulatorConfig", "EmulatorState", "STATE_KEY"):
        from . import state

        return getattr(state, name)
    raise AttributeError(f"module 'spotguard.emulator' has no attribute {name!r}")
