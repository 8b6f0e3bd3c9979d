"""Peer liveness that does not depend on the training thread: a vanished node ends in an exit, not a hang.

Why: a powered-off VM sends no TCP reset. The other nodes' ranks then wait inside
whatever collective they are in — the user's DDP all-reduce, the hook's agreement,
DCP's planning — for the process group's timeout (gloo: 30 minutes by default).
Nothing on the training thread can notice, because the training thread is the one
that is stuck.

How: each rank runs one daemon thread with its *own* gloo group (created in the
hook's constructor, on every rank in the same order; used by that thread only).
Every ``interval`` seconds a sender thread sends a tiny beat (one int64) to every
peer; a receiver thread keeps one receive posted per peer and waits on them, each
with that peer's own deadline. A peer from which nothing arrived for ``timeout``
seconds is *lost*:

- one log line ``peers_lost`` naming the silent ranks and their hosts (node rank,
  pid), how long each has been silent, and what happens next;
- ``checkpoint_failed`` to the daemon for an active notice (nothing was committed
  for it on this rank's watch);
- the user's process groups are aborted (``torch.distributed.distributed_c10d.
  _abort_process_group``: NCCL aborts its communicators, so a rank stuck in an
  NCCL collective returns; gloo — measured on torch 2.13 — returns at once but does
  **not** wake a collective already blocked in another thread, see docs/reliability.md);
- then the process leaves with ``os._exit(EXIT_PEERS_LOST)`` (69, EX_UNAVAILABLE),
  or the hook's own exit code (143) when this run's state at the current step is
  already in a committed checkpoint (B froze right after the commit). Bound: ``timeout + ABORT_BUDGET + FLUSH_BUDGET`` after the peer's last
  beat (under ``timeout`` + ``interval`` + 1.5 s after the freeze).

Nothing partial is ever committed by this: a commit record is written by rank 0
only after every rank reported its bytes durable (``gather_writes``), so a lost
peer stops the save before the record, and the previous committed checkpoint stays
the newest. Surviving ranks do not commit a checkpoint of their own (why not:
docs/reliability.md, "A node that vanishes").

What is *not* lost: a peer whose process ended (crash, SIGKILL, normal exit) closes
its sockets, so its receive fails at once; that is not silence — torchrun and the
collectives' own errors deal with it — and the peer is dropped from the watch. A
peer that stops its watch while staying alive (``hook.close()``, the user's
``destroy_process_group``) first sends a *bye* beat, so a rank that evaluates for
an hour after closing its hook is never declared lost.

False alarms: only a rank whose Python threads cannot run for ``timeout`` seconds
looks silent. A training thread busy in Python code hands the GIL over every 5 ms
(``sys.getswitchinterval``); torch ops release it; what holds it longest is a
single C call that keeps the GIL (a huge ``pickle.dumps``, ``list.sort``): measured
gaps are in docs/reliability.md. Hence the default ``SPOTGUARD_PEER_TIMEOUT`` of
20 s: above any such hold seen, below GCP/Azure's 30 s notice.
"""

from __future__ import annotations

import os
import socket as _socket
import sys
import threading
import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from ..history.writer import tap as history_tap
from ..logs import get_logger
from . import events as ev
from .clock import step_of
from .dist import destroy_group, is_dist, run_bounded
from .lifecycle import exit_code_of
from .settings import env_seconds

__all__ = [
    "EXIT_PEERS_LOST",
    "PEER_TIMEOUT",
    "PEER_INTERVAL",
    "PeerWatch",
    "Lost",
    "watch_peers",
    "stop_watch",
]

#: exit code of a rank whose peers stopped answering (EX_UNAVAILABLE from sysexits.h): nothing was
#: committed for this stop; the job resumes from the newest committed checkpoint. Launchers restart on it.
EXIT_PEERS_LOST = 69
# Budgets of the steps between "lost" and os._exit (each bounded on its own).
ABORT_BUDGET = 1.0
FLUSH_BUDGET = 0.3
_BYE = -1
_TAG = 7331


def _env_seconds(name: str, default: float) -> float:
    """``settings.env_seconds``, a bad value reported on the hook's log (read when a watch starts)."""
    return env_seconds(name, default, get_logger("spotguard.hook", component="hook").warning)


#: seconds without a beat from a peer before it counts as lost (``SPOTGUARD_PEER_TIMEOUT``).
PEER_TIMEOUT = 20.0
#: seconds between two beats (``SPOTGUARD_PEER_INTERVAL``).
PEER_INTERVAL = 1.0


