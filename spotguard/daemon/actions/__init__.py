"""Cluster actions: what the daemon does beyond telling the trainers (all opt-in).

What node-termination-handler users expect: cordon and taint the node, an Event on
each trainer's pod, a webhook / Slack message, the Auto Scaling lifecycle hook held
until the checkpoint is safe. Each action sees a notice twice:

* ``on_notice`` — right after the notice was handed to the socket fan-out (cordon,
  first lifecycle heartbeat);
* ``on_outcome`` — once every local subscriber the notice went to reported
  ``checkpoint_done``/``checkpoint_failed`` or left, or at the deadline (Events,
  webhooks, ``CompleteLifecycleAction``).

They run as background tasks of ``ActionRunner``; nothing on the delivery path waits
for them, every network call is bounded by the notice's deadline, and a failure is
one log line (secrets redacted) plus ``spotguard_actions_total{result="failed"}``.
Only emergency kinds (``preemption``/``termination``) trigger actions.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Optional, Sequence

from ...logs import get_logger
from ...notice import Notice
from ...protocol import Subscribe
from ...timefmt import to_rfc3339
from ..book import FINAL_STATES, Entry

__all__ = ["Action", "ActionError", "ActionRunner", "Outcome", "SubscriberOutcome", "Deadline"]

log = get_logger("spotguard.actions")

#: The outcome is decided this long before the deadline when not every subscriber reported:
#: the VM may vanish at the deadline, and the Events/webhooks still have to go out.
OUTCOME_MARGIN = 1.0
#: At shutdown, actions still running get this long: a webhook sent on the last report before a
#: SIGTERM stop usually lands, and the daemon still stops within its 2 s (SPEC).
DRAIN_SECONDS = 1.5


class ActionError(ValueError):
    """An action's configuration is unusable; ``str()`` names the flag and the fix (exit 2)."""


class Deadline:
    """A budget on the event loop's clock: every retry loop and request timeout of an action uses one."""

    def __init__(self, seconds: float, *, minimum: float = 0.0) -> None:
        self.end = time.monotonic() + max(seconds, minimum)

    def left(self) -> float:
        return self.end - time.monotonic()

    def timeout(self, cap: float) -> float:
        """A per-request timeout: at most ``cap``, never past the end (0.1 s floor)."""
        return max(0.1, min(cap, self.left()))


@dataclass(frozen=True)
class SubscriberOutcome:
    """What one subscriber said about the notice, with who it is (from its ``subscribe``)."""

    client: int
    state: str
    rank: int = 0
    job: str = ""
    pid: int = 0
    pod: str = ""
    namespace: str = ""
    step: Optional[int] = None
    uri: Optional[str] = None
    error: Optional[str] = None


