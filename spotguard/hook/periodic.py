"""Periodic safety-net checkpoints (``every=``): staged at a step boundary, uploaded in the background.

Why: an emergency checkpoint can fail (a notice that arrives too late, a store
that is down, a VM that vanishes without notice); a periodic checkpoint bounds
what is lost then. It must not stall training, so:

- **When**: every rank votes "due" (its own wall clock: ``every`` seconds since
  the last periodic or committed checkpoint started) and "busy" (its previous
  background save is still running) in the flag all-reduce the hook already
  launches at each iteration's end. A save starts at the next boundary iff
  some rank says due and no rank says busy: every rank sees the same MAX, so
  every rank starts the same save at the same step (no extra collective).
- **Staging** (training thread, at the boundary, the same point an emergency
  checkpoint is written): the state dict is copied to CPU (a clone for CPU
  tensors, a device-to-host copy otherwise) so training can go on mutating the
  live tensors. Cost: one copy of the state (time and memory) per periodic
  checkpoint, logged as ``staging_seconds`` / ``bytes``.
- **Upload** (a background thread per rank): ``torch.distributed.checkpoint.save``
  on a *dedicated* gloo group created at install (collective), so the
  background collectives never interleave with the training thread's (the
  hook's flag group, the user's NCCL/gloo group). Same commit protocol as the
  emergency path (prepare -> every rank writes -> all-ok -> rank 0 commits with
  reason ``periodic`` -> outcome broadcast).
- **A notice during an upload** (the rule, decided on rank 0 and broadcast so
  every rank follows it): with ``T`` the seconds left before the notice
  deadline (minus the teardown margin), estimate the upload's remaining time
  from its own throughput so far (bytes serialised / seconds). If it is
  expected to finish within ``T/2``, let it finish (it is cut off at ``T/2``
  whatever the estimate said), then write the emergency checkpoint for the
  agreed step (skipped as "already committed" if the periodic one stands for
  that same step). Otherwise abort it at once (its multipart uploads are
  aborted, nothing is committed) and write the emergency checkpoint with the
  whole window. The emergency checkpoint therefore always gets at least half
  of the window, and a nearly finished periodic one is not thrown away.
"""

from __future__ import annotations

import copy
import threading
import time
import warnings
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Optional

import torch
import torch.distributed as dist

from ..storage.commit import CommitRecord, commit_and_retain, step_dir
from ..storage.staging import copy_to_host, wants_staging
from ..version import __version__
from .dist import destroy_group, gather_writes, make_group, set_group_timeout

if TYPE_CHECKING:
    from .core import Hook

__all__ = [
    "PeriodicSaver",
    "stage_state_dict",
    "PERIODIC_STARTED",
    "PERIODIC_COMMITTED",
    "PERIODIC_FAILED",
    "PERIODIC_SETTLED",
]

PERIODIC_STARTED = "periodic_started"  # step, bytes, staging_seconds
PERIODIC_COMMITTED = "periodic_committed"  # step, uri, bytes, seconds, steps_during
PERIODIC_FAILED = "periodic_failed"  # step, error, seconds, aborted
PERIODIC_SETTLED = "periodic_settled"  # notice_id, step, decision, estimate, seconds_left, waited, committed

#: how long a background save may take before its group's collectives time out
GROUP_TIMEOUT = 1800.0


class Cancelled(Exception):
    """The periodic save was abandoned (a notice chose the emergency path, or its cut-off passed)."""


def stage_state_dict(obj: Any) -> tuple[Any, int]:
    """A CPU copy of a (nested) state dict that training can no longer touch; (copy, tensor bytes)."""
    total = 0

    def walk(o: Any) -> Any:
        nonlocal total
        if isinstance(o, torch.Tensor):
            t = o.detach()
            if t.device.type == "cpu":
                c = t.clone()
            elif wants_staging(t):  # device state: chunked pinned copies through the staging pool
                c = copy_to_host(t)
            else:
                c = t.to("cpu", copy=True)
            total += c.numel() * c.element_size()
            return c
        if isinstance(o, dict):
            return {k: walk(v) for k, v in o.items()}
        if isinstance(o, list):
            return [walk(v) for v in o]
        if isinstance(o, torch.Size):  # a shape stays one (DeepSpeed's param_shapes: zero_to_fp32 calls numel())
            return o
        if isinstance(o, tuple) and not hasattr(o, "_fields"):
            return tuple(walk(v) for v in o)
        if isinstance(o, (bytes, str, int, float, bool, type(None))):
            if isinstance(o, bytes):
                total += len(o)
            return o
        return copy.deepcopy(o)

    return walk(obj), total