@dataclass
class Lost:
    """What the watch concluded: the silent ranks, where they ran, and for how long each was silent."""

    ranks: list[int]
    hosts: dict[int, str]
    silent: dict[int, float]
    left: list[int] = field(default_factory=list)  # ranks whose process ended (not silence)

    def describe(self) -> str:
        return ", ".join(f"rank {r} on {self.hosts.get(r, '?')} (silent {self.silent[r]:.1f} s)" for r in self.ranks)


class PeerWatch:
    """One daemon thread beating over its own gloo group; calls ``on_lost`` once if a peer goes silent.

    ``__init__`` is collective (every rank, same order): it creates the group and
    exchanges each rank's host identity. ``on_lost`` runs on the watch thread; the
    default (``exit_on_lost``) never returns.
    """

    def __init__(self, *, timeout: Optional[float] = None, interval: Optional[float] = None,
                 on_lost: Optional[Callable[["PeerWatch", Lost], None]] = None) -> None:
        self.timeout = timeout if timeout is not None else _env_seconds("SPOTGUARD_PEER_TIMEOUT", PEER_TIMEOUT)
        self.interval = interval if interval is not None else _env_seconds("SPOTGUARD_PEER_INTERVAL", PEER_INTERVAL)
        self.interval = min(self.interval, self.timeout / 2)  # at least two beats per timeout
        self.rank = dist.get_rank()
        self.world = dist.get_world_size()
        self._on_lost = on_lost
        self._log = get_logger("spotguard.hook", component="hook", rank=self.rank)
        # Its own group, used by the watch thread only. A long timeout: silence is judged here, not by gloo.
        self.group: Any = dist.new_group(backend="gloo", timeout=timedelta(hours=24))
        me = f"{_socket.gethostname()}/node{os.environ.get('GROUP_RANK', '?')}/pid{os.getpid()}"
        names: list[Any] = [None] * self.world
        dist.all_gather_object(names, me, group=self.group)
        self.hosts: dict[int, str] = {r: str(n) for r, n in enumerate(names)}
        self._stop = threading.Event()
        self._mu = threading.Lock()
        self._peers = {r for r in range(self.world) if r != self.rank}
        self._farewell: set[int] = set()
        self._said_bye: set[int] = set()  # peers whose watch ended with a bye (their loop is over), for good
        self._bye_cv = threading.Condition(self._mu)
        self.lost: Optional[Lost] = None
        self.committed_step: Optional[int] = None  # the step of this run's last commit (set by the hook)
        self.beats = 0
        self._thread = threading.Thread(target=self._run, name="spotguard-peers", daemon=True)
        self._sender = threading.Thread(target=self._send_loop, name="spotguard-peers-send", daemon=True)

    def start(self) -> "PeerWatch":
        self._sender.start()
        self._thread.start()
        return self

    @property
    def running(self) -> bool:
        return self._thread.is_alive()

    def stop(self, timeout: float = 2.5) -> bool:
        """Say bye to the peers and end both threads (bounded); destroy the group if they ended."""
        self._stop.set()
        end = time.monotonic() + timeout
        for th in (self._sender, self._thread):
            if th.ident is not None and th is not threading.current_thread():
                th.join(max(0.0, end - time.monotonic()))
        ended = not (self._thread.is_alive() or self._sender.is_alive())
        if ended and self.lost is None and self.group is not None:
            destroy_group(self.group)
            # Drop the last reference so the C++ group and its gloo worker threads go now, not at
            # interpreter shutdown (where a worker thread freeing a finished work aborts the process).
            self.group = None
        return ended

    # ------------------------------------------------------------------ the threads
    #
    # Two threads on the one group, p2p only (tagged sends and receives, no collective, so no
    # sequence numbers to keep in step across ranks). Why two: gloo's receive work has no usable
    # ``is_completed`` (False until ``wait``) and a ``wait(timeout)`` that runs out leaves it broken,
    # so the receiver blocks in ``wait`` with each peer's own deadline; the beats must go on meanwhile.

    def _watched(self) -> list[int]:
        with self._mu:
            return sorted(self._peers)

    def _drop(self, peer: int, *, answer: bool = False) -> None:
        with self._mu:
            self._peers.discard(peer)
            if answer:  # it said bye: answer with ours, so its receive posted for us completes at once
                self._farewell.add(peer)

    def all_ended(self, timeout: float) -> bool:
        """Whether every peer ended its watch with a bye (``destroy_process_group()`` or ``hook.close()``
        after its last step), waiting up to ``timeout`` for it: a peer's bye and the closed connection that
        made this rank ask race each other. A peer that crashed, was killed or went silent never counts."""
        end = time.monotonic() + timeout
        with self._bye_cv:
            while len(self._said_bye) < self.world - 1 and self.lost is None:
                left = end - time.monotonic()
                if left <= 0:
                    return False
                self._bye_cv.wait(left)
            return len(self._said_bye) == self.world - 1

    def _farewells(self) -> list[int]:
        with self._mu:
            out, self._farewell = sorted(self._farewell), set()
            return out

    def _send_loop(self) -> None:
        g, seq = self.group, 0
        inflight: list[tuple[Any, torch.Tensor]] = []
        try:
            while not self._stop.is_set() and self.lost is None:
                for w, _ in inflight:  # bytes handed to the kernel long ago: returns at once
                    _settle(w)
                seq += 1
                inflight = []
                bye = torch.tensor([_BYE], dtype=torch.int64)
                for p in self._farewells():
                    try:
                        inflight.append((dist.isend(bye, dst=p, group=g, tag=_TAG), bye))
                    except Exception:  # noqa: BLE001
                        pass
                for p in self._watched():
                    t = torch.tensor([seq], dtype=torch.int64)
                    try:
                        inflight.append((dist.isend(t, dst=p, group=g, tag=_TAG), t))
                    except Exception:  # noqa: BLE001 - its process ended: the receiver drops it
                        pass
                self.beats = seq
                self._stop.wait(self.interval)
            for w, _ in inflight:
                _settle(w)
            if self.lost is None:  # a bye to every peer still watched: they stop expecting our beats
                bye = torch.tensor([_BYE], dtype=torch.int64)
                for w in [dist.isend(bye, dst=p, group=g, tag=_TAG) for p in self._watched()]:
                    _settle(w)
        except Exception as exc:  # noqa: BLE001 - the watch must never take a healthy rank down
            self._log.warning("peer watch (send) stopped", error=repr(exc))

    def _run(self) -> None:
        try:
            self._recv_loop()
        except Exception as exc:  # noqa: BLE001 - the watch must never take a healthy rank down
            self._log.warning("peer watch stopped", error=repr(exc))

    def _recv_loop(self) -> None:
        g = self.group
        bufs = {p: torch.zeros(1, dtype=torch.int64) for p in self._watched()}
        recvs: dict[int, Any] = {p: dist.irecv(bufs[p], src=p, group=g, tag=_TAG) for p in bufs}
        last = {p: time.monotonic() for p in bufs}
        left: list[int] = []

        def take(p: int, wait_s: float) -> str:
            """Wait for peer ``p``'s next message: "beat" | "bye" | "left" (its process ended) | "silent"."""
            t_end = time.monotonic() + wait_s
            try:
                recvs[p].wait(timedelta(seconds=max(0.001, wait_s)))
            except Exception:  # noqa: BLE001 - timed out (silent) or the connection closed (left)
                del recvs[p]
                return "silent" if time.monotonic() >= t_end - 0.01 else "left"
            last[p] = time.monotonic()
            if int(bufs[p][0]) == _BYE:
                del recvs[p]
                with self._bye_cv:
                    self._said_bye.add(p)
                    self._bye_cv.notify_all()
                return "bye"
            try:
                recvs[p] = dist.irecv(bufs[p], src=p, group=g, tag=_TAG)
            except Exception:  # noqa: BLE001 - its connection is closed: no more beats from it
                del recvs[p]
                return "left"
            return "beat"

        while recvs and not self._stop.is_set():
            for p in sorted(recvs):
                if p not in recvs:
                    continue
                what = take(p, last[p] + self.timeout - time.monotonic())
                if what in ("bye", "left"):
                    self._drop(p, answer=what == "bye" and not self._stop.is_set())
                    if what == "left":
                        left.append(p)
                    continue
                if what == "silent" and self._stop.is_set():
                    break  # we said bye ourselves: the peer may have stopped beating to us on purpose
                if what == "silent":
                    # Name every silent peer, not only the first: the others' beats may be queued already.
                    silent = [p]
                    for q in sorted(recvs):
                        try:
                            got = take(q, min(0.2, max(0.001, last[q] + self.timeout - time.monotonic())))
                        except Exception:  # noqa: BLE001 - naming is best effort; the reaction is not
                            got = "?"
                        if got == "silent":
                            silent.append(q)
                    now = time.monotonic()
                    self.lost = Lost(sorted(silent), {r: self.hosts.get(r, "?") for r in silent},
                                     {r: round(now - last[r], 3) for r in silent}, left)
                    if self._on_lost is not None:
                        self._on_lost(self, self.lost)
                    return
                if self._stop.is_set():
                    break
        # Stopping: the pending receives complete with the peers' next beat or bye (bounded by stop()).
        for p in list(recvs):
            try:
                recvs[p].wait(timedelta(seconds=min(self.interval + 0.5, 2.0)))
            except Exception:  # noqa: BLE001
                pass