@dataclass(frozen=True)
class Outcome:
    """The checkpoint outcome of one notice on this node, as the actions see it."""

    notice: Notice
    node: str
    reason: str  # "reported" (every subscriber reported or left) | "deadline" | "no_subscribers"
    subscribers: tuple[SubscriberOutcome, ...] = ()
    watcher: Any = field(default=None, compare=False)

    @property
    def status(self) -> str:
        """``committed`` (every subscriber done), ``failed`` (one failed), ``incomplete``, ``no_subscribers``."""
        if not self.subscribers:
            return "no_subscribers"
        states = [s.state for s in self.subscribers]
        if all(s == "checkpoint_done" for s in states):
            return "committed"
        if "checkpoint_failed" in states:
            return "failed"
        return "incomplete"

    @property
    def step(self) -> Optional[int]:
        steps = [s.step for s in self.subscribers if s.state == "checkpoint_done" and s.step is not None]
        return max(steps) if steps else None

    @property
    def uri(self) -> Optional[str]:
        return next((s.uri for s in self.subscribers if s.state == "checkpoint_done" and s.uri), None)

    def summary(self) -> str:
        """One human sentence: the Event message and the Slack text."""
        n = self.notice
        head = f"spot notice ({n.kind}, {n.source}) on {self.node}"
        status = self.status
        if status == "committed":
            return f"{head}: checkpoint committed at step {self.step}, exiting"
        if status == "failed":
            err = next((s.error for s in self.subscribers if s.error), "") or "unknown error"
            return f"{head}: checkpoint FAILED ({err[:200]}), exiting"
        if status == "incomplete":
            missing = sum(1 for s in self.subscribers if s.state not in FINAL_STATES)
            return f"{head}: {missing} of {len(self.subscribers)} trainers reported no checkpoint by the deadline"
        return f"{head}: no trainer subscribed on this node"

    def fields(self) -> dict[str, Any]:
        """Flat fields for webhook templates (``$name``) and the default JSON payload."""
        n = self.notice
        return {
            "id": n.id, "source": n.source, "kind": n.kind, "deadline": to_rfc3339(n.deadline),
            "received_at": to_rfc3339(n.received_at), "detail": n.detail[:1000], "node": self.node,
            "status": self.status, "reason": self.reason, "step": self.step, "uri": self.uri,
            "subscribers": len(self.subscribers),
            "done": sum(1 for s in self.subscribers if s.state == "checkpoint_done"),
            "failed": sum(1 for s in self.subscribers if s.state == "checkpoint_failed"),
            "summary": self.summary(),
        }


class Action:
    """One cluster action. Subclasses override what they need; none may block the loop."""

    name: str = "action"

    def wants(self, notice: Notice) -> bool:
        return notice.emergency

    async def start(self) -> None:
        """At daemon start: load clients and credentials (slow imports happen here, never at notice time)."""

    async def on_notice(self, entry: Entry, node: str) -> Optional[bool]:
        """Right after the fan-out. ``None``: nothing done; True/False: succeeded/failed (metrics)."""
        return None

    async def on_outcome(self, outcome: Outcome) -> Optional[bool]:
        """Once the checkpoint outcome is known (or at the deadline)."""
        return None

    def cancelled(self, notice_id: str) -> None:
        """The source withdrew the notice (stop heartbeats and the like)."""

    async def close(self) -> None:
        """At daemon shutdown."""


@dataclass
class _Tracked:
    entry: Entry
    node: str
    done: bool = False
    timer: Optional[asyncio.TimerHandle] = None


