"""The agreement thread of one rank (``BackgroundAgreement``), or of a single process (``LocalAgreement``).

Why a module of its own (issue 28, part 2): the thread is parked in the c10d store (or a local dict), woken by a
generation key, and calls the hook back for one round (``AgreementMixin._background_round``, agreement.py); it
owns its gloo group, its store connections, its generation and its ``busy`` flag, which the hook reads
(``bg.busy``, ``bg.gen``, ``bg.wake``, ``bg.close``) and nothing else writes. What a round decides and how the
hook acts on it is agreement.py; the module docstring there describes the protocol.
"""

from __future__ import annotations

import atexit
import os
import threading
import time
import uuid
from datetime import timedelta
from typing import Any, Optional

import torch.distributed as dist

from .dist import NO_DEADLINE_MS, make_group, set_group_timeout
from .settings import LEVEL_EMERGENCY

__all__ = ["BackgroundAgreement", "LocalAgreement", "RoundFailed"]


#: how long one ``store.wait`` blocks before the thread looks again (c10d logs a line per timeout: keep it rare)
WAKE_POLL = timedelta(hours=1)
#: how long ``release`` waits for the woken thread to leave (a store round trip; bounded if the store hangs)
RELEASE_JOIN = 2.0


class RoundFailed(Exception):
    """A collective of the background agreement or save did not complete in its bound: peers lost."""


