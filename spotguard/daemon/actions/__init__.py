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

Restart-safe (``ActionState``): what the actions did for a notice — which subscribers it
reached and what each reported, in every daemon life, the outcome once decided and which
actions sent it — is persisted with the notice in the state file (``persist.py``). A notice
restored after a restart that reached subscribers before decides nothing until they had
``reconnect_grace`` seconds to come back (one that never does is ``unreported``, never
``no_subscribers``); an outcome decided in an earlier life is the outcome, and an action
that already sent it is not asked again. While the daemon is stopping (``stopping``) no
outcome is decided at all: the disconnects of its own shutdown are not the trainers leaving.

A kill -9 between the fan-out and the state file's write (a few ms) leaves no trace of the notice: the
next life sees the same provider notice under a new id, while the trainers it reached checkpoint for the
old one. Hence, while running, the state file also lists who is subscribed (``registry``; a clean stop
leaves it out: it persists every notice). A later life counts those of them that do not come back as
``unreported`` in a notice it sees soon after its start (``EARLIER_WINDOW``), and a final report for a
notice id this life never saw (``earlier_report``: the id an earlier life delivered) stands for that
trainer in those notices — never ``incomplete`` or ``no_subscribers`` because of the daemon's restart.
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, Iterable, Optional, Sequence

from ...logs import get_logger
from ...notice import Notice
from ...protocol import Subscribe
from ...timefmt import to_rfc3339
from ..book import FINAL_STATES, Entry

__all__ = ["Action", "ActionError", "ActionRunner", "ActionState", "Outcome", "SubscriberOutcome", "Deadline",
           "RECONNECT_GRACE", "EARLIER_WINDOW"]

log = get_logger("spotguard.actions")

#: The outcome is decided this long before the deadline when not every subscriber reported:
#: the VM may vanish at the deadline, and the Events/webhooks still have to go out.
OUTCOME_MARGIN = 1.0
#: At shutdown, actions still running get this long: a webhook sent on the last report before a
#: SIGTERM stop usually lands, and the daemon still stops within its 2 s (SPEC).
DRAIN_SECONDS = 1.5
#: Default seconds a restored notice waits for the subscribers of an earlier daemon life to reconnect
#: (``--reconnect-grace``): the hook's intake retries with at most 2 s of jittered backoff.
RECONNECT_GRACE = 10.0
#: A subscriber that reached a notice in an earlier life and did not come back within the grace.
UNREPORTED = "unreported"
#: After a start that found another life's subscriber list (it was killed, not stopped), for this long a new
#: notice may be one that life delivered without writing it down: its subscribers that did not come back, and
#: the final reports made for ids this life never saw, count in it. About a spot notice's two minutes.
EARLIER_WINDOW = 120.0
_WHO_FIELDS = ("rank", "job", "pid", "pod", "namespace")
_STATE_RANK = {s: i for i, s in enumerate(("queued", "delivered", "acked", "checkpoint_started", UNREPORTED,
                                            "checkpoint_done", "checkpoint_failed"))}
