"""The hook's tunables and shared constants (environment-overridable where a platform needs it).

One place for the numbers the hook's modules share (core, notices, agreement,
save, resume, exit), so none of them imports another just for a constant.
"""

from __future__ import annotations

import os
import warnings
from typing import Any, Callable, Optional

__all__ = [
    "EXIT_GRACE", "EXIT_CALLBACK_TIMEOUT", "HOLD_SLACK",
    "SAVE_MARGIN", "env_seconds", "env_bytes", "QUIESCE_AGREEMENT_TIMEOUT", "QUIESCE_PERIODIC_TIMEOUT",
    "SIGNAL_GRACE", "EMERGENCY_LEAD",
    "PERIODIC_NOTICE_PREFIX", "PERIODIC_SYNC_TIMEOUT", "EXIT_SAVE_FAILED",
    "LEVEL_NONE", "LEVEL_CHECKPOINT", "LEVEL_EMERGENCY", "LEVEL_REPLAY",
]

# Storage requests of a notice-driven save stop this long before the notice deadline (at most half
# of what is left): the bounded teardown (barrier + destroy, ~0.1 s), the exit (~0.15 s with
# gc.freeze) and the report to the daemon must still fit before the VM goes.
SAVE_MARGIN = 1.5
# Before the user's destroy_process_group() / at exit: how long to wait for the outstanding flag
# reduction (finished long ago unless a peer is gone) and for an in-flight periodic upload.
QUIESCE_AGREEMENT_TIMEOUT = 10.0


def env_seconds(name: str, default: float, report: "Callable[[str], Any] | None" = None) -> float:
    """A positive, finite number of seconds from the environment; a bad value is reported (``report``,
    else a warning) naming the variable, and the default is used: a typo never crashes a job."""
    raw = os.environ.get(name, "")
    try:
        value = float(raw) if raw.strip() else default
        if not (0 < value < float("inf")):
            raise ValueError("must be a positive, finite number of seconds")
    except ValueError as exc:
        _ignored(f"{name}={raw!r} ignored ({exc}); using {default:g} s", report)
        return default
    return value


def _ignored(message: str, report: "Callable[[str], Any] | None") -> None:
    """Say that a bad setting was ignored: to ``report`` (a logger's method), else as a warning."""
    if report is None:
        warnings.warn(message, stacklevel=3)
    else:
        report(message)


_UNITS = {"": 1, "k": 1 << 10, "kb": 1 << 10, "kib": 1 << 10, "m": 1 << 20, "mb": 1 << 20, "mib": 1 << 20,
          "g": 1 << 30, "gb": 1 << 30, "gib": 1 << 30, "t": 1 << 40, "tb": 1 << 40, "tib": 1 << 40}


def env_bytes(name: str, default: int, report: "Callable[[str], Any] | None" = None) -> int:
    """A byte count (0 or more) from the environment, a plain integer or one with a unit (``512M``, ``1GiB``;
    binary units); a bad value is reported naming the variable and the default is used. These are read
    when the hook's modules are imported: a typo must not make ``import spotguard`` fail."""
    raw = os.environ.get(name, "")
    text = raw.strip().lower().replace(" ", "")
    if not text:
        return default
    digits = text.rstrip("abcdefghijklmnopqrstuvwxyz")
    unit = text[len(digits):]
    try:
        if unit not in _UNITS:
            raise ValueError(f"unknown unit {unit!r} (use a plain number of bytes, or K, M, G, T)")
        value = float(digits) * _UNITS[unit]
        if not (0 <= value < float("inf")):
            raise ValueError("must be 0 or more bytes")
    except ValueError as exc:
        _ignored(f"{name}={raw!r} ignored ({exc}); using {default} bytes", report)
        return default
    return int(value)


QUIESCE_PERIODIC_TIMEOUT = env_seconds("SPOTGUARD_PERIODIC_DRAIN", 60.0)
# What a SIGTERM leaves us before the SIGKILL: torchrun's default --shutdown-timeout (30 s); set it
# per platform (GKE pods: 15 s of the node's 30 s; a pod's terminationGracePeriodSeconds; SLURM GraceTime).
SIGNAL_GRACE = env_seconds("SPOTGUARD_SIGNAL_GRACE", 30.0)
# An emergency notice further off than this (GCP GPU host maintenance: about an hour; Azure Terminate:
# 5-15 min) does not stop training at once: the emergency checkpoint starts this long before the
# deadline, so it commits before the window opens with a safety margin.
EMERGENCY_LEAD = env_seconds("SPOTGUARD_EMERGENCY_LEAD", 300.0)
# Framework adapters take ``every=`` checkpoints synchronously, in the framework's own format, through the
# notice path with a synthetic notice: its id prefix keeps it out of daemon reports and commit records.
PERIODIC_NOTICE_PREFIX = "periodic-"
PERIODIC_SYNC_TIMEOUT = 600.0


#: exit code when the emergency save failed (nothing committed for this stop: progress since the last
#: commit is lost). EX_TEMPFAIL from sysexits.h: "try again later" — launchers restart on it like on 143,
#: and it tells the user apart from 143 ("stopped for a notice, nothing lost").
EXIT_SAVE_FAILED = 75
LEVEL_NONE, LEVEL_CHECKPOINT, LEVEL_EMERGENCY, LEVEL_REPLAY = 0, 1, 2, 3
#: ``_Result.error`` of a background save that handed its notice to an explicit loop's boundary path
HANDED_OVER = "handed over to the boundary path"
_ACTIONS = {0: "none", 1: "checkpoint", 2: "emergency", 3: "exit"}


def _ms(dt: Any) -> int:
    return int(dt.timestamp() * 1000)


def _env_float(name: str) -> Optional[float]:
    raw = os.environ.get(name)
    try:
        return float(raw) if raw else None
    except ValueError:
        return None

# After the background commit: how long the training thread has to reach a hook point and leave by
# Preempted before the agreement thread flushes the logs and os._exit()s with the same code.
EXIT_GRACE = env_seconds("SPOTGUARD_EXIT_GRACE", 1.0)
# Each ``hook.on_exit`` callback's bound (less when the deadline is nearer): the VM is going away.
EXIT_CALLBACK_TIMEOUT = env_seconds("SPOTGUARD_EXIT_CALLBACK_TIMEOUT", 2.0)
# A pre-hook held by a round gives up (exit 75) this long after the round's own bound, so that the agreement
# thread, whose collectives time out at that bound, normally reports the loss first.
HOLD_SLACK = 2.0