@dataclass
class _Job:
    step: int
    state: dict[str, Any]
    nbytes: int
    staging_seconds: float
    started: float = field(default_factory=time.monotonic)
    write_started: Optional[float] = None
    done_bytes: int = 0  # bytes handed to the writer (serialised)
    storage: Any = None
    store_base: Optional[int] = None  # the object store's upload counter when the write started
    cutoff: Optional[float] = None  # monotonic instant after which the save gives up
    cancelled: threading.Event = field(default_factory=threading.Event)
    finished: threading.Event = field(default_factory=threading.Event)
    committed: bool = False
    error: str = ""
    seconds: float = 0.0

    def check(self) -> None:
        if self.cancelled.is_set():
            raise Cancelled("periodic checkpoint abandoned for the emergency checkpoint")
        if self.cutoff is not None and time.monotonic() > self.cutoff:
            self.cancelled.set()
            raise Cancelled("periodic checkpoint passed its cut-off (half the notice window)")

    def progress(self) -> int:
        """Bytes written so far: accepted by the object store (parts, PUTs), else handed to the writer."""
        up = getattr(self.storage, "bytes_uploaded", None)
        if isinstance(up, int) and self.store_base is not None:
            return up - self.store_base
        return self.done_bytes

    def estimate_remaining(self) -> Optional[float]:
        """Seconds until the upload is done, from its own throughput so far; None when unknown."""
        if self.finished.is_set():
            return 0.0
        done = self.progress()
        if self.write_started is None or done <= 0:
            return None
        rate = done / max(1e-3, time.monotonic() - self.write_started)
        return max(0, self.nbytes - done) / rate


def _planner(job: _Job) -> Any:
    from torch.distributed.checkpoint import DefaultSavePlanner  # noqa: PLC0415

    class ProgressPlanner(DefaultSavePlanner):
        """The stock planner, plus progress (bytes handed to the writer) and a cancellation point per item."""

        def resolve_data(self, write_item: Any) -> Any:
            job.check()
            data = super().resolve_data(write_item)
            if isinstance(data, torch.Tensor):
                job.done_bytes += data.numel() * data.element_size()
            else:
                try:
                    job.done_bytes += data.getbuffer().nbytes
                except Exception:  # noqa: BLE001 - progress is an estimate
                    pass
            return data

    return ProgressPlanner()


def _own_instance(storage: Any) -> Any:
    """A second instance of an object store (own deadline, threads, part buffers), else ``storage`` itself.

    Why: aborting a background upload means failing its in-flight requests at
    once (its deadline set in the past) without touching the emergency save's
    store; local folders have no requests to fail and are shared.
    """
    from ..storage import open_storage  # noqa: PLC0415
    from ..storage.objstore import ObjectStorage  # noqa: PLC0415

    if isinstance(storage, ObjectStorage):
        try:
            clone = open_storage(storage.uri)
            if type(clone) is type(storage):
                return clone
        except Exception:  # noqa: BLE001 - fall back to sharing (cancellation then waits for parts in flight)
            pass
    return storage


