"""structlog set-up shared by daemon, hook, emulator and CLI."""

from __future__ import annotations

import logging
import sys
from typing import Any, TextIO

import structlog

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
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(logging.getLevelName(level.upper())),
        logger_factory=structlog.PrintLoggerFactory(file=stream or sys.stderr),
        cache_logger_on_first_use=False,
    )


def get_logger(name: str, **bound: Any) -> Any:
    return structlog.get_logger(logger=name, **bound)
