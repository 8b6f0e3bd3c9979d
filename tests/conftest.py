"""Project-wide test fixtures: free ports and short Unix-socket directories."""

from __future__ import annotations

import shutil
import socket
import tempfile
from pathlib import Path
from typing import Iterator

import pytest


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
