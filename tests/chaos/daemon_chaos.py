"""Daemon chaos: kill the daemon (SIGTERM or SIGKILL) at every phase of an ASG notice, restart it, and check
that the cluster actions still tell the truth exactly once.

    python -m tests.chaos.daemon_chaos --trials 32 [--seed 7] [--json tests/chaos/results/daemon_chaos.json]

Per trial, on loopback only: the emulator (AWS IMDS with ``target-lifecycle-state``), moto's Auto Scaling
(``tests/daemon/moto_asg.py``: the lifecycle calls as AWS documents them, each logged with its time), a
webhook receiver, the fake Kubernetes API server (``tests/daemon/fake_kube.py``: a node and one pod per
subscriber), a real ``spotguard daemon`` with ``--asg-lifecycle-hook auto --webhook-url
--kubernetes-node-actions``, and 1-2 subscriber processes that use the hook's own intake (``spotguard.hook.intake.NoticeIntake``: reconnects
with jittered backoff, drops a report while disconnected) and report ``checkpoint_started`` /
``checkpoint_done`` as the hook does, after a 0.5-4 s "checkpoint". The daemon is killed at one phase:

* ``before_delivery`` — 0-0.25 s after the emulator starts the notice (the daemon polls every 0.2 s);
* ``during_checkpoint`` — after every subscriber reported ``checkpoint_started``;
* ``after_commit`` — right after the subscribers committed (their ``checkpoint_done`` racing the kill);
* ``during_outcome`` — while the webhook receiver holds the outcome's POST (it answers after 2 s);

then restarted after 0-1 s. Verdict per trial (``verdict``): no ``CompleteLifecycleAction CONTINUE``
before every subscriber committed; no false webhook (``no_subscribers``, ``incomplete`` or ``failed`` are
false here: every subscriber commits; ``unreported`` is true only when a ``checkpoint_done`` was lost
because no daemon listened); exactly one outcome (one distinct ``Idempotency-Key``; a repeat of the
same one after a kill during its POST is counted, not failed); per pod at most one Event, and it says the
webhook's outcome (``Normal`` iff committed); the outcome and CONTINUE arrive at all.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Optional

REPO = Path(__file__).resolve().parents[2]
PHASES = ("before_delivery", "during_checkpoint", "after_commit", "during_outcome")
SIGNALS = ("SIGTERM", "SIGKILL")
GRACE = 3.0
NODE = "chaos-node"  # --reconnect-grace for the daemons (the intake reconnects within 2 s)
TRUE_STATUSES = ("committed",)


# --- the subscriber process ------------------------------------------------------------------------------


def subscriber_main(argv: list[str]) -> int:
    """A trainer stand-in: the hook's intake, a checkpoint of ``--ckpt`` seconds, its reports, exit."""
    import types

    from spotguard import protocol

    # The hook's own intake module, without spotguard.hook's package import (torch: ~10 s on a busy host).
    stub = types.ModuleType("spotguard.hook")
    stub.__path__ = [str(REPO / "spotguard" / "hook")]  # type: ignore[attr-defined]
    sys.modules.setdefault("spotguard.hook", stub)
    from spotguard.hook.intake import NoticeIntake

    p = argparse.ArgumentParser()
    p.add_argument("--socket", required=True)
    p.add_argument("--rank", type=int, default=0)
    p.add_argument("--log", required=True)
    p.add_argument("--ckpt", type=float, default=1.0)
    p.add_argument("--timeout", type=float, default=60.0)
    a = p.parse_args(argv)
    out = open(a.log, "a", buffering=1)

    def emit(ev: str, **kw: Any) -> None:
        out.write(json.dumps({"t": time.time(), "ev": ev, "rank": a.rank, "pid": os.getpid(), **kw}) + "\n")

    got = threading.Event()
    box: dict[str, Any] = {}

    def on_notice(n: Any) -> None:
        if "n" not in box:
            box["n"] = n
            emit("notice", id=n.id)
            got.set()

    intake = NoticeIntake(a.socket, rank=a.rank, local_rank=a.rank, world_size=2, job="chaos", on_notice=on_notice)
    intake.start()
    emit("up")
    if not got.wait(a.timeout):
        emit("no_notice")
        intake.close()
        return 3
    n = box["n"]
    step = 100 + a.rank
    connected = intake.connected.is_set()
    intake.report(protocol.CheckpointStarted(id=n.id, step=step))
    emit("checkpoint_started", connected=connected)
    time.sleep(a.ckpt)
    emit("committed", step=step)
    connected = intake.connected.is_set()
    intake.report(protocol.CheckpointDone(id=n.id, step=step, uri=f"file:///chaos/{step}", bytes=1, seconds=a.ckpt))
    flushed = intake.flush(0.5) if connected else False  # what the hook's _flush_intake does before exiting
    emit("done_reported", connected=connected, flushed=flushed)
    intake.close()
    return 0


