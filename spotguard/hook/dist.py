"""The collectives the hook owns: per-step agreement, bounded timeouts, teardown.

Why a dedicated gloo group: the flag must be read without syncing a CUDA stream
and without interleaving with the user's NCCL traffic, and during teardown the
checkpoint planning must not depend on an NCCL communicator that may be wedged.

Why "launch at the post-hook, wait at the next pre-hook": the MAX all-reduce of
one small tensor is long finished one step later, so the wait costs nothing,
and every rank reads the same value at the same boundary (no rank can block in
a collective the others never enter, because every rank launches exactly one
per decision point).
"""

from __future__ import annotations

import threading
import time
from datetime import timedelta
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

__all__ = [
    "NO_DEADLINE_MS",
    "is_dist",
    "Agreement",
    "make_group",
    "group_alive",
    "set_group_timeout",
    "run_bounded",
    "teardown",
]

NO_DEADLINE_MS = 2**62  # "no notice here": loses every MIN over deadlines
DEFAULT_GROUP_TIMEOUT = timedelta(minutes=30)


def is_dist() -> bool:
    return dist.is_available() and dist.is_initialized()


def make_group() -> Optional[Any]:
    """A gloo group over all ranks (collective: every rank calls it at install)."""
    if not is_dist():
        return None
    return dist.new_group(backend="gloo", timeout=DEFAULT_GROUP_TIMEOUT)


def group_alive(group: Any) -> bool:
    """Whether ``group`` is still registered (the user may have called destroy_process_group)."""
    if group is None or not is_dist():
        return False
    try:
        return dist.distributed_c10d._world.pg_map.get(group) is not None
    except Exception:
        return False


def set_group_timeout(group: Any, seconds: float) -> None:
    """Bound every later collective on ``group`` (gloo honours a changed default timeout)."""
    if group is None or not group_alive(group):
        return
    try:
        dist.distributed_c10d._set_pg_timeout(timedelta(seconds=max(1.0, seconds)), group)
    except Exception:  # best effort: older torch without the helper
        pass


class Agreement:
    """One non-blocking MAX all-reduce of ``[level, -deadline_ms]`` per decision point.

    The MAX of levels is the strongest action any rank asks for; the MAX of
    negated deadlines is the earliest deadline any rank knows.
    """

    def __init__(self, group: Any) -> None:
        self.group = group
        self._work: Any = None
        self._tensor: Optional[torch.Tensor] = None
        self._local: Optional[tuple[int, int]] = None

    @property
    def pending(self) -> bool:
        return self._work is not None or self._local is not None

    def launch(self, level: int, deadline_ms: int) -> None:
        if self.group is None:
            self._local = (level, deadline_ms)
            return
        t = torch.tensor([level, -deadline_ms], dtype=torch.int64)
        self._work = dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group, async_op=True)
        self._tensor = t

    def collect(self) -> Optional[tuple[int, int]]:
        """Wait for the launched reduction (finished long ago in practice): (level, deadline_ms) or None."""
        if self.group is None:
            out, self._local = self._local, None
            return out
        work, t = self._work, self._tensor
        if work is None or t is None:
            return None
        self._work = self._tensor = None
        work.wait()
        return int(t[0]), -int(t[1])

    def blocking(self, level: int, deadline_ms: int) -> tuple[int, int]:
        """A one-off agreement (resume time): every rank must call it."""
        self.drop()
        self.launch(level, deadline_ms)
        out = self.collect()
        assert out is not None
        return out

    def drop(self, timeout: float = 2.0) -> None:
        """Settle an outstanding reduction without acting on it (process exit)."""
        work = self._work
        self._work = self._tensor = None
        self._local = None
        if work is not None:
            try:
                work.wait(timedelta(seconds=timeout))
            except Exception:
                pass


def run_bounded(fn: Callable[[], Any], timeout: float, name: str = "spotguard-bounded") -> tuple[bool, Optional[BaseException]]:
    """Run ``fn`` in a daemon thread; (finished without error, error-or-None). A hang leaves the thread behind."""
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            fn()
            box["ok"] = True
        except BaseException as exc:  # noqa: BLE001 - reported to the caller
            box["err"] = exc

    th = threading.Thread(target=target, name=name, daemon=True)
    th.start()
    th.join(timeout)
    if th.is_alive():
        return False, TimeoutError(f"{name} still running after {timeout:g} s")
    return bool(box.get("ok")), box.get("err")


def _abort_all() -> None:
    c10d = dist.distributed_c10d
    abort = getattr(c10d, "_abort_process_group", None)
    if abort is None:
        raise RuntimeError("this torch has no _abort_process_group")
    abort()


def teardown(group: Any, *, peers_ok: bool, timeout: float = 5.0) -> tuple[str, float]:
    """Leave the process groups without ever hanging: (method, seconds).

    Peers believed alive: a bounded barrier on the gloo group, then
    ``destroy_process_group``. Peers gone (or the barrier failed): abort, which
    does not wait for them; if abort is unavailable or fails, destroy. Each step
    runs in a thread with a timeout; "timeout" tells the caller to ``os._exit``.
    """
    t0 = time.monotonic()
    if not is_dist():
        return "none", 0.0
    if peers_ok and group_alive(group):
        set_group_timeout(group, min(3.0, timeout))
        ok, _ = run_bounded(lambda: dist.all_reduce(torch.zeros(1), group=group), timeout, "spotguard-barrier")
        peers_ok = ok
    if peers_ok:
        ok, _ = run_bounded(dist.destroy_process_group, timeout, "spotguard-destroy")
        if ok:
            return "destroy", time.monotonic() - t0
    ok, _ = run_bounded(_abort_all, timeout, "spotguard-abort")
    if ok:
        return "abort", time.monotonic() - t0
    if is_dist():
        ok, err = run_bounded(dist.destroy_process_group, timeout, "spotguard-destroy")
        if ok or (err is not None and not isinstance(err, TimeoutError)):
            return "destroy", time.monotonic() - t0
        return "timeout", time.monotonic() - t0
    return "abort", time.monotonic() - t0