class BackgroundAgreement:
    """One rank's agreement thread, its gloo group and its store connections (see the module docstring).

    Created on every rank at install (``new_group`` and a broadcast are collective);
    ``ok`` is False when the store cannot be used, and the hook then keeps the
    boundary path.
    """

    def __init__(self, hook: Any) -> None:
        self.hook = hook
        self.ok = False
        self.group: Any = None
        self._waiter: Any = None
        self._setter: Any = None
        self._set_lock = threading.Lock()
        self.gen = 0  # the round this rank's thread waits for (or runs)
        self.busy = threading.Event()  # a round (or its save) is running
        self._closed = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._parked = False  # inside the C++ store.wait (what release() must get it out of)
        self._fails = 0  # consecutive failed rounds: the next self-woken round waits 0.5 s * 2**n (max 30 s)
        self._timers: list[threading.Timer] = []
        self.group = make_group()
        try:
            box = [uuid.uuid4().hex if hook._rank == 0 else None]
            dist.broadcast_object_list(box, src=0, group=self.group)
            self.token = f"spotguard/{box[0]}"
            store = dist.distributed_c10d._get_default_store()
            self._waiter = store.clone()
            self._setter = store.clone()
            self._checker = store.clone()  # the save's cancellation point asks it (own connection: no lock)
            self.ok = True
        except Exception as exc:  # noqa: BLE001 - no usable store: the boundary path still works
            hook._log.warning("background agreement unavailable: acting on notices at step boundaries",
                              error=f"{type(exc).__name__}: {exc}")
        stall = os.environ.get("SPOTGUARD_TEST_AGREE_STALL_RANK", "")  # tests: a peer that never joins
        self._stall = stall.strip() != "" and int(stall) == hook._rank
        self._stall_from = int(os.environ.get("SPOTGUARD_TEST_AGREE_STALL_ROUND", "0") or 0)

    def key(self, gen: int, rank: Optional[int] = None) -> str:
        """Round ``gen``'s wake key for ``rank`` (default: this rank). One key per rank, so that ``close``
        can wake this rank's own parked thread without starting a round anywhere else."""
        return f"{self.token}/wake/{gen}/{self.hook._rank if rank is None else rank}"

    def start(self) -> None:
        if self.ok and self._thread is None:
            self._thread = threading.Thread(target=self._run, name="spotguard-agreement", daemon=True)
            self._thread.start()
            atexit.register(self.release)

    def wake(self, deadline_ms: int) -> None:
        """Any thread: start the next round on every rank (idempotent while that round has not started)."""
        if not self.ok or self._closed.is_set():
            return
        try:
            with self._set_lock:
                g, value = self.gen, str(int(deadline_ms))
                world = self.hook._world
                self._setter.multi_set([self.key(g, r) for r in range(world)], [value] * world)
        except Exception as exc:  # noqa: BLE001 - the boundary path is gone too if the store is: log it
            self.hook._log.warning("cannot wake the agreement through the store", error=f"{type(exc).__name__}: {exc}")

    def cancel_round(self) -> None:
        """Any thread: every rank's ordinary save of the running round gives up (an emergency pre-empts it)."""
        try:
            with self._set_lock:
                self._setter.set(f"{self.token}/cancel/{self.gen}", "1")
        except Exception as exc:  # noqa: BLE001 - then only this rank's save gives up (the others fail with it)
            self.hook._log.warning("cannot reach the store to cancel the ordinary save", error=repr(exc))

    def round_cancelled(self) -> bool:
        """Has any rank cancelled the running round's ordinary save? (a store check, ~0.1 ms)"""
        try:
            return bool(self._checker.check([f"{self.token}/cancel/{self.gen}"]))
        except Exception:  # noqa: BLE001 - store unreachable: the collectives will say so
            return False

    def backoff(self) -> None:
        """A round failed: the next round this thread starts by itself waits (no livelock of failing rounds)."""
        self._fails += 1

    def wake_at(self, seconds: float, deadline_ms: int) -> None:
        """Wake in ``seconds`` (an emergency notice further off than ``EMERGENCY_LEAD``)."""
        t = threading.Timer(max(0.0, seconds) + 0.1, self.wake, args=(deadline_ms,))  # +0.1: past the lead
        t.daemon = True
        t.name = "spotguard-lead-timer"
        self._timers.append(t)
        t.start()

    def close(self, timeout: float = 5.0) -> None:
        """Stop taking part in rounds; wait (bounded) for a running one. The thread itself stays parked in
        its store wait (a daemon thread: nothing to join)."""
        self._closed.set()
        for t in self._timers:
            t.cancel()
        if self.busy.is_set():
            end = time.monotonic() + timeout
            while self.busy.is_set() and time.monotonic() < end:
                time.sleep(0.01)  # a round's collectives cannot be interrupted: nothing else to await
        self.release()

    def release(self) -> None:
        """Get this rank's thread out of its C++ ``store.wait`` and join it (bounded).

        Why: a daemon thread still parked there when the interpreter finalizes dies
        by ``pthread_exit`` the moment the wait returns — and it returns when the
        store's host (rank 0's process) exits at the same time, which at the end of
        a multi-node job is the common case; unwinding C++ frames that way aborts
        the process ("terminate called without an active exception", exit -6),
        torchrun restarts it and the job repeats its last steps. So: set this
        rank's own key of the round it waits for (no other rank wakes), join.
        Also registered with ``atexit``, which runs before finalization.
        """
        self._closed.set()
        t = self._thread
        if t is None or not t.is_alive() or t is threading.current_thread():
            return
        if not self._parked:
            return  # running a round or leaving by the backstop (both bounded, and they end the process)
        try:
            with self._set_lock:
                self._setter.set(self.key(self.gen), "closed")
        except Exception:  # noqa: BLE001 - the store is gone: the wait has returned (or will) by itself
            pass
        t.join(RELEASE_JOIN)

    @property
    def closed(self) -> bool:
        return self._closed.is_set()

    # ------------------------------------------------------------------ thread

    def _run(self) -> None:
        h = self.hook
        while not self._closed.is_set() and not h._life.leaving():
            g = self.gen
            try:
                level, deadline_ms = h._local_level()
                if level > 0 and h._bg_on and h._loop.range_broken is None:  # came while the previous round ran
                    if self._fails and level < LEVEL_EMERGENCY and \
                            self._closed.wait(min(30.0, 0.5 * 2 ** (self._fails - 1))):
                        return
                    self.wake(deadline_ms)
                deadline_ms = self._wait(g)
            except Exception as exc:  # noqa: BLE001 - the store went away (job ending): stop quietly
                if not self._closed.is_set():
                    h._log.debug("agreement thread stops", error=f"{type(exc).__name__}: {exc}")
                return
            if deadline_ms is None or self._closed.is_set():
                return
            if self._stall and g >= self._stall_from:
                h._log.warning("test: this rank's agreement thread never joins", gen=g)
                self._closed.wait()
                return
            self.busy.set()
            try:
                h._background_round(g, deadline_ms)
            except BaseException as exc:  # noqa: BLE001 - never let the thread die silently
                h._log.error("background agreement failed", error=f"{type(exc).__name__}: {exc}")
                self.backoff()
                try:
                    h._release_hold()
                except Exception:  # noqa: BLE001
                    pass
            finally:
                self.gen = g + 1
                self.busy.clear()

    def _wait(self, g: int) -> Optional[int]:
        while not self._closed.is_set():
            try:
                self._parked = True
                try:
                    self._waiter.wait([self.key(g)], WAKE_POLL)
                finally:
                    self._parked = False
            except Exception as exc:  # noqa: BLE001 - DistStoreError on timeout: look again
                if "timeout" in str(exc).lower() or "timed out" in str(exc).lower():
                    continue
                raise
            raw = self._waiter.get(self.key(g))
            try:
                return int(raw)
            except ValueError:
                return NO_DEADLINE_MS
        return None

    # ------------------------------------------------------------------ one round

    def gather(self, mine: Any, bound: float) -> list[Any]:
        """The round's one collective, bounded: RoundFailed when a peer does not join in time."""
        set_group_timeout(self.group, bound)
        out: list[Any] = [None] * dist.get_world_size(self.group)
        try:
            dist.all_gather_object(out, mine, group=self.group)
        except Exception as exc:  # noqa: BLE001 - gloo timeout / connection reset
            raise RoundFailed(f"agreement round: {type(exc).__name__}: {exc}") from exc
        return out


