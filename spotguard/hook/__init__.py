"""``install_preemption_hook``: one line in training code (docs/api.md).

Dispatches on the trainer's type: a dict of stateful objects gets the plain
PyTorch ``Hook``; framework trainers go through ``adapters`` (matched by type
name, so no framework is imported to check).
"""

from __future__ import annotations

import os
import re
from typing import Any, Callable, Mapping, Optional

from ..notice import Notice
from . import adapters
from . import events
from .core import Hook, Preempted

__all__ = ["install_preemption_hook", "Preempted", "Hook", "events", "parse_every"]

_UNITS = {"": 1.0, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}


def parse_every(every: str | int | float | None) -> Optional[float]:
    """``"15m"``, ``"90s"``, ``"1h30m"``, ``"2h"`` or a number of seconds -> seconds (> 0), None for None."""
    if every is None:
        return None
    if isinstance(every, bool):
        raise ValueError(f"every must be a duration like '15m' or seconds, got {every!r}")
    if isinstance(every, (int, float)):
        seconds = float(every)
    elif isinstance(every, str):
        text = every.strip().lower()
        parts = re.findall(r"(\d+(?:\.\d+)?)\s*([smhd]?)", text)
        if not parts or re.sub(r"(\d+(?:\.\d+)?)\s*([smhd]?)", "", text).strip():
            raise ValueError(f"every must be a duration like '15m', '90s', '1h30m', got {every!r}")
        seconds = sum(float(n) * _UNITS[u] for n, u in parts)
    else:
        raise ValueError(f"every must be a duration like '15m' or seconds, got {type(every).__name__}")
    if not seconds > 0 or seconds != seconds or seconds == float("inf"):
        raise ValueError(f"every must be a positive duration, got {every!r}")
    return seconds


def install_preemption_hook(
    trainer: Any,
    storage: Any = None,
    *,
    socket: str | os.PathLike[str] | None = None,
    every: str | int | float | None = None,
    keep: int | None = None,
    exit_code: int = 143,
    on_notice: Callable[[Notice], Any] | None = None,
    scope: Mapping[str, str] | None = None,
) -> Any:
    """Turn a termination notice into a committed checkpoint and a clean exit; returns the hook.

    Call after ``torch.distributed.init_process_group`` (on every rank) and
    before training; then ``start = hook.resume()`` (or ``for step in hook.range(total)``).
    Checked here, so a mistake fails now rather than during a notice: a dict hook
    under a launcher's ``WORLD_SIZE`` > 1 without a process group (RuntimeError), a
    malformed storage URI (``StorageURIError``, a ValueError), a storage every rank
    cannot write and delete a small object in (``StorageError``). Reference: docs/api.md.

    ``on_notice(notice)`` runs on a background thread for every notice; return
    ``False`` to make the hook ignore that notice.

    ``every``: periodic safety-net checkpoints in the background, a duration
    (``"15m"``, ``"90s"``, ``"1h30m"``) or a number of **seconds** (``every=900``
    is ``"15m"``; a wall-clock period because what a lost VM costs is time, and
    step times vary). Pass the same value on every rank. The state is copied to
    CPU at an iteration boundary (one copy of the state, time and memory, logged
    as ``staging_seconds``) and uploaded by a background thread on its own gloo
    group while training goes on; it commits like any checkpoint (reason
    ``periodic``). A notice during such an upload: the upload is finished if its
    own throughput says it ends within half of the time left before the
    deadline (cut off there regardless), else aborted (multipart uploads
    aborted, nothing committed); then the emergency checkpoint is written.
    See docs/storage.md. Framework trainers (Lightning, Hugging Face, Accelerate)
    honour ``every`` too: the framework writes its own checkpoint at a boundary,
    synchronously, committed with reason ``periodic``.

    ``scope``: for a resume on another world size, ``{"key": "global" | "per_rank"}``
    overrides the default scope of a state-dict entry (schedulers, scalers and
    stateful objects are global, loaders per rank; see docs/frameworks.md
    "Elastic resume"). Plain-PyTorch dicts only.
    """
    period = parse_every(every)
    sock = os.fspath(socket) if socket is not None else None
    if isinstance(trainer, Mapping):
        from ..logs import configure_logging

        import structlog

        if not structlog.is_configured():
            configure_logging(os.environ.get("SPOTGUARD_LOG_FORMAT", "json"),
                              os.environ.get("SPOTGUARD_LOG_LEVEL", "info"))
        return Hook(trainer, storage, socket=sock, keep=keep, exit_code=exit_code, on_notice=on_notice,
                    every=period, scope=scope)
    if scope is not None:
        raise TypeError("scope= applies to a dict of stateful objects only (frameworks keep their own state)")
    adapter = adapters.find(trainer)
    if adapter is not None:
        return adapter.load()(trainer, storage, socket=sock, every=period, keep=keep, exit_code=exit_code,
                              on_notice=on_notice)
    raise TypeError(
        f"install_preemption_hook does not know {type(trainer).__module__}.{type(trainer).__qualname__}; "
        "supported: " + "; ".join(adapters.supported())
    )
