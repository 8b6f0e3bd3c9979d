"""Fixtures the framework adapter tests share."""

from __future__ import annotations

from pathlib import Path
from typing import Iterator

import pytest

from spotguard.launch import DaemonProc

from .._daemons import running_daemon


@pytest.fixture
def daemon(short_tmp: Path, tmp_path: Path) -> Iterator[DaemonProc]:
    """A real spotguard daemon on a short socket path (AF_UNIX: 107 bytes at most), its log in the test's folder."""
    with running_daemon(short_tmp / "d.sock", tmp_path / "daemon.log") as d:
        yield d
