"""The arithmetic of ``spotguard report``: a job's history (and commit records) -> figures.

Every figure is defined in docs/report.md; the names here are the names there. Kept free of
I/O so that the unit tests feed it synthetic histories.

An *attempt* is one start of the job: one rank-0 process (its ``run`` id), from its process
start to its ``exit`` (or its last event when it vanished). Other nodes' events belong to
the attempt whose time span holds them.
"""

from __future__ import annotations

import bisect
import math
import statistics
from dataclasses import asdict, dataclass, field
from typing import Any, Iterable, Optional

from ..history.record import Event
from ..storage.listing import writers_phrase
from ..timefmt import parse_rfc3339

__all__ = ["Attempt", "Preemption", "Checkpoint", "Figures", "compute", "counterfactual", "money"]

#: agreed actions that end the attempt (an emergency checkpoint, or an exit on a replayed notice)
LEAVING = ("emergency", "exit")
COUNTERFACTUAL_MINUTES = (15, 30, 60)
#: a ``process_started`` further back than this before its ``hook_installed`` is not believed (a damaged entry)
MAX_STARTUP = 86400.0


@dataclass
class Preemption:
    """One notice that ended an attempt: when it came, where from, how long until the job was safe."""

    notice_id: str
    attempt: int
    source: str = "?"
    kind: str = "?"
    nodes: list[str] = field(default_factory=list)
    seen: Optional[float] = None
    deadline: Optional[float] = None
    agreed: Optional[float] = None
    step: Optional[int] = None
    committed: Optional[float] = None
    time_to_safe: Optional[float] = None
    bytes: int = 0
    writers: Optional[str] = None  # who wrote what, when the save was planned around the doomed ranks


@dataclass
class Checkpoint:
    """One committed checkpoint (a notice's or a periodic one)."""

    step: int
    time: float
    reason: str
    bytes: int
    seconds: float
    notice_id: Optional[str] = None


@dataclass
class Attempt:
    """One start of the job (rank 0's process) and how it ended."""

    run: str
    start: float
    installed: float
    resumed: float
    end: float
    resume_step: int = 0
    resumed_from: Optional[str] = None
    load_seconds: float = 0.0
    last_step: int = 0
    end_kind: str = "vanished"  # "preempted" | "peers_lost" | "process_end" | "exit" | "vanished"
    code: Optional[int] = None
    train_end: float = 0.0
    world_size: Optional[int] = None
    nodes: list[str] = field(default_factory=list)

    @property
    def training_seconds(self) -> float:
        return max(0.0, self.train_end - self.resumed)


@dataclass
class Figures:
    """Everything the report prints (``--json`` is ``asdict`` of this)."""

    attempts: list[Attempt]
    preemptions: list[Preemption]
    checkpoints: list[Checkpoint]
    wall_seconds: float = 0.0
    training_seconds: float = 0.0
    step_seconds: Optional[float] = None
    steps_recomputed: int = 0
    recomputed_seconds: float = 0.0
    goodput_seconds: float = 0.0
    goodput_percent: float = 0.0
    preemptions_by: dict[str, int] = field(default_factory=dict)
    interruptions_without_notice: int = 0
    time_to_safe_p50: Optional[float] = None
    time_to_safe_max: Optional[float] = None
    downtime: list[dict[str, float]] = field(default_factory=list)
    downtime_seconds: float = 0.0
    waiting_seconds: float = 0.0
    restart_load_seconds: float = 0.0
    checkpoint_bytes: int = 0
    checkpoint_seconds: float = 0.0
    throughput_mb_s: Optional[float] = None
    nodes: int = 1
    counterfactual: list[dict[str, Any]] = field(default_factory=list)
    money: Optional[dict[str, float]] = None
    stored_checkpoints: list[int] = field(default_factory=list)
    lanes: list[dict[str, Any]] = field(default_factory=list)
    skipped: list[tuple[str, str]] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _num(v: Any) -> Optional[float]:
    """A count, size, duration or time from the history: a finite number >= 0, else None (not known).

    Why so strict: anyone who can write the store can write history entries; a negative step or
    size would make every figure derived from it absurd rather than merely unknown.
    """
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return None
    return float(v) if math.isfinite(v) and v >= 0 else None


def _started(inst: Event) -> float:
    """A ``hook_installed`` process's start: its ``process_started`` when plausible, else the event's time."""
    ps = _num(inst.fields.get("process_started"))
    return ps if ps is not None and inst.time - MAX_STARTUP <= ps <= inst.time else inst.time


