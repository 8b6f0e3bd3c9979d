"""What the job history costs (issue 27): per step with no notice, notice -> committed, and ``spotguard report``.

One process, two hooks side by side, identical except ``SPOTGUARD_HISTORY`` at construction (on / off),
each on its own model, optimizer and local store; blocks interleaved (A B, B A, ...) so both see the
same machine load:

- **per step, no notice**: 10 ms steps (compute + sleep), blocks of 100; µs per step of each, and the
  number of history records made during those steps (the claim: none — nothing on the per-step path).
- **notice -> committed**: a ``rebalance`` notice (an ordinary checkpoint, training goes on; the same
  agreement and save as an emergency) handed to each hook in turn while it trains; the hook's own
  ``seconds_since_notice`` of its ``checkpoint_committed``; the history's entries are written
  meanwhile by its thread, to the same disk.
- **per event**: µs one ``record`` costs the logging thread (the queue hand-off), the writer held.
- **report**: a synthetic 10,000-event history (1,000 attempts of 2 nodes) in a local folder;
  ``python -m spotguard report DIR --json`` and ``--html`` wall time, interpreter start included.

``python -m benchmarks.bench_history [--out FILE]``: prints the JSON, writes it to FILE if given.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import torch

from benchmarks._util import busy
from spotguard.history.record import Event, event_key
from spotguard.notice import Notice
from spotguard.timefmt import to_rfc3339, utcnow

STEP = 0.010


class _Catch:
    """Forwards to the hook's logger; keeps each ``checkpoint_committed``'s fields by notice id."""

    def __init__(self, inner: Any) -> None:
        self.inner, self.committed = inner, {}

    def info(self, event: Any = None, **kw: Any) -> Any:
        if event == "checkpoint_committed":
            self.committed[kw.get("notice_id")] = kw
        return self.inner.info(event, **kw)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def _job(root: Path, history: bool) -> tuple[Any, torch.nn.Module, torch.optim.Optimizer, _Catch]:
    from spotguard.hook.core import Hook

    os.environ["SPOTGUARD_HISTORY"] = "1" if history else "0"
    model = torch.nn.Sequential(*[torch.nn.Linear(512, 512) for _ in range(4)])
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    hook = Hook({"model": model, "optimizer": opt}, str(root / ("on" if history else "off")), signals=False,
                intake=False, keep=2)
    hook.resume()
    catch = _Catch(hook._log)
    hook._log = catch
    return hook, model, opt, catch


def _step(model: torch.nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor) -> None:
    t0 = time.perf_counter()
    opt.zero_grad(set_to_none=True)
    model(x).square().mean().backward()
    opt.step()
    busy(max(0.0, STEP - (time.perf_counter() - t0)))


def run(blocks: int = 6, per_block: int = 100, notices: int = 12) -> dict[str, Any]:
    torch.manual_seed(0)
    torch.set_num_threads(1)
    x = torch.randn(32, 512)
    root = Path(tempfile.mkdtemp(prefix="sg-bench-history-"))
    jobs = {"history_on": _job(root, True), "history_off": _job(root, False)}
    for hook, model, opt, _ in jobs.values():  # warm-up
        for _ in range(20):
            _step(model, opt, x)
    per_step: dict[str, list[float]] = {k: [] for k in jobs}
    records_during_steps = 0
    for b in range(blocks):
        for name in (list(jobs) if b % 2 == 0 else list(jobs)[::-1]):
            hook, model, opt, _ = jobs[name]
            w = hook._history
            before = w._seq if w is not None else 0
            t0 = time.perf_counter()
            for _ in range(per_block):
                _step(model, opt, x)
            per_step[name].append((time.perf_counter() - t0) / per_block * 1e6)
            records_during_steps += (w._seq - before) if w is not None else 0
    latency: dict[str, list[float]] = {k: [] for k in jobs}
    for r in range(notices):
        for name in (list(jobs) if r % 2 == 0 else list(jobs)[::-1]):
            hook, model, opt, catch = jobs[name]
            nid = f"bench-{name}-{r}"
            now = utcnow()
            hook.notify(Notice(id=nid, source="drill", kind="rebalance", deadline=now + timedelta(seconds=120),
                               received_at=now))
            end = time.monotonic() + 60
            while nid not in catch.committed and time.monotonic() < end:
                _step(model, opt, x)
            latency[name].append(float(catch.committed[nid]["seconds_since_notice"]))
            if hook._history is not None:
                hook._history.flush(5)  # the next round starts with an empty queue, as the first did
    written = jobs["history_on"][0]._history.written
    calls = record_cost(root / "calls")
    for hook, *_ in jobs.values():
        hook.close()
    med = {k: statistics.median(v) for k, v in per_step.items()}
    lat = {k: statistics.median(v) for k, v in latency.items()}
    return {
        "step_seconds": STEP, "blocks": blocks, "steps_per_block": per_block,
        "us_per_step": per_step, "us_per_step_median": med,
        "per_step_ratio": med["history_on"] / med["history_off"],
        "history_records_during_no_notice_steps": records_during_steps,
        "notice_to_committed_s": latency, "notice_to_committed_median_s": lat,
        "notice_to_committed_added_ms": (lat["history_on"] - lat["history_off"]) * 1e3,
        "history_entries_written": written,
        "record_call_us": calls,
        "report": report_speed(root / "synthetic"),
        "load": os.getloadavg(),
    }


def record_cost(root: Path, n: int = 300) -> float:
    """µs one history event costs the thread that logs it (queue hand-off; the writer is held, so no I/O)."""
    from spotguard.history.writer import HistoryWriter
    from spotguard.storage import open_storage

    w = HistoryWriter(open_storage(str(root)), rank=0)
    w.record("notice_seen", {"notice_id": "hold"})  # a save "in flight": the writer thread waits
    fields = {"notice_id": "x", "step": 1, "bytes": 10**9, "seconds": 0.5, "uri": "s3://bucket/job/step-00000001"}
    t0 = time.perf_counter()
    for _ in range(n):
        w.record("agreed", fields)
    per = (time.perf_counter() - t0) / n * 1e6
    w.record("checkpoint_committed", fields)
    w.flush(30)
    return round(per, 2)


def synthetic(root: Path, attempts: int = 1000) -> int:
    """``attempts`` x 10 events (2 nodes): start, resume, notice x2, agreed, started, committed, periodic, exit x2."""
    hist = root / "history"
    hist.mkdir(parents=True, exist_ok=True)
    t, n, step = 1.7e9, 0, 0
    for a in range(attempts):
        run0, run1 = f"{2 * a:012x}", f"{2 * a + 1:012x}"
        nid = f"aws-{a}"
        evs = [Event("hook_installed", t, run0, 0, "n0", fields={"world_size": 16, "process_started": t - 20}),
               Event("hook_installed", t + 0.1, run1, 8, "n1", fields={"world_size": 16}),
               Event("resumed", t + 5, run0, 0, "n0", fields={"step": step, "seconds": 4.0}),
               Event("periodic_committed", t + 1800, run0, 0, "n0", fields={"step": step + 900, "bytes": 10**9,
                                                                            "seconds": 20.0}),
               Event("notice_seen", t + 3000, run0, 0, "n0", fields={
                   "notice_id": nid, "source": "aws", "kind": "preemption",
                   "deadline": to_rfc3339(datetime.fromtimestamp(t + 3120, tz=timezone.utc))}),
               Event("notice_seen", t + 3000.2, run1, 8, "n1", fields={"notice_id": nid, "source": "aws",
                                                                       "kind": "preemption"}),
               Event("agreed", t + 3000.5, run0, 0, "n0", fields={"notice_id": nid, "step": step + 1500,
                                                                  "action": "emergency"}),
               Event("checkpoint_committed", t + 3010, run0, 0, "n0", fields={
                   "notice_id": nid, "step": step + 1500, "bytes": 10**9, "seconds": 9.5,
                   "seconds_since_notice": 10.0}),
               Event("exit", t + 3011, run0, 0, "n0", fields={"notice_id": nid, "code": 143, "step": step + 1500}),
               Event("exit", t + 3011.1, run1, 8, "n1", fields={"notice_id": nid, "code": 143})]
        for i, e in enumerate(evs):
            (root / event_key(e.time, e.run, e.rank, i + 1)).write_bytes(e.to_json())
            n += 1
        t += 3200
        step += 1500
    return n


def report_speed(root: Path, repeats: int = 3) -> dict[str, Any]:
    events = synthetic(root)
    out: dict[str, Any] = {"events": events}
    for mode, extra in (("json", ["--json"]), ("html", ["--json", "--html", str(root / "r.html")])):
        times, cpu = [], []
        for _ in range(repeats):
            t0, r0 = time.perf_counter(), resource.getrusage(resource.RUSAGE_CHILDREN)
            p = subprocess.run([sys.executable, "-m", "spotguard", "report", str(root), *extra],
                               capture_output=True, text=True, timeout=120)
            times.append(time.perf_counter() - t0)
            r1 = resource.getrusage(resource.RUSAGE_CHILDREN)
            cpu.append(round(r1.ru_utime - r0.ru_utime + r1.ru_stime - r0.ru_stime, 3))
            assert p.returncode == 0, p.stderr[-2000:]
            doc = json.loads(p.stdout)
            assert len(doc["attempts"]) == 1000 and len(doc["preemptions"]) == 1000, len(doc["preemptions"])
        out[f"{mode}_seconds"] = times
        out[f"{mode}_cpu_seconds"] = cpu  # user + system: what the load of the machine does not inflate
    return out


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--out")
    ap.add_argument("--only-report", action="store_true", help="only the 10,000-event report timing")
    a = ap.parse_args()
    res = ({"report": report_speed(Path(tempfile.mkdtemp(prefix="sg-bench-report-"))), "load": os.getloadavg()}
           if a.only_report else run())
    text = json.dumps(res, indent=1)
    print(text)
    if a.out:
        Path(a.out).write_text(text + "\n")