class LocalAgreement(BackgroundAgreement):
    """The agreement thread of a process without ``torch.distributed`` (world size 1: a single-GPU VM).

    Why a variant and not the store-based class: there is no c10d store and no
    process group to gather over (and the hook never creates one on the user's
    behalf). A round with one rank needs no collective: the wake keys live in a
    dict under a condition variable, ``gather`` returns this rank's own entry,
    and the save runs with ``group=None`` (``_save`` skips its collectives when
    not distributed). Everything else — the rounds, the hold, the staged save,
    leaving from the background — is the same code as under ``torch.distributed``.
    """

    def __init__(self, hook: Any) -> None:  # noqa: D107 - no super().__init__: no group, no store
        self.hook = hook
        self.ok = True
        self.group = None
        self.token = f"spotguard-local/{uuid.uuid4().hex}"
        self._set_lock = threading.Lock()
        self._keys_cv = threading.Condition(threading.Lock())
        self._keys: dict[int, str] = {}  # round -> its wake value (a deadline in ms, or "closed")
        self._cancelled: set[int] = set()
        self.gen = 0
        self.busy = threading.Event()
        self._closed = threading.Event()
        self._thread = None
        self._parked = False
        self._fails = 0
        self._timers = []
        self._stall = False
        self._stall_from = 0

    def _put(self, gen: int, value: str) -> None:
        with self._keys_cv:
            self._keys.setdefault(gen, value)  # the first wake of a round wins (as a store key once set)
            self._keys_cv.notify_all()

    def wake(self, deadline_ms: int) -> None:
        if self._closed.is_set():
            return
        self._put(self.gen, str(int(deadline_ms)))

    def cancel_round(self) -> None:
        with self._keys_cv:
            self._cancelled.add(self.gen)

    def round_cancelled(self) -> bool:
        return self.gen in self._cancelled

    def release(self) -> None:
        """Wake this process's own parked thread so that it leaves (no store: a condition variable)."""
        self._closed.set()
        with self._keys_cv:
            self._keys_cv.notify_all()
        t = self._thread
        if t is not None and t.is_alive() and t is not threading.current_thread() and self._parked:
            t.join(RELEASE_JOIN)

    def _wait(self, g: int) -> Optional[int]:
        with self._keys_cv:
            self._parked = True
            try:
                while g not in self._keys and not self._closed.is_set():
                    self._keys_cv.wait()
            finally:
                self._parked = False
            raw = self._keys.pop(g, None)
            for old in [k for k in self._keys if k < g]:
                self._keys.pop(old, None)
        if raw is None:
            return None
        try:
            return int(raw)
        except ValueError:
            return NO_DEADLINE_MS

    def gather(self, mine: Any, bound: float) -> list[Any]:
        """One rank: the round's "collective" is this rank's own entry."""
        return [mine]