def _time(text: Any) -> Optional[float]:
    try:
        return parse_rfc3339(text).timestamp()
    except (ValueError, TypeError):
        return None


def _attempts(events: list[Event]) -> list[Attempt]:
    """Rank 0's processes in start order; each attempt's span ends where the next one starts."""
    runs: dict[str, list[Event]] = {}
    for e in events:
        if e.rank == 0:
            runs.setdefault(e.run, []).append(e)
    out: list[Attempt] = []
    for run, evs in sorted(runs.items(), key=lambda kv: kv[1][0].time):
        first = evs[0]
        inst = next((e for e in evs if e.kind == "hook_installed"), None)
        res = next((e for e in evs if e.kind == "resumed"), None)
        ex = next((e for e in evs if e.kind == "exit"), None)
        installed = inst.time if inst else first.time
        start = _started(inst) if inst else installed
        resumed = res.time if res else installed
        end = ex.time if ex else evs[-1].time
        steps = [int(s) for e in evs if (s := _num(e.fields.get("step"))) is not None]
        a = Attempt(run=run, start=start, installed=installed, resumed=resumed, end=end,
                    resume_step=int(_num(res.fields.get("step")) or 0) if res else 0,
                    resumed_from=res.fields.get("uri") if res else None,
                    load_seconds=float(_num(res.fields.get("seconds")) or 0.0) if res else 0.0,
                    world_size=int(w) if inst and (w := _num(inst.fields.get("world_size"))) else None)
        a.last_step = max([a.resume_step, *steps])
        leave = next((e.time for e in evs if e.kind == "agreed" and e.fields.get("action") in LEAVING), None)
        a.train_end = min(leave, end) if leave is not None else end
        if ex is not None:
            a.code = int(c) if (c := _num(ex.fields.get("code"))) is not None else None
            reason = ex.fields.get("reason")
            a.end_kind = ("peers_lost" if reason == "peers_lost" else "process_end" if reason == "process_end"
                          else "preempted" if ex.fields.get("notice_id") else "exit")
        out.append(a)
    return out


