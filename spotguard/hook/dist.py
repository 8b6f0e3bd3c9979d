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
import weakref
import time
from datetime import timedelta
from typing import Any, Callable, Optional, Sequence

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
    "guard_destroy",
    "unguard_destroy",
    "destroy_group",
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


def all_max(group: Optional[Any], values: Sequence[int]) -> list[int]:
    """Element-wise MAX of ``values`` over ``group``'s ranks (blocking; ``values`` as they are without a group):
    how ranks that each know part of the picture decide alike."""
    if group is None:
        return [int(v) for v in values]
    t = torch.tensor([int(v) for v in values], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return [int(v) for v in t]


def gather_writes(group: Optional[Any], mine: dict[str, Any]) -> dict[str, Any]:
    """Every rank's report of the files it wrote (``Storage.write_log``), merged: what the commit record names.

    A collective on the hook's gloo group (every rank calls it); without one, this rank's report.
    """
    return gather_writes_with(group, mine, None)[0]


def gather_writes_with(group: Optional[Any], mine: dict[str, Any], info: Any) -> tuple[dict[str, Any], list[Any]]:
    """``gather_writes`` plus every rank's ``info`` (by rank in ``group``) in the same collective: who wrote
    what and when it was durable (``save.py``), at no extra round trip."""
    from ..storage.integrity import merge  # noqa: PLC0415

    if group is None:
        return merge([mine]), [info]
    reports: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(reports, (mine, info), group=group)
    return merge((r[0] if r else None) or {} for r in reports), [r[1] if r else None for r in reports]


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
    """One non-blocking MAX all-reduce of ``[level, -deadline_ms, *flags]`` per decision point.

    The MAX of levels is the strongest action any rank asks for; the MAX of
    negated deadlines is the earliest deadline any rank knows. ``flags`` ride
    along for free (periodic checkpoints: ``(due, busy)``): after ``collect``
    every rank reads the same MAX of each in ``self.flags``.
    """

    NFLAGS = 2

    def __init__(self, group: Any) -> None:
        self.group = group
        self._work: Any = None
        self._tensor: Optional[torch.Tensor] = None
        self._local: Optional[tuple[int, int]] = None
        self._local_flags: tuple[int, ...] = (0,) * self.NFLAGS
        self.flags: tuple[int, ...] = (0,) * self.NFLAGS  # agreed flags of the last collect()

    @property
    def pending(self) -> bool:
        return self._work is not None or self._local is not None

    def launch(self, level: int, deadline_ms: int, flags: tuple[int, ...] = (0, 0)) -> None:
        flags = tuple(int(f) for f in flags)[: self.NFLAGS] + (0,) * max(0, self.NFLAGS - len(flags))
        if self.group is None:
            self._local = (level, deadline_ms)
            self._local_flags = flags
            return
        t = torch.tensor([level, -deadline_ms, *flags], dtype=torch.int64)
        self._work = dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group, async_op=True)
        self._tensor = t

    def collect(self) -> Optional[tuple[int, int]]:
        """Wait for the launched reduction (finished long ago in practice): (level, deadline_ms) or None."""
        self.flags = (0,) * self.NFLAGS
        if self.group is None:
            out, self._local = self._local, None
            if out is not None:
                self.flags = self._local_flags
            return out
        work, t = self._work, self._tensor
        if work is None or t is None:
            return None
        self._work = self._tensor = None
        work.wait()
        self.flags = tuple(int(x) for x in t[2:])
        return int(t[0]), -int(t[1])

    def blocking(self, level: int, deadline_ms: int) -> tuple[int, int]:
        """A one-off agreement (resume time): every rank must call it."""
        self.drop()
        self.launch(level, deadline_ms)
        out = self.collect()
        assert out is not None
        return out

    def drop(self, timeout: float = 2.0) -> Optional[tuple[int, int]]:
        """Settle an outstanding reduction without acting on it (teardown, process exit).

        Returns its (level, deadline_ms) if it finished within ``timeout``, else None.
        """
        work, t, local = self._work, self._tensor, self._local
        self._work = self._tensor = None
        self._local = None
        if work is None:
            return local
        try:
            if work.wait(timedelta(seconds=timeout)) is False or t is None:
                return None
            return int(t[0]), -int(t[1])
        except Exception:
            return None


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


# --- quiescing before the user's destroy_process_group ------------------------------
#
# Why: the hook launches one non-blocking flag all-reduce at every iteration's end
# on its own gloo group, so after the last step one is still outstanding (and a
# periodic background save may be running on its group). If the user then calls
# ``destroy_process_group()``, the groups are shut down under that work: with gloo
# on torch 2.13 a rank occasionally aborts in a gloo thread ("terminate called
# without an active exception", torchrun reports -6). Every rank launched the same
# number of reductions, so waiting for them cannot deadlock; the wait is bounded
# anyway. The wrapper is installed once per process, is transparent for other
# groups and calls, and runs every live hook's ``quiesce`` first.

_guard_lock = threading.Lock()
_quiescers: list["weakref.WeakMethod[Callable[[], None]]"] = []
_original_destroy: Optional[Callable[..., Any]] = None


def _live_quiescers() -> list[Callable[[], None]]:
    with _guard_lock:
        alive = [(ref, ref()) for ref in _quiescers]
        _quiescers[:] = [ref for ref, fn in alive if fn is not None]
        return [fn for _, fn in alive if fn is not None]


def _guarded_destroy(group: Any = None) -> Any:
    whole = group is None or group is getattr(dist.GroupMember, "WORLD", None)
    if whole:
        for quiesce in _live_quiescers():
            try:
                quiesce()
            except Exception:  # noqa: BLE001 - never stand between the user and their teardown
                pass
    assert _original_destroy is not None
    return _original_destroy(group)


_guarded_destroy.__wrapped__ = None  # type: ignore[attr-defined]  # set at install
_guarded_destroy.__spotguard__ = True  # type: ignore[attr-defined]


def guard_destroy(quiesce: Callable[[], None]) -> None:
    """Run ``quiesce`` (a bound method, held weakly) before every ``destroy_process_group()`` of the world."""
    global _original_destroy
    with _guard_lock:
        _quiescers.append(weakref.WeakMethod(quiesce))  # type: ignore[arg-type]
        if _original_destroy is None:
            current = dist.destroy_process_group
            if getattr(current, "__spotguard__", False):  # pragma: no cover - module reloaded
                return
            _original_destroy = current
            _guarded_destroy.__wrapped__ = current  # type: ignore[attr-defined]
            _guarded_destroy.__doc__ = current.__doc__
            dist.destroy_process_group = _guarded_destroy  # type: ignore[assignment]
            dist.distributed_c10d.destroy_process_group = _guarded_destroy  # type: ignore[assignment]


def unguard_destroy(quiesce: Callable[[], None]) -> None:
    """Forget ``quiesce`` (the wrapper itself stays: it is transparent without hooks)."""
    with _guard_lock:
        _quiescers[:] = [r for r in _quiescers if r() is not None and r() != quiesce]


def destroy_group(group: Any) -> bool:
    """Destroy one of the hook's own (sub)groups, bypassing the guard; False if it was already gone."""
    if group is None or not group_alive(group):
        return False
    destroy = _original_destroy or dist.destroy_process_group
    try:
        destroy(group)
        return True
    except Exception:  # noqa: BLE001 - already destroyed by someone else
        return False