_SUB_FIELDS = ("state", "step", "uri", "error", "rank", "job", "pid", "pod", "namespace", "seconds_past")
MAX_STATE_SUBSCRIBERS = 512


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
    seconds_past: Optional[float] = None  # checkpoint_done after the notice's deadline (late), by this much


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
        """``committed`` (every subscriber done), ``failed`` (one failed), ``incomplete``, ``unreported`` (the
        missing reports are from subscribers of an earlier daemon life that never came back: their checkpoint
        may well have committed while no daemon listened), ``no_subscribers``."""
        if not self.subscribers:
            return "no_subscribers"
        states = [s.state for s in self.subscribers]
        if all(s == "checkpoint_done" for s in states):
            return "committed"
        if "checkpoint_failed" in states:
            return "failed"
        if all(s in ("checkpoint_done", UNREPORTED) for s in states):
            return UNREPORTED
        return "incomplete"

    @property
    def key(self) -> str:
        """Names what this outcome says about its notice (id + status): an Event or webhook named from it
        can never be taken for another outcome of the same notice (``Idempotency-Key``)."""
        return hashlib.sha256(f"{self.notice.id}|{self.status}".encode()).hexdigest()[:16]

    @property
    def step(self) -> Optional[int]:
        steps = [s.step for s in self.subscribers if s.state == "checkpoint_done" and s.step is not None]
        return max(steps) if steps else None

    @property
    def uri(self) -> Optional[str]:
        return next((s.uri for s in self.subscribers if s.state == "checkpoint_done" and s.uri), None)

    @property
    def late_seconds(self) -> Optional[float]:
        """The furthest past the deadline a subscriber committed (None: every commit in time)."""
        past = [s.seconds_past for s in self.subscribers if s.state == "checkpoint_done" and s.seconds_past]
        return max(past) if past else None

    def summary(self) -> str:
        """One human sentence: the Event message and the Slack text."""
        n = self.notice
        head = f"spot notice ({n.kind}, {n.source}) on {self.node}"
        status = self.status
        if status == "committed":
            late = self.late_seconds
            if late is not None:
                return (f"{head}: checkpoint committed at step {self.step} but LATE, {late:.1f} s after the "
                        "deadline (a real VM would have been gone), exiting")
            return f"{head}: checkpoint committed at step {self.step}, exiting"
        if status == "failed":
            err = next((s.error for s in self.subscribers if s.error), "") or "unknown error"
            return f"{head}: checkpoint FAILED ({err[:200]}), exiting"
        if status == UNREPORTED:
            missing = sum(1 for s in self.subscribers if s.state == UNREPORTED)
            return (f"{head}: {missing} of {len(self.subscribers)} trainers did not report after a daemon restart "
                    "(their checkpoint may have committed while no daemon listened)")
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
            "summary": self.summary(), "outcome_key": self.key, "late_seconds": self.late_seconds,
        }


class Action:
    """One cluster action. Subclasses override what they need; none may block the loop."""

    name: str = "action"
    #: Holds something for the notice (a lifecycle hook) that its notice phase must find again before an
    #: outcome restored from an earlier daemon life can be sent.
    holds: bool = False

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

    def note(self, notice_id: str, **values: Any) -> None:
        """Record something worth keeping across a restart (heartbeats sent); the runner replaces this."""

    def extend(self, notice_id: str, seconds: float) -> None:
        """The notice's outcome may wait ``seconds`` from now (a held lifecycle hook); the runner replaces this."""

    async def close(self) -> None:
        """At daemon shutdown."""


def _rank(state: str) -> int:
    return _STATE_RANK.get(state, 0)


@dataclass
class ActionState:
    """What the actions did for one notice, in every daemon life; persisted with the notice.

    ``subscribers``: by subscriber key (pid:rank:job — the same process reconnecting keeps it),
    the furthest state it reported and who it is. ``outcome``: the decided outcome (status,
    reason, subscribers) once decided; ``sent``: the actions that finished sending it.
    ``lives``: daemon lives that have seen the notice; ``notes``: per action (heartbeats).
    """

    subscribers: dict[str, dict[str, Any]] = field(default_factory=dict)
    outcome: Optional[dict[str, Any]] = None
    sent: list[str] = field(default_factory=list)
    lives: int = 1
    notes: dict[str, dict[str, Any]] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {"subscribers": self.subscribers, "outcome": self.outcome, "sent": self.sent, "lives": self.lives,
                "notes": self.notes}

    @classmethod
    def from_dict(cls, doc: Any) -> "ActionState":
        """Validated: anything malformed is dropped field by field (a state file is untrusted input)."""
        st = cls()
        if not isinstance(doc, dict):
            return st
        subs = doc.get("subscribers")
        if isinstance(subs, dict):
            for k, v in list(subs.items())[:MAX_STATE_SUBSCRIBERS]:
                if isinstance(k, str) and isinstance(v, dict) and isinstance(v.get("state"), str):
                    st.subscribers[k[:256]] = {f: v.get(f) for f in _SUB_FIELDS if _plain(v.get(f))}
        out = doc.get("outcome")
        if isinstance(out, dict) and isinstance(out.get("status"), str) and isinstance(out.get("reason"), str):
            st.outcome = {"status": out["status"][:64], "reason": out["reason"][:64],
                          "subscribers": [{f: d.get(f) for f in _SUB_FIELDS if _plain(d.get(f))}
                                          for d in (out.get("subscribers") or [])[:MAX_STATE_SUBSCRIBERS]
                                          if isinstance(d, dict) and isinstance(d.get("state"), str)]}
        sent = doc.get("sent")
        if isinstance(sent, list):
            st.sent = [x[:64] for x in sent[:32] if isinstance(x, str)]
        lives = doc.get("lives")
        if isinstance(lives, int) and not isinstance(lives, bool) and 0 < lives < 1 << 30:
            st.lives = lives
        notes = doc.get("notes")
        if isinstance(notes, dict):
            st.notes = {k[:64]: {kk[:64]: vv for kk, vv in v.items() if isinstance(kk, str) and _plain(vv)}
                        for k, v in list(notes.items())[:32] if isinstance(k, str) and isinstance(v, dict)}
        return st