def _lanes(evs: list[Event], attempts: list[Attempt]) -> list[dict[str, Any]]:
    """One lane per (node, rank) that wrote a start: its processes (start..end) and what its node saw."""
    lanes: dict[tuple[str, int], dict[str, Any]] = {}
    for e in evs:
        if e.kind == "hook_installed":
            lane = lanes.setdefault((e.node, e.rank), {"node": e.node, "rank": e.rank, "runs": {}, "notices": [],
                                                       "lost": [], "seen": set()})
            lane["runs"][e.run] = {"run": e.run, "start": _started(e),
                                   "end": None, "end_kind": "vanished"}
    by_node = {}
    for (node, _), lane in sorted(lanes.items(), key=lambda kv: kv[0][1]):
        by_node.setdefault(node, lane)
    for e in evs:
        lane = lanes.get((e.node, e.rank)) or by_node.get(e.node)
        if lane is None:
            continue
        if e.kind == "exit" and e.run in lane["runs"]:
            run = lane["runs"][e.run]
            run["end"] = e.time
            run["end_kind"] = str(e.fields.get("reason") or ("preempted" if e.fields.get("notice_id") else "exit"))
        elif e.kind == "notice_seen" and e.fields.get("notice_id") not in lane["seen"]:
            lane["seen"].add(e.fields.get("notice_id"))
            lane["notices"].append({"time": e.time, "notice_id": e.fields.get("notice_id"),
                                    "source": e.fields.get("source"), "deadline": _time(e.fields.get("deadline"))})
        elif e.kind == "peers_lost":
            lane["lost"].append(e.time)
    out = []
    starts = [a.start for a in attempts]
    for (_, _), lane in sorted(lanes.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        runs = sorted(lane["runs"].values(), key=lambda r: r["start"])
        for r in runs:
            r["attempt"] = _owner(attempts, r["start"], starts)
            if r["end"] is None:  # vanished: its attempt's end is the best known
                r["end"] = attempts[r["attempt"]].end
        out.append({**{k: v for k, v in lane.items() if k != "seen"}, "runs": runs})
    return out


def _owner(attempts: list[Attempt], t: float, starts: Optional[list[float]] = None) -> int:
    """The attempt whose span holds time ``t`` (the last one started at or before it; 0 before all)."""
    starts = starts if starts is not None else [a.start for a in attempts]
    return max(0, bisect.bisect_right(starts, t + 1e-6) - 1)


def compute(events: Iterable[Event], *, stored: Optional[list[tuple[int, Any]]] = None,
            skipped: Optional[list[tuple[str, str]]] = None) -> Figures:
    """The figures of one job. ``stored``: (step, commit record) of the checkpoints in storage now."""
    evs = sorted(events, key=lambda e: (e.time, e.run, e.rank))
    attempts = _attempts(evs)
    fig = Figures(attempts=attempts, preemptions=[], checkpoints=[], skipped=list(skipped or []))
    fig.stored_checkpoints = sorted(s for s, _ in (stored or []))
    if not attempts:
        return fig
    nodes: dict[int, set[str]] = {}
    notices: dict[str, Preemption] = {}
    starts = [a.start for a in attempts]
    for e in evs:
        i = _owner(attempts, e.time, starts)
        if e.kind == "hook_installed":
            nodes.setdefault(i, set()).add(e.node)
        nid = e.fields.get("notice_id")
        if e.kind == "notice_seen" and isinstance(nid, str):
            p = notices.setdefault(nid, Preemption(notice_id=nid, attempt=i))
            p.source, p.kind = str(e.fields.get("source", p.source)), str(e.fields.get("kind", p.kind))
            p.seen = e.time if p.seen is None else min(p.seen, e.time)
            p.deadline = p.deadline or _time(e.fields.get("deadline"))
            if e.node not in p.nodes:
                p.nodes.append(e.node)
        elif e.kind == "agreed" and isinstance(nid, str) and e.fields.get("action") in LEAVING:
            p = notices.setdefault(nid, Preemption(notice_id=nid, attempt=i))
            if p.agreed is None:  # a restart on the doomed VM agrees again on a replayed notice: same preemption
                # rank 0's clock places it (a notice_seen came from any node's clock, maybe skewed)
                p.agreed, p.step, p.attempt = e.time, int(_num(e.fields.get("step")) or 0), i
                p.kind = str(e.fields.get("kind") or p.kind)
        elif e.kind in ("checkpoint_committed", "periodic_committed") and not e.fields.get("already_committed"):
            ck = Checkpoint(step=int(_num(e.fields.get("step")) or 0), time=e.time,
                            reason="periodic" if e.kind == "periodic_committed" else "notice",
                            bytes=int(_num(e.fields.get("bytes")) or 0),
                            seconds=float(_num(e.fields.get("seconds")) or 0.0),
                            notice_id=nid if isinstance(nid, str) else None)
            fig.checkpoints.append(ck)
            if isinstance(nid, str) and e.kind == "checkpoint_committed":
                p = notices.setdefault(nid, Preemption(notice_id=nid, attempt=i))
                p.committed, p.bytes = e.time, ck.bytes
                p.writers = writers_phrase(e.fields.get("writers"))
                since = _num(e.fields.get("seconds_since_notice"))
                p.time_to_safe = since
    for i, a in enumerate(attempts):
        a.nodes = sorted(nodes.get(i, set()))
    fig.preemptions = [p for p in notices.values() if p.agreed is not None]
    for p in fig.preemptions:
        if p.time_to_safe is None and p.committed is not None and p.seen is not None:
            p.time_to_safe = round(p.committed - p.seen, 3)
        key = f"{p.source}/{p.kind}"
        fig.preemptions_by[key] = fig.preemptions_by.get(key, 0) + 1
    safe = [p.time_to_safe for p in fig.preemptions if p.time_to_safe is not None]
    if safe:
        fig.time_to_safe_p50, fig.time_to_safe_max = statistics.median(safe), max(safe)
    fig.interruptions_without_notice = sum(a.end_kind in ("peers_lost", "vanished") for a in attempts[:-1])
    fig.wall_seconds = attempts[-1].end - attempts[0].start
    fig.training_seconds = sum(a.training_seconds for a in attempts)
    steps = sum(max(0, a.last_step - a.resume_step) for a in attempts)
    fig.step_seconds = fig.training_seconds / steps if steps > 0 else None
    for k, (prev, a) in enumerate(zip(attempts, attempts[1:])):
        fig.steps_recomputed += max(0, prev.last_step - a.resume_step)
        waiting = max(0.0, a.start - prev.end)
        fig.downtime.append({"after_attempt": k, "seconds": a.resumed - prev.end,
                             "waiting": waiting, "restart_load": a.resumed - max(a.start, prev.end),
                             "load": a.load_seconds})
    fig.downtime_seconds = sum(d["seconds"] for d in fig.downtime)
    fig.waiting_seconds = sum(d["waiting"] for d in fig.downtime)
    fig.restart_load_seconds = sum(d["restart_load"] for d in fig.downtime)
    fig.recomputed_seconds = fig.steps_recomputed * (fig.step_seconds or 0.0)
    fig.goodput_seconds = max(0.0, fig.training_seconds - fig.recomputed_seconds)
    fig.goodput_percent = 100.0 * fig.goodput_seconds / fig.wall_seconds if fig.wall_seconds > 0 else 0.0
    fig.checkpoint_bytes = sum(c.bytes for c in fig.checkpoints)
    fig.checkpoint_seconds = sum(c.seconds for c in fig.checkpoints)
    if fig.checkpoint_seconds > 0:
        fig.throughput_mb_s = fig.checkpoint_bytes / fig.checkpoint_seconds / 1e6
    fig.nodes = max([len(a.nodes) for a in attempts] + [1])
    fig.counterfactual = [counterfactual(fig, m) for m in COUNTERFACTUAL_MINUTES]
    fig.lanes = _lanes(evs, attempts)
    return fig


def counterfactual(fig: Figures, minutes: float) -> dict[str, Any]:
    """The same interruptions with only a periodic checkpoint every ``minutes`` of training and no notice handling.

    Each attempt that ended with a notice trains on until the VM is gone (the notice's deadline) and
    loses the work since its last periodic checkpoint (taken every ``minutes`` from its resume);
    one lost without a notice loses the same span up to its end. The saves themselves are free here.
    """
    period = minutes * 60.0
    by_attempt = {p.attempt: p for p in fig.preemptions}
    final_step = fig.attempts[-1].last_step if fig.attempts else 0
    lost = extra = 0.0
    for i, a in enumerate(fig.attempts[:-1]):
        p = by_attempt.get(i)
        gone = p.deadline if p is not None and p.deadline is not None and p.deadline > a.resumed else a.end
        if fig.step_seconds and final_step > a.resume_step:  # the job would have ended before the VM: no loss
            finish = a.resumed + (final_step - a.resume_step) * fig.step_seconds
            if finish <= gone:
                extra += max(0.0, finish - a.train_end)
                continue
        trained = max(0.0, gone - a.resumed)
        lost += trained % period
        extra += max(0.0, gone - a.train_end)  # training it would have done between the notice and the deadline
    useful = max(0.0, fig.training_seconds + extra - lost)
    wall = fig.wall_seconds + sum(max(0.0, (by_attempt[i].deadline or a.end) - a.end)
                                  for i, a in enumerate(fig.attempts[:-1]) if i in by_attempt)
    return {"every_minutes": minutes, "lost_seconds": round(lost, 3),
            "lost_steps": round(lost / fig.step_seconds, 1) if fig.step_seconds else None,
            "goodput_percent": round(100.0 * useful / wall, 2) if wall > 0 else 0.0}


def money(fig: Figures, price_spot: float, price_on_demand: float, nodes: Optional[int] = None) -> dict[str, float]:
    """Spot bill (node-hours the processes ran) vs on-demand for the same useful work (no interruptions).

    Without ``nodes`` each attempt counts its own nodes (host names it started on): after an elastic
    resize, a week on 4 nodes and an hour on 8 are not a week on 8.
    """
    def count(a: Attempt) -> int:
        return nodes or max(1, len(a.nodes))

    ran = sum((a.end - a.start) * count(a) for a in fig.attempts)
    share = fig.goodput_seconds / fig.training_seconds if fig.training_seconds > 0 else 0.0
    first = fig.attempts[0] if fig.attempts else None
    od_seconds = sum(a.training_seconds * share * count(a) for a in fig.attempts) \
        + ((first.resumed - first.start) * count(first) if first else 0.0)
    spot = ran / 3600.0 * price_spot
    od = od_seconds / 3600.0 * price_on_demand
    return {"nodes": nodes or fig.nodes, "nodes_per_attempt": not nodes, "spot_node_hours": round(ran / 3600.0, 4), "spot_cost": round(spot, 4),
            "on_demand_node_hours": round(od_seconds / 3600.0, 4), "on_demand_cost": round(od, 4),
            "saved": round(od - spot, 4), "saved_percent": round(100.0 * (od - spot) / od, 2) if od > 0 else 0.0}