# --- loopback fakes -----------------------------------------------------------------------------------------


class Webhook:
    """Records every POST (time, Idempotency-Key, body); ``delay`` holds each answer that long."""

    def __init__(self, delay: float = 0.0) -> None:
        self.delay = delay
        self.posts: list[dict[str, Any]] = []
        self.arrived = asyncio.Event()
        self._runner: Any = None
        self.port = 0

    async def __aenter__(self) -> "Webhook":
        from aiohttp import web

        async def handle(request: web.Request) -> web.Response:
            body = await request.json()
            rec = {"t": time.time(), "key": request.headers.get("Idempotency-Key", ""),
                   "status": body.get("outcome", {}).get("status"), "reason": body.get("outcome", {}).get("reason"),
                   "answered": False}
            self.posts.append(rec)
            self.arrived.set()
            if self.delay:
                await asyncio.sleep(self.delay)
            rec["answered"] = True
            return web.json_response({"ok": True})

        app = web.Application()
        app.router.add_post("/hook", handle)
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self._runner.cleanup()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/hook"


def _records(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    out = []
    for line in path.read_text(errors="replace").splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            pass
    return out


async def _wait(cond: Any, timeout: float, what: str) -> None:
    end = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > end:
            raise TimeoutError(f"timed out waiting for {what}")
        await asyncio.sleep(0.02)  # other processes' files: nothing to await


# --- one trial ---------------------------------------------------------------------------------------------


class Trial:
    def __init__(self, n: int, rng: random.Random, work: Path, moto: Any, phase: str, sig: str,
                 code: str = str(REPO)) -> None:
        self.n, self.rng, self.moto, self.phase, self.sig = n, rng, moto, phase, sig
        self.code = code  # the spotguard tree the daemons run (--code: an older tree, to see the suite fail)
        self.dir = Path(tempfile.mkdtemp(prefix=f"sgdc{n}-", dir="/tmp"))  # short: AF_UNIX path limit
        self.work = work / f"trial-{n:03d}"
        self.work.mkdir(parents=True, exist_ok=True)
        self.sock = str(self.dir / "s.sock")
        self.subs_log = self.work / "subscribers.jsonl"
        self.procs: list[subprocess.Popen[bytes]] = []
        self.daemons: list[subprocess.Popen[bytes]] = []
        self.t0 = 0.0

    kubeconfig = ""

    def _env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("SPOTGUARD_") and k != "NOTIFY_SOCKET"}
        env.update(AWS_ENDPOINT_URL=self.moto.url, AWS_ACCESS_KEY_ID="testing", AWS_SECRET_ACCESS_KEY="testing",
                   AWS_REGION="us-east-1", PYTHONPATH=str(REPO) + os.pathsep + env.get("PYTHONPATH", ""))
        env.pop("AWS_PROFILE", None)
        env.pop("KUBERNETES_SERVICE_HOST", None)
        if self.kubeconfig:
            env["KUBECONFIG"] = self.kubeconfig
        return env

    async def _daemon(self, emu_url: str, webhook_url: str, life: int) -> subprocess.Popen[bytes]:
        from spotguard.daemon.client import request
        from spotguard.protocol import StatusRequest

        log = open(self.work / f"daemon-{life}.log", "ab")
        proc = subprocess.Popen(
            [sys.executable, "-m", "spotguard", "daemon", "--socket", self.sock, "--cloud", "aws",
             "--metadata-url", emu_url, "--poll-interval", "0.2", "--log-format", "json",
             "--asg-lifecycle-hook", "auto", "--webhook-url", webhook_url,
             "--kubernetes-node-actions", "--node", NODE],
            stdout=log, stderr=subprocess.STDOUT, env={**self._env(), "SPOTGUARD_RECONNECT_GRACE": str(GRACE),
                                                       "PYTHONPATH": self.code},
            cwd=self.code)  # `python -m` puts the working directory first on sys.path
        self.daemons.append(proc)
        end = time.monotonic() + 30
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"daemon exited {proc.returncode}: {(self.work / f'daemon-{life}.log').read_text()[-2000:]}")
            try:
                reply = await request(self.sock, StatusRequest(), timeout=1.0)
                if getattr(reply, "state", {}).get("pid") == proc.pid:
                    return proc
            except Exception:
                pass
            if time.monotonic() > end:
                raise RuntimeError("daemon not ready")
            await asyncio.sleep(0.05)

    def _subs(self, ev: str) -> list[dict[str, Any]]:
        return [r for r in _records(self.subs_log) if r["ev"] == ev]

    async def run(self) -> dict[str, Any]:
        from spotguard.emulator.server import running_emulator

        nsubs = self.rng.choice((1, 2))
        # Long enough, often, to outlast the daemon's restart (a premature CONTINUE shows), short enough for a trial.
        ckpt = [round(self.rng.uniform(0.5, 4.0), 2) for _ in range(nsubs)]
        t0 = self.t0 = time.time()
        killed_at = restarted_at = 0.0
        exit_code: Optional[int] = None
        error = ""
        from tests.daemon.fake_kube import FakeKube

        async with Webhook(delay=2.0 if self.phase == "during_outcome" else 0.0) as hook, \
                FakeKube(node_name=NODE) as kube:
            for r in range(nsubs):
                kube.add_pod("ml", f"train-{r}")
            self.kubeconfig = kube.kubeconfig(self.work / "kubeconfig")
            async with running_emulator(asg=True) as emu:
                try:
                    d1 = await self._daemon(emu.url, hook.url, 1)
                    for r in range(nsubs):
                        self.procs.append(subprocess.Popen(
                            [sys.executable, "-m", "tests.chaos.daemon_chaos", "--subscriber", "--socket", self.sock,
                             "--rank", str(r), "--log", str(self.subs_log), "--ckpt", str(ckpt[r])],
                            env={**self._env(), "SPOTGUARD_POD_NAME": f"train-{r}", "SPOTGUARD_POD_NAMESPACE": "ml"},
                            cwd=str(REPO), stdout=subprocess.DEVNULL,
                            stderr=open(self.work / f"sub-{r}.log", "ab")))
                    await _wait(lambda: len(self._subs("up")) == nsubs, 20, "subscribers up")
                    await asyncio.sleep(0.3)  # subscribed (the intake connects within ms of starting)
                    emu.notice("aws", "termination")
                    if self.phase == "before_delivery":
                        await asyncio.sleep(self.rng.uniform(0.0, 0.25))
                    elif self.phase == "during_checkpoint":
                        await _wait(lambda: len(self._subs("checkpoint_started")) == nsubs, 20, "checkpoints started")
                        await asyncio.sleep(self.rng.uniform(0.0, min(ckpt) * 0.5))
                    elif self.phase == "after_commit":
                        await _wait(lambda: len(self._subs("committed")) == nsubs, 20, "commits")
                        await asyncio.sleep(self.rng.uniform(0.0, 0.05))
                    else:
                        await asyncio.wait_for(hook.arrived.wait(), 30)
                    killed_at = time.time()
                    d1.send_signal(getattr(signal, self.sig))
                    try:
                        exit_code = await asyncio.to_thread(d1.wait, 10)
                    except subprocess.TimeoutExpired:
                        d1.kill()
                        exit_code = -999
                    await asyncio.sleep(self.rng.uniform(0.0, 1.0))
                    restarted_at = time.time()
                    d2 = await self._daemon(emu.url, hook.url, 2)
                    # Settled: every subscriber exited, and an answered outcome, then a quiet moment.
                    await _wait(lambda: all(p.poll() is not None for p in self.procs), 40, "subscribers exit")
                    await _wait(lambda: any(p["answered"] for p in hook.posts), GRACE + 20, "the outcome")
                    await _wait(lambda: self._continued(), 15, "CompleteLifecycleAction") \
                        if hook.posts[0]["status"] == "committed" else None
                    await _wait(lambda: self._pod_events(kube) >= nsubs, 15, "the pods' Events")
                    await asyncio.sleep(0.5)
                    d2.send_signal(signal.SIGINT)
                    await asyncio.to_thread(d2.wait, 10)
                except Exception as exc:  # recorded as a violation, the next trial still runs
                    error = f"{type(exc).__name__}: {exc}"
                finally:
                    for p in [*self.procs, *self.daemons]:
                        if p.poll() is None:
                            p.kill()
                            p.wait()
        calls = [c for c in self.moto.calls() if c.get("t", 0) >= t0]
        subs = _records(self.subs_log)
        result = {"trial": self.n, "phase": self.phase, "signal": self.sig, "subscribers": nsubs, "ckpt_s": ckpt,
                  "exit_code_first_life": exit_code, "killed_at": killed_at, "restarted_at": restarted_at,
                  "webhooks": hook.posts, "asg_calls": [{k: c[k] for k in ("action", "hook", "result", "t")}
                                                        for c in calls],
                  "subscriber_events": subs, "error": error, "seconds": round(time.time() - t0, 2),
                  "pod_events": [{"pod": e["involvedObject"]["name"], "name": e["metadata"]["name"],
                                  "type": e["type"], "message": e["message"][:200]}
                                 for e in kube.events if e["involvedObject"]["kind"] == "Pod"]}
        result["violations"] = verdict(result)
        if not result["violations"]:
            shutil.rmtree(self.work, ignore_errors=True)
        shutil.rmtree(self.dir, ignore_errors=True)
        return result

    @staticmethod
    def _pod_events(kube: Any) -> int:
        return len({e["involvedObject"]["name"] for e in kube.events if e["involvedObject"]["kind"] == "Pod"})

    def _continued(self) -> bool:
        return any(c["action"] == "CompleteLifecycleAction" and c.get("result") == "CONTINUE"
                   and c.get("t", 0) >= self.t0 for c in self.moto.calls())