def _plain(v: Any) -> bool:
    return v is None or isinstance(v, (int, float, bool)) or (isinstance(v, str) and len(v) <= 4096)


def _sub_outcome(key: str, d: dict[str, Any]) -> SubscriberOutcome:
    def num(name: str) -> Optional[int]:
        v = d.get(name)
        return v if isinstance(v, int) and not isinstance(v, bool) else None

    def text(name: str) -> str:
        v = d.get(name)
        return v if isinstance(v, str) else ""

    return SubscriberOutcome(client=0, state=text("state") or "queued", rank=num("rank") or 0, job=text("job"),
                             pid=num("pid") or 0, pod=text("pod"), namespace=text("namespace"), step=num("step"),
                             uri=d.get("uri") if isinstance(d.get("uri"), str) else None,
                             error=d.get("error") if isinstance(d.get("error"), str) else None,
                             seconds_past=_past(d.get("seconds_past")))


def _past(v: Any) -> Optional[float]:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) and 0 < v < 1e9 else None


@dataclass
class _Tracked:
    entry: Entry
    node: str
    state: ActionState = field(default_factory=ActionState)
    done: bool = False
    timer: Optional[asyncio.TimerHandle] = None
    grace_timer: Optional[asyncio.TimerHandle] = None
    # Subscriber keys of earlier lives not seen again in this one (until the grace is over).
    awaiting: set[str] = field(default_factory=set)
    end_monotonic: float = 0.0
    keys: dict[int, str] = field(default_factory=dict)  # this life's client id -> subscriber key