class PeriodicSaver:
    """One hook's background checkpoints (see the module docstring). Create on every rank (collective)."""

    def __init__(self, hook: "Hook", every: float) -> None:
        self.hook = hook
        self.every = float(every)
        self.group = make_group() if hook._dist else None
        if self.group is None:  # single process: DCP warns on every save that it is not distributed
            warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
        set_group_timeout(self.group, GROUP_TIMEOUT)
        self.storage = _own_instance(hook._storage)
        self._own = self.storage is not hook._storage
        self.last_start = time.monotonic()
        self.job: Optional[_Job] = None
        self._thread: Optional[threading.Thread] = None
        self.history: list[_Job] = []  # finished jobs (tests, logs)

    # --------------------------------------------------------------- voting

    @property
    def busy(self) -> bool:
        th = self._thread
        return th is not None and th.is_alive()

    def flags(self) -> tuple[int, int]:
        """(due, busy) for this iteration's agreement."""
        busy = self.busy
        due = (not busy) and (time.monotonic() - self.last_start >= self.every)
        return int(due), int(busy)

    def restart_clock(self) -> None:
        """A checkpoint just committed (any reason): the next periodic one is ``every`` from now."""
        self.last_start = time.monotonic()

    # --------------------------------------------------------------- start

    def start(self, step: int, state: dict[str, Any], nbytes: int, staging_seconds: float) -> None:
        """Launch the background save of an already staged state (every rank, same step)."""
        job = _Job(step=step, state=state, nbytes=nbytes, staging_seconds=staging_seconds)
        self.job = job
        if self._own:
            self.storage.deadline = None  # a previous job's cut-off or abort
        self.last_start = job.started
        self.hook._log.info(PERIODIC_STARTED, step=step, bytes=nbytes, staging_seconds=round(staging_seconds, 4),
                            uri=f"{self.hook._storage.uri}/{step_dir(step)}")
        th = threading.Thread(target=self._run, args=(job,), name="spotguard-periodic", daemon=True)
        self._thread = th
        th.start()

    # --------------------------------------------------------------- background

    def _bcast0(self, obj: Any) -> Any:
        if self.group is None:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0, group=self.group)
        return box[0]

    def _all_ok(self, ok: bool) -> bool:
        if self.group is None:
            return ok
        t = torch.tensor([0 if ok else 1], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        return int(t[0]) == 0

    def _run(self, job: _Job) -> None:
        h = self.hook
        storage = self.storage
        key = step_dir(job.step)
        uri = f"{storage.uri}/{key}"
        stage = "prepare"
        try:
            status = self._bcast0(self._rank0_prepare(job) if h._rank == 0 else None)
            if status[0] == "already":
                job.committed = True
                return
            if status[0] == "error":
                job.error = f"prepare failed on rank 0: {status[1]}"
                return
            stage = "write"
            err = None
            job.storage = storage
            job.store_base = getattr(storage, "bytes_uploaded", None)
            job.write_started = time.monotonic()
            storage.write_log.take(key)  # what an earlier attempt at this step wrote does not count
            try:
                import torch.distributed.checkpoint as dcp  # noqa: PLC0415

                dcp.save(job.state, storage_writer=storage.dcp_writer(key), planner=_planner(job),
                         process_group=self.group, no_dist=self.group is None)
            except BaseException as exc:  # noqa: BLE001 - CheckpointException is a BaseException
                if isinstance(exc, (KeyboardInterrupt, SystemExit)):
                    raise
                err = f"{type(exc).__name__}: {exc}"
            stage = "durable-barrier"
            if not self._all_ok(err is None and not job.cancelled.is_set()):
                job.error = err or ("cancelled" if job.cancelled.is_set() else "another rank failed to write its shards")
                return
            # this rank's measured write rate: what a later doomed save's ``SPOTGUARD_EVACUATE=auto`` predicts with
            h._note_write_rate(sum(d.size for d in storage.write_log.peek(key).values()),
                               time.monotonic() - job.write_started)
            stage = "gather"  # the record names exactly what the ranks report writing
            written = gather_writes(self.group, storage.write_log.take(key))
            stage = "commit"
            outcome: Any = None
            if h._rank == 0:
                if job.cancelled.is_set():
                    outcome = ("error", "cancelled before the commit")
                else:
                    outcome = commit_and_retain(storage, job.step, CommitRecord(
                        step=job.step, world_size=h._world, reason="periodic", notice_id=None,
                        seconds=round(time.monotonic() - job.started, 3),
                        extra={"staging_seconds": round(job.staging_seconds, 4), "spotguard": __version__,
                               "lineage": h._lineage},
                    ), h._keep, h._log, written, exclude=frozenset(getattr(h, "_damaged_dirs", ())))
            stage = "commit-barrier"
            outcome = self._bcast0(outcome)
            if outcome[0] != "ok":
                job.error = f"commit failed on rank 0: {outcome[1]}"
                return
            job.committed = True
            job.nbytes = int(outcome[1]) or job.nbytes
        except Exception as exc:  # noqa: BLE001 - a collective failed (peer gone, group destroyed)
            job.error = f"{stage}: {type(exc).__name__}: {exc}"
        finally:
            job.seconds = time.monotonic() - job.started
            job.state = {}  # free the staged copy
            if job.committed:
                h._log.info(PERIODIC_COMMITTED, step=job.step, uri=uri, bytes=job.nbytes,
                            seconds=round(job.seconds, 3), steps_during=h._steps.count - job.step)
            else:
                h._log.warning(PERIODIC_FAILED, step=job.step, error=job.error[:500], seconds=round(job.seconds, 3),
                               aborted=job.cancelled.is_set())
            self.history.append(job)
            job.finished.set()

    def _rank0_prepare(self, job: _Job) -> tuple[str, Any]:
        """Rank 0: prepare the step folder, once no notice's save of the same step is being written.

        Why: an ordinary (rebalance/maintenance) notice's background save of step S releases the training
        thread once the state is read, and the next boundary can start the periodic save of the same S
        while that save writes ``step-S/``: this prepare would clear the folder under it (its commit then
        finds a shard missing), or the periodic shards would overwrite bytes the notice's commit record
        has already checksummed (a committed checkpoint that fails verification; seen by the exactness
        oracle, ``rebalance-while-periodic-due``). Waiting here, then ``prepare`` says "already" when the
        notice's save committed S. The wait ends with that save (bounded by its notice's deadline) or
        when a notice's settle abandons this periodic save.
        """
        h = self.hook
        while getattr(h, "_notice_saving", None) == job.step:
            if job.cancelled.is_set():
                return ("error", "abandoned while a notice's checkpoint of the same step was written")
            time.sleep(0.02)
        return h._prepare_status(job.step, self.storage)

    # --------------------------------------------------------------- settling

    def decide(self, step: int, seconds_left: float) -> tuple[str, Optional[float]]:
        """Rank 0's decision for a notice (see the module docstring): (``idle``|``finish``|``abort``, estimate)."""
        job = self.job
        if job is None or not self.busy:
            return "idle", None
        est = job.estimate_remaining()
        if est is not None and est <= seconds_left / 2:
            return "finish", est
        return "abort", est

    def settle(self, decision: str, seconds_left: float) -> tuple[bool, float]:
        """Apply the decision on this rank: (the in-flight save committed, seconds waited)."""
        t0 = time.monotonic()
        job = self.job
        th = self._thread
        if job is None or th is None:
            return False, 0.0
        if decision == "finish":
            job.cutoff = t0 + seconds_left / 2
            if self._own:
                self.storage.deadline = job.cutoff
            th.join(max(0.0, seconds_left / 2) + 1.0)
        else:
            if decision == "abort":
                self._cancel(job)
            # idle on rank 0: this rank's save is at its last collective, which rank 0 already passed
            th.join(max(0.5, min(5.0, seconds_left / 4)))
        return job.finished.is_set() and job.committed, time.monotonic() - t0

    def quiesce(self, timeout: float, *, cancel: bool = False) -> None:
        """Before the process groups go (destroy_process_group, exit): wait for the save, then drop our group.

        ``cancel``: the process is leaving after a notice: abandon the upload instead of waiting for it.
        """
        th = self._thread
        if cancel and self.job is not None:
            self._cancel(self.job)
        if th is not None and th.is_alive():
            self.hook._log.info("waiting for the periodic checkpoint before teardown",
                                step=self.job.step if self.job else None, timeout=timeout)
            th.join(timeout)
            if th.is_alive() and self.job is not None:
                self._cancel(self.job)
                th.join(min(5.0, timeout))
        if th is None or not th.is_alive():
            destroy_group(self.group)
            self.group = None  # let the C++ group (and its gloo threads) go now, not at interpreter exit

    def _cancel(self, job: _Job) -> None:
        """Abandon ``job``: its next write item raises; on an own object-store instance every request
        in flight fails at once and the multipart uploads are aborted (nothing left billing)."""
        job.cancelled.set()
        if self._own:
            self.storage.deadline = time.monotonic() - 1.0

    def close(self) -> None:
        if self.job is not None:
            self._cancel(self.job)
