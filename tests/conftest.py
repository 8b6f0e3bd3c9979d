"""Project-wide test fixtures: free ports and short Unix-socket directories; the repository byte-compiled once."""

from __future__ import annotations

import compileall
import shutil
import socket
import tempfile
from pathlib import Path
from typing import Iterator

import pytest

REPO = Path(__file__).resolve().parents[1]


def pytest_sessionstart(session: pytest.Session) -> None:
    """Byte-compile the repository's Python once, before any test starts a process. With
    ``PYTHONDONTWRITEBYTECODE=1`` (set in the CI's environment) no process writes ``__pycache__``, so every
    torchrun worker, oracle run, daemon and CLI call compiled each ``spotguard`` module it imports afresh
    (~0.1 CPU-s for the 48 modules of ``spotguard.hook``; many hundreds of such processes a run). Same sources,
    same code: a ``.pyc`` is used only while its source's size and mtime match; where the tree cannot be
    written, nothing changes."""
    for sub in ("spotguard", "tests", "examples", "benchmarks"):
        if (REPO / sub).is_dir():
            compileall.compile_dir(str(REPO / sub), quiet=2, workers=1)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def short_tmp() -> Iterator[Path]:
    """A short directory under /tmp: AF_UNIX paths are limited to 107 bytes."""
    d = tempfile.mkdtemp(prefix="sg-", dir="/tmp")
    try:
        yield Path(d)
    finally:
        shutil.rmtree(d, ignore_errors=True)