def _settle(work: Any) -> None:
    try:
        work.wait()
    except Exception:  # noqa: BLE001 - the peer left
        pass


# ----------------------------------------------------------------- wiring into the hook


def exit_on_lost(hook: Any) -> Callable[[PeerWatch, Lost], None]:
    """The hook's reaction to lost peers: one log line, report, abort the groups, ``os._exit`` (never returns).

    Reads the hook defensively (``getattr``): it only needs the exit code, the
    notices it holds, the ids it committed, and its report/flush methods.
    """

    def react(watch: PeerWatch, lost: Lost) -> None:
        t0 = time.monotonic()
        pending = dict(getattr(hook, "_pending", {}) or {})
        # This run's state at the current step is in a committed checkpoint (B froze right after the
        # commit, whichever node had the notice): nothing is lost, the hook's own code.
        done = watch.committed_step is not None and watch.committed_step == step_of(hook)
        code = exit_code_of(hook) if done else EXIT_PEERS_LOST
        watch._log.error(
            ev.PEERS_LOST, lost_ranks=lost.ranks, hosts=[lost.hosts[r] for r in lost.ranks],
            silent_seconds=[lost.silent[r] for r in lost.ranks], left_ranks=lost.left, timeout=watch.timeout,
            step=step_of(hook), notice_ids=sorted(pending), committed=done, code=code,
            action="abort process groups, exit",
            detail=f"no heartbeat from {lost.describe()}: the node is gone or frozen; nothing is committed "
                   f"by this rank now, the job resumes from the newest committed checkpoint")
        report = getattr(hook, "_report", None)
        if callable(report) and not done:
            from ..protocol import CheckpointFailed  # noqa: PLC0415

            for nid in pending:
                try:
                    report(CheckpointFailed(id=nid, error=f"peers lost: {lost.describe()}"))
                except Exception:  # noqa: BLE001 - best effort
                    pass
        ok, err = run_bounded(abort_user_groups, ABORT_BUDGET, "spotguard-abort-groups")
        flush = getattr(hook, "_flush_intake", None)
        if callable(flush):
            run_bounded(lambda: flush(FLUSH_BUDGET), FLUSH_BUDGET + 0.1, "spotguard-flush")
        watch._log.info(ev.EXIT, code=code, step=step_of(hook), committed=done,
                        reason="peers_lost", aborted=ok, abort_error=None if ok or err is None else repr(err),
                        seconds=round(time.monotonic() - t0, 3))
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:  # noqa: BLE001
                pass
        os._exit(code)

    return react


