"""A local store whose *background* (periodic) checkpoint writes are slow: a fixed delay per write item.

The delay sits in ``planner.resolve_data`` (called once per item as the writer
serialises it), so the hook's progress estimate and cancellation points see a
steady, slow upload; writes from any other thread (the emergency path) run at
full speed.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

from spotguard.storage.local import LocalStorage
from spotguard.storage.local_dcp import ChecksumWriter


class _SlowPlanner:
    def __init__(self, inner: Any, delay: float) -> None:
        self._inner = inner
        self._delay = delay

    def resolve_data(self, item: Any) -> Any:
        time.sleep(self._delay)
        return self._inner.resolve_data(item)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


class _SlowWriter(ChecksumWriter):  # reports what it wrote, like every spotguard writer
    delay = 0.0

    def write_data(self, plan: Any, planner: Any) -> Any:
        return super().write_data(plan, _SlowPlanner(planner, self.delay))


class SlowPeriodicStorage(LocalStorage):
    def __init__(self, root: str | Path, delay_per_item: float) -> None:
        super().__init__(root)
        self.delay = delay_per_item
        self.slow_writes = 0

    def dcp_writer(self, key: str, *, thread_count: int | None = None) -> Any:
        if threading.current_thread().name != "spotguard-periodic":
            return super().dcp_writer(key, thread_count=thread_count)
        self.slow_writes += 1
        path = self._path(key)
        self._mkdirs(path)
        w = _SlowWriter(self, key, single_file_per_rank=True, sync_files=True, thread_count=1, overwrite=True)
        w.delay = self.delay
        return w
