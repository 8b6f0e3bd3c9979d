"""Issue 25 review: the store key that wakes a replica group's deadline fallback is this install's own.

torchrun's store outlives a worker attempt (the agent shares its rendezvous store with the workers), and
``TORCHELASTIC_RESTART_COUNT`` is each agent's own count (an agent restarted for a membership change keeps it):
a key named by that count could be one a previous attempt of the group set, and a listener waiting on it would
start a fallback at once, on a stale notice, in a healthy restarted group. In-process: a one-process gloo group
over a TCPStore standing for torchrun's.
"""

from __future__ import annotations

import threading
from datetime import timedelta
from types import SimpleNamespace
from typing import Any

import pytest
import torch.distributed as dist

from spotguard.hook.lifecycle import Lifecycle
from spotguard.notice import Notice
from spotguard.timefmt import utcnow
from spotguard.torchft import group_fallback
from spotguard.torchft.group_fallback import GroupFallback


def _notice(nid: str) -> Notice:
    now = utcnow()
    return Notice(id=nid, source="drill", kind="preemption", deadline=now + timedelta(seconds=30), received_at=now)


def test_a_key_left_by_a_previous_attempt_does_not_wake_a_restarted_group(monkeypatch: pytest.MonkeyPatch) -> None:
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=10))
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(store.port))
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    guard = SimpleNamespace(_log=SimpleNamespace(warning=print, error=print), _done=threading.Event(),
                            hook=SimpleNamespace(_life=Lifecycle()))
    fbs: list[GroupFallback] = []
    try:
        old = GroupFallback(guard)  # type: ignore[arg-type]  # the previous attempt: its watchdog set the key
        fbs.append(old)
        monkeypatch.setattr(old, "run", lambda notice: None)
        old.trigger(_notice("n-old"))
        assert old._thread is not None
        old._thread.join(10)
        ran: list[str] = []
        woke = threading.Event()

        def run(notice: Notice) -> None:
            ran.append(notice.id)
            woke.set()

        monkeypatch.setattr(GroupFallback, "run", lambda self, notice: run(notice))
        new = GroupFallback(guard)  # type: ignore[arg-type]  # the restarted attempt, same restart count
        fbs.append(new)
        new.trigger(_notice("n-new"))
        assert woke.wait(10)
        assert ran == ["n-new"]  # before: "n-old" (woken at once by the key the previous attempt left)
        monkeypatch.setattr(group_fallback, "_WAIT", timedelta(seconds=0.2))  # its store wait: shorter here
        idle = GroupFallback(guard)  # type: ignore[arg-type]  # no notice: its listener ends with the guard
        fbs.append(idle)
        guard._done.set()
        assert idle._thread is not None
        idle._thread.join(10)  # one store wait at most
        assert not idle._thread.is_alive()
    finally:
        guard._done.set()
        for fb in fbs:
            if fb._thread is not None:
                fb._thread.join(10)
        dist.destroy_process_group()


def test_a_failed_agreement_releases_the_optimizer_it_held(monkeypatch: pytest.MonkeyPatch) -> None:
    # the side group's all-reduce fails (a peer's VM went during the agreement): this rank had already held its
    # optimizer steps (_fallback_on); before, they stayed held for good (the training thread waits on _halt)
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=10))
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(store.port))
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    guard = SimpleNamespace(_log=SimpleNamespace(warning=print, error=print), _done=threading.Event(),
                            _lock=threading.Lock(), _phase="iter", _over=threading.Event(), _halt=threading.Event(),
                            _fallback_on=False,
                            hook=SimpleNamespace(_life=Lifecycle(), _steps=SimpleNamespace(count=5)))
    fb = GroupFallback(guard)  # type: ignore[arg-type]
    try:
        def peer_gone(*a: Any, **k: Any) -> None:
            raise RuntimeError("Connection closed by peer")

        monkeypatch.setattr(dist, "all_reduce", peer_gone)
        with pytest.raises(RuntimeError):
            fb.run(_notice("n-1"))
        assert not guard._fallback_on and guard._halt.is_set()
    finally:
        guard._done.set()
        if fb._thread is not None:
            fb._thread.join(10)
        dist.destroy_process_group()