class ActionRunner:
    """Drives the configured actions from the notice book's per-notice report state."""

    def __init__(self, actions: Sequence[Action], *, node: Callable[[], str],
                 counter: Optional[Any] = None, reconnect_grace: float = RECONNECT_GRACE,
                 on_change: Optional[Callable[[], None]] = None,
                 persist: Optional[Callable[[], Awaitable[None]]] = None) -> None:
        self.actions = list(actions)
        self._node = node
        self._counter = counter  # Counter with labels (action, phase, result)
        self._tracked: dict[str, _Tracked] = {}
        self._who: dict[int, Subscribe] = {}
        self._tasks: set[asyncio.Task[Any]] = set()
        self.reconnect_grace = reconnect_grace
        self.on_change = on_change  # the action state changed: persist it (off the delivery path)
        self.persist = persist  # awaited before an outcome is sent: the decision is on disk first
        self._restored: dict[str, ActionState] = {}
        self.stopping = False  # set before the daemon's own shutdown disconnects everyone
        self._started = time.monotonic()
        self._restart = False  # the state file held notices of an earlier life
        self._live: dict[int, str] = {}  # this life's subscribed clients -> subscriber key (the registry)
        # Subscribers of a killed earlier life not seen again in this one (key -> who), and final reports for
        # notice ids this life never saw (key -> (monotonic, state)): see EARLIER_WINDOW.
        self._earlier_subs: dict[str, dict[str, Any]] = {}
        self._earlier_reports: dict[str, tuple[float, dict[str, Any]]] = {}
        self._killed_keys: frozenset[str] = frozenset()

    def __bool__(self) -> bool:
        return bool(self.actions)

    async def start(self) -> None:
        self._started = time.monotonic()
        for a in self.actions:
            a.note = (lambda nid, _n=a.name, **kv: self._note(nid, _n, kv))  # type: ignore[method-assign]
            a.extend = self._extend  # type: ignore[method-assign]
            await a.start()
            log.info("action.enabled", action=a.name)
            if self._counter is not None:  # exported at 0, so increase() sees the first failure
                for phase in ("notice", "outcome"):
                    for result in ("ok", "failed"):
                        self._counter.labels(a.name, phase, result)

    # --- persistence ------------------------------------------------------------------

    def restore(self, states: dict[str, ActionState], *, restarted: bool = False,
                earlier_subscribers: Any = None) -> None:
        """The action states of an earlier daemon life, by notice id (used when the notice is seen again);
        ``restarted``: the state file held active notices, so subscribers may be reconnecting right now;
        ``earlier_subscribers``: the subscriber list a killed earlier life wrote (``registry``; untrusted)."""
        self._restored = dict(states)
        self._restart = restarted or bool(states)
        self._earlier_subs = {}
        if isinstance(earlier_subscribers, list):
            for d in earlier_subscribers[:MAX_STATE_SUBSCRIBERS]:
                if isinstance(d, dict) and isinstance(d.get("key"), str):
                    self._earlier_subs[d["key"][:256]] = {f: d.get(f) for f in _WHO_FIELDS if _plain(d.get(f))}
        self._killed_keys = frozenset(self._earlier_subs)  # who the killed life had (kept when they come back)
        for key in self._live.values():  # reconnected before the state file was read
            self._earlier_subs.pop(key, None)
        if self._earlier_subs:
            self._restart = True
            log.info("action.earlier_subscribers", subscribers=len(self._earlier_subs),
                     detail="the previous daemon was killed: a notice seen soon counts those that do not return")

    def registry(self) -> Optional[list[dict[str, Any]]]:
        """Who is subscribed now (and who of a killed earlier life may still come back), for the state file;
        ``None`` without actions or while stopping (a clean stop persists every notice: nothing to guess)."""
        if not self.actions or self.stopping:
            return None
        out: dict[str, dict[str, Any]] = {}
        if self._in_earlier_window():
            out.update(self._earlier_subs)
        for cid, key in self._live.items():
            info = self._who.get(cid)
            out[key] = {f: getattr(info, f, None) for f in _WHO_FIELDS}
        return [{"key": k, **{f: v for f, v in d.items() if _plain(v)}}
                for k, d in list(out.items())[:MAX_STATE_SUBSCRIBERS]]

    def from_killed_life(self, client: Any) -> bool:
        """May a final report of ``client`` for an id this life never saw be for a notice a killed earlier life
        delivered? Only after a start that found that life's subscriber list (it was killed, not stopped),
        within ``EARLIER_WINDOW`` of the start, and from a subscriber on that list. Anything else is the
        trainer's own notice (an API or signal notice it saved for) and must not stand for the daemon's notices:
        taken for one, it decided a spot notice 'committed' at an ordinary checkpoint's step while the trainer
        still wrote the emergency one (review 3)."""
        return (bool(self.actions) and self._in_earlier_window()
                and self._skey(getattr(client, "id", -1)) in self._killed_keys)

    def _in_earlier_window(self, at: Optional[float] = None) -> bool:
        return (at if at is not None else time.monotonic()) < self._started + EARLIER_WINDOW

    def states(self) -> dict[str, dict[str, Any]]:
        """Every tracked notice's action state (for the state file), plus restored ones not seen again yet."""
        out = {nid: st.to_dict() for nid, st in self._restored.items()}
        for nid, t in self._tracked.items():
            self._sync(t)
            out[nid] = t.state.to_dict()
        return out

    def _changed(self) -> None:
        if self.on_change is not None:
            self.on_change()

    def _skey(self, cid: int) -> str:
        info = self._who.get(cid)
        if info is None:
            return f"client-{cid}"
        return f"{info.pid}:{info.rank}:{info.job}"[:256]

    def _sync(self, tracked: _Tracked) -> bool:
        """Fold this life's reports into the persisted per-subscriber states; True if anything moved."""
        changed = False
        subs = tracked.state.subscribers
        entry = tracked.entry
        for cid, rep in entry.reports.items():
            key = tracked.keys.get(cid)
            if key is None:
                key = self._skey(cid)
                # Two live connections of one process and rank are two subscribers; a reconnect (the
                # earlier connection gone) is the same one.
                if any(k == key and c != cid and c not in entry.gone for c, k in tracked.keys.items()):
                    key = f"{key}#{cid}"
                tracked.keys[cid] = key
            tracked.awaiting.discard(key)
            old = subs.get(key)
            if old is not None and _rank(old.get("state", "")) >= _rank(rep.state):
                continue
            if old is None and len(subs) >= MAX_STATE_SUBSCRIBERS:
                continue
            info = self._who.get(cid)
            subs[key] = {"state": rep.state, "step": rep.step, "uri": rep.uri, "error": rep.error,
                         "rank": info.rank if info else 0, "job": info.job if info else "",
                         "pid": info.pid if info else 0, "pod": getattr(info, "pod", "") if info else "",
                         "namespace": getattr(info, "namespace", "") if info else "",
                         "seconds_past": rep.seconds_past if rep.late else None}
            changed = True
        return changed

    def _note(self, notice_id: str, action: str, values: dict[str, Any]) -> None:
        tracked = self._tracked.get(notice_id)
        if tracked is not None:
            tracked.state.notes.setdefault(action, {}).update({k: v for k, v in values.items() if _plain(v)})
            self._changed()

    def _extend(self, notice_id: str, seconds: float) -> None:
        """An action holds the VM longer than the notice's deadline (ASG heartbeats): move the outcome
        timer, and keep the notice in the book (replayed, reports recorded) until then."""
        tracked = self._tracked.get(notice_id)
        if tracked is None or tracked.done:
            return
        end = time.monotonic() + max(0.0, seconds)
        if end <= tracked.end_monotonic:
            return
        tracked.end_monotonic = end
        tracked.entry.expires_monotonic = max(tracked.entry.expires_monotonic, end + 60.0)
        if tracked.timer is not None:
            tracked.timer.cancel()
        tracked.timer = asyncio.get_running_loop().call_later(max(0.0, seconds - OUTCOME_MARGIN), self._decide,
                                                              notice_id, "deadline")

    # --- hooks called by the daemon (synchronous, never wait) ------------------

    def remember(self, client: Any) -> None:
        """A subscriber's ``subscribe`` (rank, job, pod): kept after it disconnects, for the outcome."""
        if self.actions and getattr(client, "info", None) is not None:
            self._who[client.id] = client.info
            if len(self._who) > 8192:  # bounded: forget the oldest
                for cid in list(self._who)[:1024]:
                    del self._who[cid]
            key = self._skey(client.id)
            self._live[client.id] = key
            self._earlier_subs.pop(key, None)  # back: followed by its own reports from now on
            self._changed()

    def forget(self, client: Any) -> None:
        """A subscriber disconnected (not during our own stop: those trainers are reconnecting)."""
        if self.stopping:
            return
        if self._live.pop(getattr(client, "id", None), None) is not None:  # type: ignore[arg-type]
            self._changed()

    def earlier_report(self, client: Any, state: str, *, step: Optional[int] = None, uri: Optional[str] = None,
                       error: Optional[str] = None, seconds_past: Optional[float] = None) -> None:
        """A final report for a notice id this life never saw: an earlier life delivered it and was killed before
        writing it down (the same provider notice has a new id here). It stands for this trainer in the
        emergency notices of the window (``EARLIER_WINDOW``): those tracked now and those seen soon."""
        if not self.actions or state not in FINAL_STATES:
            return
        info = self._who.get(client.id)
        key = self._live.get(client.id) or self._skey(client.id)
        d = {"state": state, "step": step, "uri": uri, "error": error, "seconds_past": seconds_past,
             **{f: getattr(info, f, None) for f in _WHO_FIELDS}}
        now = time.monotonic()
        self._earlier_reports[key] = (now, d)
        if len(self._earlier_reports) > MAX_STATE_SUBSCRIBERS:
            del self._earlier_reports[next(iter(self._earlier_reports))]
        touched = []
        for tracked in self._tracked.values():
            if not tracked.done and abs(tracked.entry.seen_monotonic - now) < EARLIER_WINDOW:
                if self._apply_earlier(tracked, key, d):
                    touched.append(tracked.entry)
        log.info("action.earlier_report", subscriber=key, state=state, step=step,
                 notices=[e.id for e in touched][:16])
        if touched:
            self._changed()
            self.progress(touched)

    @staticmethod
    def _apply_earlier(tracked: _Tracked, key: str, d: dict[str, Any]) -> bool:
        subs = tracked.state.subscribers
        old = subs.get(key)
        if old is not None and _rank(old.get("state", "")) >= _rank(d["state"]):
            return False
        if old is None and len(subs) >= MAX_STATE_SUBSCRIBERS:
            return False
        subs[key] = {f: d.get(f) for f in _SUB_FIELDS if _plain(d.get(f))}
        tracked.awaiting.discard(key)
        return True

    def _seed_earlier(self, tracked: _Tracked) -> int:
        """A notice seen in the window after a kill -9 may be one the killed life delivered: its trainers that
        did not come back are awaited (then ``unreported``), and their reports for the old id stand."""
        seen = tracked.entry.seen_monotonic
        n = 0
        for key, who in self._earlier_subs.items():
            if key not in tracked.state.subscribers and len(tracked.state.subscribers) < MAX_STATE_SUBSCRIBERS:
                tracked.state.subscribers[key] = {"state": "queued",
                                                  **{f: v for f, v in who.items() if _plain(v)}}
                tracked.awaiting.add(key)
                n += 1
        for key, (at, d) in self._earlier_reports.items():
            if abs(seen - at) < EARLIER_WINDOW and self._apply_earlier(tracked, key, d):
                n += 1
        return n

    def notice(self, entry: Entry) -> None:
        """A new notice was just handed to the fan-out (or a restored one, seen again after a restart)."""
        wanted = [a for a in self.actions if a.wants(entry.notice)]
        if not wanted or entry.id in self._tracked:
            return
        for nid in [n for n, t in self._tracked.items() if t.done and t.entry.notice.seconds_left() < -3600]:
            del self._tracked[nid]  # a long-lived daemon keeps only recent notices
        restored = self._restored.pop(entry.id, None)
        tracked = _Tracked(entry, self._node())
        self._tracked[entry.id] = tracked
        loop = asyncio.get_running_loop()
        if restored is not None:
            restored.lives += 1
            tracked.state = restored
            if restored.outcome is not None:
                self._resend(tracked, wanted)
                return
            tracked.awaiting = {k for k, v in restored.subscribers.items() if v.get("state") not in FINAL_STATES}
        seeded = 0
        if (restored is None or not restored.subscribers) and self._in_earlier_window(entry.seen_monotonic):
            seeded = self._seed_earlier(tracked)
        for a in wanted:
            self._spawn(a, "notice", a.on_notice(entry, tracked.node))
        left = entry.notice.seconds_left()
        tracked.end_monotonic = time.monotonic() + left
        tracked.timer = loop.call_later(max(0.0, left - OUTCOME_MARGIN), self._decide, entry.id, "deadline")
        # Subscribers may still be reconnecting: those this notice reached in an earlier life, or, in the
        # first moments of a restarted daemon's life, any at all. Decide nothing before that.
        # Any life's first reconnect_grace seconds count as "maybe restarted": an earlier daemon (another
        # version, an unreadable state file) may have left no trace, and deciding no_subscribers then would
        # complete an ASG hook (CONTINUE) under trainers that are still reconnecting. On a fresh node this
        # delays only a no_subscribers outcome, by at most the grace.
        if restored is not None and restored.subscribers:
            wait = self.reconnect_grace
        else:
            wait = self._started + self.reconnect_grace - time.monotonic()
        if wait > 0:
            tracked.grace_timer = loop.call_later(wait, self._grace_over, entry.id)
            log.info("action.awaiting_reconnect", notice_id=entry.id, seconds=round(wait, 3),
                     earlier_subscribers=len(restored.subscribers) if restored else 0,
                     lives=restored.lives if restored else 1, earlier_life_seeded=seeded)
        elif tracked.awaiting:  # the earlier life's trainers had this life's whole grace to come back
            self._changed()
            self._grace_over(entry.id)
            return
        elif not entry.reports and not tracked.state.subscribers:  # nobody subscribed: nothing to wait for
            self._decide(entry.id, "no_subscribers")
        elif seeded:
            self.progress([entry])
        self._changed()

    def _grace_over(self, notice_id: str) -> None:
        tracked = self._tracked.get(notice_id)
        if tracked is None or tracked.done:
            return
        tracked.grace_timer = None
        self._sync(tracked)
        for key in tracked.awaiting:
            sub = tracked.state.subscribers.get(key)
            if sub is not None and sub.get("state") not in FINAL_STATES:
                sub["state"] = UNREPORTED
        if tracked.awaiting:
            log.info("action.not_reconnected", notice_id=notice_id, subscribers=sorted(tracked.awaiting)[:16],
                     detail="reached before a daemon restart and not back within --reconnect-grace")
        tracked.awaiting = set()
        self._changed()
        self.progress([tracked.entry])
        if not tracked.done and not tracked.entry.reports and not tracked.state.subscribers:
            self._decide(notice_id, "no_subscribers")

    def progress(self, entries: Iterable[Entry]) -> None:
        """A subscriber reported or left: decide the outcome of every notice now fully reported."""
        for entry in entries:
            tracked = self._tracked.get(entry.id)
            if tracked is None or tracked.done:
                continue
            if self._sync(tracked):
                self._changed()
            if self.stopping or tracked.grace_timer is not None or tracked.awaiting:
                continue
            if not entry.reports and not tracked.state.subscribers:
                continue
            if all(r.state in FINAL_STATES or cid in entry.gone for cid, r in entry.reports.items()):
                self._decide(entry.id, "reported")

    def cancelled(self, notice_id: str) -> None:
        tracked = self._tracked.pop(notice_id, None)
        self._restored.pop(notice_id, None)
        if tracked is None:
            return
        for timer in (tracked.timer, tracked.grace_timer):
            if timer is not None:
                timer.cancel()
        for a in self.actions:
            a.cancelled(notice_id)
        self._changed()

    # --- internals ---------------------------------------------------------------

    def _outcome_subscribers(self, tracked: _Tracked) -> list[SubscriberOutcome]:
        """Every subscriber of every life, each once, at the furthest state it reported."""
        self._sync(tracked)
        subs = []
        for key, d in tracked.state.subscribers.items():
            so = _sub_outcome(key, d)
            subs.append(so)
        return subs

    def _decide(self, notice_id: str, reason: str) -> None:
        tracked = self._tracked.get(notice_id)
        if tracked is None or tracked.done:
            return
        if self.stopping:
            # The daemon's own stop disconnected the subscribers, or its deadline timer fired during the
            # stop: not the trainers' outcome. The next life decides it (the state file keeps the notice).
            log.info("action.outcome_deferred", notice_id=notice_id, reason=reason,
                     detail="the daemon is stopping; the next daemon decides the outcome")
            return
        tracked.done = True
        for timer in (tracked.timer, tracked.grace_timer):
            if timer is not None:
                timer.cancel()
        subs = self._outcome_subscribers(tracked)
        if reason == "no_subscribers" and subs:
            reason = "reported"
        tracked.state.outcome = {"status": "", "reason": reason,
                                 "subscribers": [{f: getattr(s, f) for f in _SUB_FIELDS} for s in subs]}
        outcome = self._rebuild(tracked)
        tracked.state.outcome["status"] = outcome.status
        log.info("action.outcome", notice_id=notice_id, status=outcome.status, reason=reason, step=outcome.step,
                 subscribers=len(subs), lives=tracked.state.lives)
        wanted = [a for a in self.actions if a.wants(tracked.entry.notice)]
        task = asyncio.get_running_loop().create_task(self._send_decided(tracked, outcome, wanted),
                                                      name="action-outcome-persist")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _send_decided(self, tracked: _Tracked, outcome: Outcome, wanted: list[Action]) -> None:
        """Write-ahead: the decided outcome reaches the state file before any action sends it, so a daemon
        killed in between re-sends this outcome and never decides another (its subscribers may be gone)."""
        if self.persist is not None:
            try:
                await self.persist()
            except Exception as exc:  # a full disk must not swallow the outcome
                log.warning("action.outcome_not_persisted", notice_id=tracked.entry.id, error=repr(exc)[:300])
        else:
            self._changed()
        for a in wanted:
            self._spawn(a, "outcome", a.on_outcome(outcome), tracked.entry.id)

    def _rebuild(self, tracked: _Tracked) -> Outcome:
        out = tracked.state.outcome or {}
        subs = tuple(_sub_outcome(str(i), d) for i, d in enumerate(out.get("subscribers") or []))
        return Outcome(notice=tracked.entry.notice, node=tracked.node, reason=str(out.get("reason", "reported")),
                       subscribers=subs, watcher=tracked.entry.watcher)

    def _resend(self, tracked: _Tracked, wanted: list[Action]) -> None:
        """The outcome was decided in an earlier life: send it to the actions that had not finished."""
        tracked.done = True
        outcome = self._rebuild(tracked)
        todo = [a for a in wanted if a.name not in tracked.state.sent]
        log.info("action.outcome_restored", notice_id=tracked.entry.id, status=outcome.status,
                 already_sent=tracked.state.sent, sending=[a.name for a in todo], lives=tracked.state.lives)
        for a in todo:
            # An action that holds something (the ASG hook) needs its notice phase to find it again.
            if a.holds:
                self._spawn(a, "notice", a.on_notice(tracked.entry, tracked.node))
            self._spawn(a, "outcome", a.on_outcome(outcome), tracked.entry.id)
        self._changed()

    def _spawn(self, action: Action, phase: str, coro: Any, notice_id: str = "") -> None:
        task = asyncio.create_task(self._guard(action, phase, coro, notice_id), name=f"action-{action.name}-{phase}")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _guard(self, action: Action, phase: str, coro: Any, notice_id: str = "") -> None:
        try:
            ok = await coro
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # an action's bug must never reach the daemon
            log.error("action.crashed", action=action.name, phase=phase, error=type(exc).__name__, exc_info=True)
            ok = False
        if phase == "outcome" and notice_id:
            tracked = self._tracked.get(notice_id)
            if tracked is not None and action.name not in tracked.state.sent:
                tracked.state.sent.append(action.name)  # finished (sent, or given up): never asked again
                self._changed()
        if ok is not None and self._counter is not None:
            self._counter.labels(action.name, phase, "ok" if ok else "failed").inc()

    async def close(self, drain: float = DRAIN_SECONDS) -> None:
        """Give running actions up to ``drain`` seconds (a webhook at SIGTERM), then cancel them."""
        self.stopping = True
        for tracked in self._tracked.values():
            for timer in (tracked.timer, tracked.grace_timer):
                if timer is not None:
                    timer.cancel()
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