# --- the verdict -------------------------------------------------------------------------------------------


def verdict(r: dict[str, Any]) -> list[str]:
    """What went wrong in one trial (empty: nothing)."""
    bad: list[str] = []
    if r["error"]:
        bad.append(f"driver: {r['error']}")
    ev = r["subscriber_events"]
    commits = [e["t"] for e in ev if e["ev"] == "committed"]
    if len(commits) < r["subscribers"]:
        bad.append(f"only {len(commits)} of {r['subscribers']} subscribers committed")
    last_commit = max(commits) if commits else float("inf")
    continues = [c for c in r["asg_calls"] if c["action"] == "CompleteLifecycleAction" and c["result"] == "CONTINUE"]
    for c in continues:
        if c["t"] < last_commit:
            bad.append(f"premature CONTINUE {last_commit - c['t']:.3f}s before the last commit")
    if {c["hook"] for c in r["asg_calls"]} - {"spotguard-drain"}:
        bad.append("a hook other than spotguard-drain was touched")
    posts = r["webhooks"]
    keys = {p["key"] for p in posts}
    statuses = {p["status"] for p in posts}
    if not posts:
        bad.append("no outcome was sent")
    if len(keys) > 1 or len(statuses) > 1:
        bad.append(f"{max(len(keys), len(statuses))} different outcomes: {sorted(map(str, statuses))}")
    # A lost checkpoint_done: reported while no daemon listened (or into a dying connection).
    lost = [e for e in ev if e["ev"] == "done_reported"
            and (not e.get("flushed") or (r["killed_at"] - 1.0 <= e["t"] <= r["restarted_at"] + 2.5))]
    for s in statuses:
        if s == "committed":
            continue
        if s == "unreported" and lost:
            continue  # true: a trainer's report was lost with the daemon, and the daemon says just that
        bad.append(f"false outcome {s!r} (every subscriber committed; reports lost: {len(lost)})")
    by_pod: dict[str, set[str]] = {}
    for e in r.get("pod_events", []):
        by_pod.setdefault(e["pod"], set()).add(e["name"])
        want = "Normal" if statuses == {"committed"} else "Warning"
        if e["type"] != want:
            bad.append(f"pod {e['pod']}: a {e['type']} Event for outcome {sorted(map(str, statuses))}")
    for pod, names in by_pod.items():
        if len(names) > 1:
            bad.append(f"pod {pod}: {len(names)} Events (different outcomes)")
    if posts and len(by_pod) < r["subscribers"]:
        bad.append(f"Events on {len(by_pod)} of {r['subscribers']} pods")
    if "committed" in statuses and not continues:
        bad.append("committed, but no CompleteLifecycleAction CONTINUE")
    return bad


