"""Who is doomed, when each rank's own bytes were durable, and who wrote what (issue 26).

Why: a notice usually reaches one node of a job. The agreement learns which
ranks hold one (each rank says so in the round's gather), and the save plan
then gives every replicated item to the ranks without one
(``storage/survivors.py``): the doomed ranks write only their per-rank state.
A doomed rank is *safe* the moment its own bytes are durable (its DCP
``write_data`` returned, or a survivor holds them: ``evacuate.py``); it then
leaves the save's collectives and waits idle for the survivors' word that
the commit landed, or for its own deadline (``handoff.py``; a DDP doomed rank
takes no part in ``dcp.save`` at all) — exiting earlier would make the launcher
restart the survivors while they still write. Where no hand-off is planned
(every rank doomed, ``SPOTGUARD_SURVIVORS_PLAN=0``) it stays in the save's
collectives until the commit. That moment, and the bytes every rank wrote,
go into the ``checkpoint_safe``/``checkpoint_committed`` lines and the commit
record (``extra["writers"]``), which ``spotguard checkpoints`` shows.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any, Iterable, Optional, Sequence

from ..timefmt import to_rfc3339, utcnow
from . import events as ev

__all__ = ["doomed_ranks", "with_late_notices", "plan_around_doomed", "SafeMark", "writers_record"]


def plan_around_doomed() -> bool:
    """``$SPOTGUARD_SURVIVORS_PLAN`` (default on): ``0`` keeps DCP's stock plan (every rank writes a share of the
    replicated state) while still logging when the doomed ranks were safe — today's path, for comparison."""
    return os.environ.get("SPOTGUARD_SURVIVORS_PLAN", "1").strip() != "0"


def doomed_ranks(flags: Iterable[Any]) -> Optional[frozenset[int]]:
    """The ranks (positions in the round's gather = ranks in the save's group) whose flag is true; None when
    none or all are: then the save is planned exactly as without notice-aware planning."""
    flags = [bool(f) for f in flags]
    doomed = frozenset(r for r, f in enumerate(flags) if f)
    return doomed if doomed and len(doomed) < len(flags) else None


def with_late_notices(agreed: Optional[frozenset[int]], flags: Sequence[Any]) -> Optional[frozenset[int]]:
    """The round's doomed ranks plus those whose emergency notice came after its gather (``flags``: asked again
    right before the save plans). Why: VMs of one job are often reclaimed a moment apart; giving every
    replicated byte to a rank whose own notice came during the staging copy would load the bytes onto a VM that
    is going too. Every rank doomed now: None, DCP's stock plan."""
    late = agreed or frozenset()
    return doomed_ranks(bool(f) or r in late for r, f in enumerate(flags))


class SafeMark:
    """Marks the moment this rank's own checkpoint bytes are durable: wraps the DCP storage writer so that its
    ``write_data`` completing records the time and the bytes this rank wrote (``Storage.write_log``), and logs
    ``checkpoint_safe`` on a doomed rank right then (not after the commit: the line must exist even when the
    survivors never commit)."""

    def __init__(self, storage: Any, key: str, t0: float, doomed: bool, log: Any, fields: dict[str, Any]) -> None:
        self.storage, self.key, self.t0, self.doomed, self.log, self.fields = storage, key, t0, doomed, log, fields
        self.seconds: Optional[float] = None  # since the save started, when this rank's bytes were durable
        self.at: Optional[str] = None
        self.bytes = 0
        self.planned = "all-ranks"  # "survivors" once this rank's DCP save got the notice-aware planner
        self.evac: Any = None  # this save's ``evacuate.Evacuation`` role, when it has one
        self._lock = threading.Lock()

    def wrap(self, writer: Any) -> Any:
        """``writer`` with its ``write_data`` marking this rank safe when the future it returns completes."""
        orig = writer.write_data

        def write_data(plan: Any, planner: Any) -> Any:
            fut = orig(plan, planner)
            fut.add_done_callback(self._done)
            return fut

        writer.write_data = write_data
        return writer

    def _done(self, fut: Any) -> None:
        try:
            fut.value()  # raises what the write raised: not safe
        except BaseException:  # noqa: BLE001 - the save reports it
            return
        self.mark()

    def mark(self) -> None:
        """This rank's bytes are durable now (first call wins; ``_save`` calls it again after a writer that
        was not wrapped — a framework adapter's own format — returned)."""
        with self._lock:
            if self.seconds is not None:
                return
            self.seconds = round(time.monotonic() - self.t0, 4)
            self.at = to_rfc3339(utcnow())
            self.bytes = sum(d.size for d in self.storage.write_log.peek(self.key).values())
        if self.doomed:  # evacuated: ``bytes`` is ~0 and the survivor holds ``evacuated_bytes``
            self.log.info(ev.CHECKPOINT_SAFE, bytes=self.bytes, seconds=self.seconds, at=self.at,
                          waits_for="the commit (the survivors' word after a hand-off) or its deadline: exiting "
                                    "earlier would restart the survivors",
                          **self._evac_info(), **self.fields)

    def _evac_info(self) -> dict[str, Any]:
        return self.evac.info() if self.evac is not None else {}

    def info(self) -> dict[str, Any]:
        """What this rank reports to the commit (gathered with the write log)."""
        return {"bytes": self.bytes, "seconds": self.seconds, "at": self.at, "doomed": self.doomed,
                "planned": self.planned, **self._evac_info()}


def writers_record(infos: list[Any], doomed: Optional[frozenset[int]]) -> dict[str, Any]:
    """The commit record's ``extra["writers"]``: bytes per rank (by rank), the doomed ranks and when each became
    safe (seconds since its save started, and the wall-clock time). ``plan`` is what the coordinator's (rank
    0's) planner did: a framework adapter's own format never goes through it, whoever holds a notice."""
    infos = [i or {} for i in infos]
    planned = infos[0].get("planned") if infos else None
    out: dict[str, Any] = {"bytes_per_rank": [int(i.get("bytes") or 0) for i in infos],
                           "plan": "survivors" if doomed and planned == "survivors" else "all-ranks"}
    if doomed:
        out["doomed"] = sorted(doomed)
        out["safe_seconds"] = {str(r): infos[r].get("seconds") for r in sorted(doomed) if r < len(infos)}
        out["safe_at"] = {str(r): infos[r].get("at") for r in sorted(doomed) if r < len(infos)}
        evacuated = {str(r): {"to": infos[r]["evacuated_to"], "bytes": int(infos[r].get("evacuated_bytes") or 0)}
                     for r in sorted(doomed) if r < len(infos) and infos[r].get("evacuated_to") is not None}
        if evacuated:  # a doomed rank's unique shards, written by the survivor ``to`` (included in its bytes)
            out["evacuated"] = evacuated
    return out
