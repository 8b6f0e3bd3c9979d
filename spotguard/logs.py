"""structlog set-up shared by daemon, hook, emulator and CLI."""

from __future__ import annotations

import logging
import random
import sys
from typing import Any, TextIO

# structlog imports rich when it is installed, and rich.style draws random.getrandbits(24) at
# import: without this guard, importing spotguard after seeding shifts the user's Python RNG
# stream (a run with the hook would no longer equal the same run without it).
_rng_state = random.getstate()
import structlog  # noqa: E402

random.setstate(_rng_state)
del _rng_state

__all__ = ["configure_logging", "get_logger"]


def configure_logging(fmt: str = "json", level: str = "info", stream: TextIO | None = None) -> None:
    """JSON lines for machines (daemon default), console for humans."""
    if fmt not in ("json", "console"):
        raise ValueError(f"log format must be json or console, got {fmt!r}")
    renderer: Any = (
        structlog.processors.JSONRenderer()
        if fmt == "json"
        else structlog.dev.ConsoleRenderer(colors=False)
    )
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            _logger_key,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(logging.getLevelName(level.upper())),
        # WriteLogger writes message and newline in one call: lines from processes
        # sharing one stderr (torchrun workers) never run together.
        logger_factory=structlog.WriteLoggerFactory(file=stream or sys.stderr),
        cache_logger_on_first_use=False,
    )


def _logger_key(_: Any, __: str, event_dict: dict[str, Any]) -> dict[str, Any]:
    """Render ``logger_name`` as ``logger`` (see ``get_logger``)."""
    if "logger_name" in event_dict and "logger" not in event_dict:
        event_dict["logger"] = event_dict.pop("logger_name")
    return event_dict


def get_logger(name: str, **bound: Any) -> Any:
    # structlog.get_logger's own first parameter is called ``logger``, so the
    # name travels as ``logger_name`` and is rendered as ``logger``.
    return structlog.get_logger(logger_name=name, **bound)