# --- the run -----------------------------------------------------------------------------------------------


async def run(trials: int, seed: int, work: Path, phases: tuple[str, ...] = PHASES,
              code: str = str(REPO)) -> dict[str, Any]:
    sys.path.insert(0, str(REPO))
    from tests.daemon.test_actions_asg import Moto

    work.mkdir(parents=True, exist_ok=True)
    moto = Moto(work)
    rng = random.Random(seed)
    results = []
    try:
        moto.group("chaos-asg", hook_timeout=60, others=("someone-elses-log-shipper",))
        for i in range(trials):
            phase = phases[i % len(phases)]
            # every (phase, signal) pair once per 2 x phases trials; fewer: the signals alternate, SIGKILL first,
            # so that four trials kill -9 before_delivery and after_commit (docs/reliability.md's regressions)
            sig = (SIGNALS[(i // len(phases)) % len(SIGNALS)] if trials >= 2 * len(phases)
                   else SIGNALS[(i + 1) % len(SIGNALS)])
            r = await Trial(i, rng, work, moto, phase, sig, code).run()
            statuses = sorted({str(p["status"]) for p in r["webhooks"]})
            print(f"trial {i:3d} {phase:18s} {sig:7s} subs={r['subscribers']} outcome={','.join(statuses) or '-':12s}"
                  f" webhooks={len(r['webhooks'])} continue={sum(c['action'] == 'CompleteLifecycleAction' for c in r['asg_calls'])}"
                  f" {r['seconds']:5.1f}s {'OK' if not r['violations'] else 'VIOLATION: ' + '; '.join(r['violations'])}",
                  flush=True)
            results.append(r)
    finally:
        moto.stop()
    summary = {
        "trials": len(results), "seed": seed,
        "violations": sum(bool(r["violations"]) for r in results),
        "premature_continue": sum(any("premature" in v for v in r["violations"]) for r in results),
        "false_outcomes": sum(any("false outcome" in v for v in r["violations"]) for r in results),
        "multiple_outcomes": sum(any("different outcomes" in v for v in r["violations"]) for r in results),
        "repeated_same_outcome": sum(len(r["webhooks"]) > 1 for r in results),
        "unreported_outcomes": sum(any(p["status"] == "unreported" for p in r["webhooks"]) for r in results),
        "by_phase": {ph: sum(r["phase"] == ph for r in results) for ph in PHASES},
        "by_signal": {s: sum(r["signal"] == s for r in results) for s in SIGNALS},
        "results": results,
    }
    return summary


def main(argv: Optional[list[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "--subscriber":
        return subscriber_main(argv[1:])
    p = argparse.ArgumentParser(prog="python -m tests.chaos.daemon_chaos")
    p.add_argument("--trials", type=int, default=32)
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--workdir", default="")
    p.add_argument("--phases", default=",".join(PHASES), help="comma-separated subset of " + ",".join(PHASES))
    p.add_argument("--code", default=str(REPO), help="the spotguard tree the daemons run (default: this one)")
    p.add_argument("--json", default="", help="write the raw results here (e.g. tests/chaos/results/daemon_chaos.json)")
    a = p.parse_args(argv)
    work = Path(a.workdir or tempfile.mkdtemp(prefix="sg-daemon-chaos-"))
    summary = asyncio.run(run(a.trials, a.seed, work, tuple(a.phases.split(",")), os.path.abspath(a.code)))
    print(json.dumps({k: v for k, v in summary.items() if k != "results"}))
    if a.json:
        Path(a.json).write_text(json.dumps(summary, indent=1) + "\n")
    return 1 if summary["violations"] else 0


if __name__ == "__main__":
    sys.exit(main())