def abort_user_groups() -> None:
    """Abort every process group of this process (what torch offers: ``_abort_process_group``).

    NCCL: ``ncclCommAbort`` on each communicator, so a rank blocked in an NCCL
    collective (or in ``work.wait()``) returns with an error. gloo (torch 2.13):
    ``ProcessGroupGloo.abort`` exists and returns at once, but a collective already
    blocked in another thread keeps waiting for its own timeout (measured: see
    docs/reliability.md); that is why the caller leaves with ``os._exit``.
    """
    c10d = dist.distributed_c10d
    abort = getattr(c10d, "_abort_process_group", None)
    if abort is not None:
        abort()
        return
    for pg in list(getattr(c10d._world, "pg_map", {}) or {}):  # older torch: per group
        fn = getattr(pg, "abort", None)
        if callable(fn):
            fn()


def watch_peers(hook: Any) -> Optional[PeerWatch]:
    """Start the watch for ``hook`` (collective: every rank, in the hook's constructor); None when not useful.

    Off with one rank, without torch.distributed, or with ``SPOTGUARD_PEER_TIMEOUT=off``.
    """
    if not is_dist() or dist.get_world_size() < 2:
        return None
    if os.environ.get("SPOTGUARD_PEER_TIMEOUT", "").strip().lower() in ("off", "0", "none", "false"):
        return None
    watch = PeerWatch(on_lost=exit_on_lost(hook))
    watch._log = history_tap(watch._log, getattr(hook, "_history", None))  # peers_lost/exit in the history
    after = getattr(hook, "_after_commit", None)
    if callable(after):  # learn each commit's step (every rank calls it right after the commit barrier)

        def after_commit(notice: Any, step: int, uri: str) -> None:
            watch.committed_step = step
            after(notice, step, uri)

        hook._after_commit = after_commit
    return watch.start()


def stop_watch(watch: Optional[PeerWatch]) -> None:
    """Stop ``watch`` if any (idempotent, bounded): before the hook's or the user's group teardown."""
    if watch is not None:
        watch.stop()