class ActionRunner:
    """Drives the configured actions from the notice book's per-notice report state."""

    def __init__(self, actions: Sequence[Action], *, node: Callable[[], str],
                 counter: Optional[Any] = None) -> None:
        self.actions = list(actions)
        self._node = node
        self._counter = counter  # Counter with labels (action, phase, result)
        self._tracked: dict[str, _Tracked] = {}
        self._who: dict[int, Subscribe] = {}
        self._tasks: set[asyncio.Task[Any]] = set()

    def __bool__(self) -> bool:
        return bool(self.actions)

    async def start(self) -> None:
        for a in self.actions:
            await a.start()
            log.info("action.enabled", action=a.name)
            if self._counter is not None:  # exported at 0, so increase() sees the first failure
                for phase in ("notice", "outcome"):
                    for result in ("ok", "failed"):
                        self._counter.labels(a.name, phase, result)

    # --- hooks called by the daemon (synchronous, never wait) ------------------

    def remember(self, client: Any) -> None:
        """A subscriber's ``subscribe`` (rank, job, pod): kept after it disconnects, for the outcome."""
        if self.actions and getattr(client, "info", None) is not None:
            self._who[client.id] = client.info
            if len(self._who) > 8192:  # bounded: forget the oldest
                for cid in list(self._who)[:1024]:
                    del self._who[cid]

    def notice(self, entry: Entry) -> None:
        """A new notice was just handed to the fan-out."""
        wanted = [a for a in self.actions if a.wants(entry.notice)]
        if not wanted or entry.id in self._tracked:
            return
        for nid in [n for n, t in self._tracked.items() if t.done and t.entry.notice.seconds_left() < -3600]:
            del self._tracked[nid]  # a long-lived daemon keeps only recent notices
        tracked = _Tracked(entry, self._node())
        self._tracked[entry.id] = tracked
        for a in wanted:
            self._spawn(a, "notice", a.on_notice(entry, tracked.node))
        loop = asyncio.get_running_loop()
        tracked.timer = loop.call_later(max(0.0, entry.notice.seconds_left() - OUTCOME_MARGIN),
                                        self._decide, entry.id, "deadline")
        if not entry.reports:  # nobody subscribed: nothing to wait for
            self._decide(entry.id, "no_subscribers")

    def progress(self, entries: Iterable[Entry]) -> None:
        """A subscriber reported or left: decide the outcome of every notice now fully reported."""
        for entry in entries:
            tracked = self._tracked.get(entry.id)
            if tracked is None or tracked.done or not entry.reports:
                continue
            if all(r.state in FINAL_STATES or cid in entry.gone for cid, r in entry.reports.items()):
                self._decide(entry.id, "reported")

    def cancelled(self, notice_id: str) -> None:
        tracked = self._tracked.pop(notice_id, None)
        if tracked is None:
            return
        if tracked.timer is not None:
            tracked.timer.cancel()
        for a in self.actions:
            a.cancelled(notice_id)

    # --- internals ---------------------------------------------------------------

    def _decide(self, notice_id: str, reason: str) -> None:
        tracked = self._tracked.get(notice_id)
        if tracked is None or tracked.done:
            return
        tracked.done = True
        if tracked.timer is not None:
            tracked.timer.cancel()
        entry = tracked.entry
        subs = []
        for cid, rep in entry.reports.items():
            info = self._who.get(cid)
            subs.append(SubscriberOutcome(
                client=cid, state=rep.state, step=rep.step, uri=rep.uri, error=rep.error,
                rank=info.rank if info else 0, job=info.job if info else "", pid=info.pid if info else 0,
                pod=getattr(info, "pod", "") if info else "", namespace=getattr(info, "namespace", "") if info else ""))
        if reason == "no_subscribers" and subs:
            reason = "reported"
        outcome = Outcome(notice=entry.notice, node=tracked.node, reason=reason, subscribers=tuple(subs),
                          watcher=entry.watcher)
        log.info("action.outcome", notice_id=notice_id, status=outcome.status, reason=reason, step=outcome.step,
                 subscribers=len(subs))
        for a in self.actions:
            if a.wants(entry.notice):
                self._spawn(a, "outcome", a.on_outcome(outcome))

    def _spawn(self, action: Action, phase: str, coro: Any) -> None:
        task = asyncio.create_task(self._guard(action, phase, coro), name=f"action-{action.name}-{phase}")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _guard(self, action: Action, phase: str, coro: Any) -> None:
        try:
            ok = await coro
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # an action's bug must never reach the daemon
            log.error("action.crashed", action=action.name, phase=phase, error=type(exc).__name__, exc_info=True)
            ok = False
        if ok is not None and self._counter is not None:
            self._counter.labels(action.name, phase, "ok" if ok else "failed").inc()

    async def close(self, drain: float = DRAIN_SECONDS) -> None:
        """Give running actions up to ``drain`` seconds (a webhook at SIGTERM), then cancel them."""
        for tracked in self._tracked.values():
            if tracked.timer is not None:
                tracked.timer.cancel()
        if self._tasks and drain > 0:
            await asyncio.wait(list(self._tasks), timeout=drain)
        for t in list(self._tasks):
            t.cancel()
        if self._tasks:
            await asyncio.wait(list(self._tasks), timeout=1.0)
        for a in self.actions:
            try:
                await a.close()
            except Exception as exc:
                log.warning("action.close_failed", action=a.name, error=type(exc).__name__)
