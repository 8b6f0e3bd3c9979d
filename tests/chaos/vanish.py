"""A node that vanishes: two torchrun "nodes" (agents) x 2 ranks on loopback, node B frozen with SIGSTOP.

Why SIGSTOP: a powered-off VM sends nothing — no FIN, no reset — so its peers can only
notice by silence. A SIGKILLed process would close its sockets and its peers would get a
reset at once (PITFALLS.md). The whole of node B is stopped: its torchrun agent's process
group and each worker's own session (torchrun starts every worker with
``start_new_session``).

One *trial* = fresh rendezvous store (``deploy/torchrun/rendezvous-store.sh``, a third
process: the stable machine of the recipe), nodes A and B each a ``torchrun --nnodes 2
--nproc-per-node 2 --rdzv-backend c10d`` with ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` as in
``deploy/torchrun/launch.sh``, a local-folder storage, ``tests/chaos/_vanish_train.py``
(rank 0 commits an ordinary checkpoint after step 2). Then, at one *point*:

- ``iteration``: B is frozen in the middle of training (A's ranks then sit in the user's DDP
  all-reduce); with ``notice="B"``, right after B's ranks logged ``notice_seen``;
- ``agreement``: a notice (SIGUSR1 to B's or to A's workers), B frozen as soon as one of B's
  ranks logs ``agreed``;
- ``save``: the same, at B's ``checkpoint_started`` (B's save widened by
  ``SPOTGUARD_TEST_SAVE_DELAY`` so the freeze lands inside it);
- ``commit``: the same, at B's ``checkpoint_committed``.

Measured: seconds from the freeze to the end of the last of A's worker processes, their exit
codes and how they left (``peers_lost`` or the hook's own exit). Checked: every committed
checkpoint in storage verifies (nothing partial), the newest is the one expected (the
point's commit, else the earlier one), and a fresh 2-rank job resumes from it. Finally B is
SIGKILLed (a stopped process dies on SIGKILL) so nothing leaks.

``python -m tests.chaos.vanish`` runs the whole grid (``make chaos`` does), each trial judged by
``judge`` as ``test_vanished_node.py`` judges its one point; the per-point p99 is ``benchmarks/vanished_node.py``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Optional

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from tests.hook._torchrun import TORCHRUN, TorchRun  # noqa: E402

SCRIPT = Path(__file__).resolve().parent / "_vanish_train.py"
STORE = REPO / "deploy" / "torchrun" / "rendezvous-store.sh"
POINTS = ("iteration", "agreement", "save", "commit")
NOTICES = ("B", "A", "none")
TRIGGER = {"agreement": "agreed", "save": "checkpoint_started", "commit": "checkpoint_committed"}
PER_NODE = 2
CHECKPOINT_AT = 2


def grid() -> list[tuple[str, str]]:
    """Every (point, notice) pair: ``iteration`` with no notice or one on B; the others with a notice on B or on A."""
    return [("iteration", "none"), ("iteration", "B")] + [(p, n) for p in POINTS[1:] for n in ("B", "A")]


@dataclass
class Trial:
    point: str
    notice: str
    peer_timeout: float
    ok: bool = False
    problems: list[str] = field(default_factory=list)
    b_ranks: list[int] = field(default_factory=list)
    a_exit_seconds: Optional[float] = None  # freeze -> last of A's workers gone
    a_codes: dict[int, Any] = field(default_factory=dict)
    a_how: dict[int, str] = field(default_factory=dict)  # "peers_lost" | "hook_exit" | "?"
    agent_rc: Optional[int] = None
    expected_step: Optional[int] = None
    newest_step: Optional[int] = None
    resumed_step: Optional[int] = None
    seconds: float = 0.0


def _children(pid: int) -> list[int]:
    try:
        return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


def _gone(pid: int) -> bool:
    """Exited (or a zombie not reaped yet: it runs no more)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except (OSError, IndexError):
        return True


class Node:
    """One torchrun agent ("node") with its 2 workers, in its own session; JSON lines read from its log."""

    def __init__(self, folder: Path, name: str, env: dict[str, str], port: int, args: list[str]) -> None:
        self.name = name
        self.log = folder / f"node-{name}.log"
        cmd = [str(TORCHRUN), "--nnodes", "2", "--nproc-per-node", str(PER_NODE), "--max-restarts", "0",
               "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "vanish",
               "--rdzv-conf", "is_host=false", "--monitor-interval", "0.1", str(SCRIPT), *args]
        with open(self.log, "wb") as f:
            self.proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=str(folder),
                                         start_new_session=True)
        self.reader = TorchRun.__new__(TorchRun)
        self.reader.log, self.reader.proc = self.log, self.proc

    def events(self, name: Optional[str] = None) -> list[dict[str, Any]]:
        return self.reader.events(name)

    def ranks(self) -> dict[int, int]:
        """rank -> worker pid, from the hooks' ``hook_installed`` lines."""
        return {int(e["rank"]): int(e["pid"]) for e in self.events("hook_installed")}

    def workers(self) -> list[int]:
        return _children(self.proc.pid)

    def freeze(self) -> None:
        """SIGSTOP the agent's process group and every worker's session: nothing of B runs or answers."""
        for pid in [*self.workers(), *self.ranks().values()]:
            try:
                os.killpg(pid, signal.SIGSTOP)
            except OSError:
                pass
        os.killpg(self.proc.pid, signal.SIGSTOP)

    def signal_workers(self, sig: int) -> None:
        for pid in self.ranks().values():
            try:
                os.kill(pid, sig)
            except OSError:
                pass

    def kill(self) -> None:
        """SIGKILL everything of this node (works on stopped processes too), then SIGCONT for good measure."""
        pids = [*self.workers(), *self.ranks().values()]
        for pid in pids:
            for sig in (signal.SIGKILL, signal.SIGCONT):
                try:
                    os.killpg(pid, sig)
                except OSError:
                    pass
        for sig in (signal.SIGKILL, signal.SIGCONT):
            try:
                os.killpg(self.proc.pid, sig)
            except OSError:
                pass
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass

    def tail(self, n: int = 30) -> str:
        return self.reader.tail(n)


def _of_notice(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The events of the trial's notice (SIGUSR1), not of the earlier ``rebalance-*`` checkpoint."""
    return [e for e in events if not str(e.get("notice_id", "")).startswith("rebalance-")]


def _wait(pred: Any, timeout: float, what: str, nodes: list[Node]) -> Any:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        val = pred()
        if val:
            return val
        if any(n.proc.poll() is not None for n in nodes):
            raise RuntimeError(f"a node ended before {what}:\n" + "\n".join(n.tail() for n in nodes))
        time.sleep(0.005)  # polling child logs: nothing to await
    raise RuntimeError(f"timed out after {timeout} s waiting for {what}:\n" + "\n".join(n.tail() for n in nodes))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def base_env(folder: Path, peer_timeout: float) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SPOTGUARD_", "TORCHELASTIC_"))}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1",
               PYTHONPATH=f"{REPO}{os.pathsep}{env['PYTHONPATH']}" if env.get("PYTHONPATH") else str(REPO),
               SPOTGUARD_STORAGE=f"file://{folder}/ckpt", SPOTGUARD_SOCKET=str(folder / "absent.sock"),
               SPOTGUARD_PEER_TIMEOUT=str(peer_timeout), SPOTGUARD_PEER_INTERVAL=str(min(0.5, peer_timeout / 4)))
    return env


def committed(folder: Path) -> tuple[Optional[int], list[str]]:
    """(newest committed step, problems): every committed folder must verify byte for byte."""
    from spotguard.storage import open_storage
    from spotguard.storage.commit import newest_committed, scan
    from spotguard.storage.verify import verify_checkpoint

    storage = open_storage(f"file://{folder}/ckpt")
    problems = []
    for info in scan(storage):
        if info.committed:
            try:
                verify_checkpoint(storage, info)
            except Exception as exc:  # noqa: BLE001 - reported as the trial's failure
                problems.append(f"committed {info.dir} does not verify: {exc}")
    newest = newest_committed(storage)
    return (newest.step if newest is not None else None), problems


def resume_check(folder: Path, env: dict[str, str], step: int, timeout: float = 120) -> Optional[int]:
    """A fresh 2-rank job on the same storage: the step it resumed from (it must then train 2 steps and end)."""
    env = dict(env, SPOTGUARD_PEER_TIMEOUT="off")
    run = TorchRun(folder / "resume.log", ["--steps", str(step + 2), "--step-time", "0", "--checkpoint-at", "-1"],
                   script=SCRIPT, nproc=2, env=env)
    rc = run.wait(timeout)
    if rc != 0:
        raise RuntimeError(f"resume run exited {rc}:\n{run.tail()}")
    got = [e["step"] for e in run.events("resumed") if e.get("rank") == 0]
    return got[0] if got else None


def run_trial(point: str, notice: str, folder: Path, *, peer_timeout: float = 3.0, seed: Optional[int] = None,
              hang: float = 90.0) -> Trial:
    """One freeze at ``point`` with a notice on ``notice`` ("A", "B" or "none"); never raises for a failed check."""
    t_start = time.monotonic()
    rng = random.Random(seed)
    trial = Trial(point, notice, peer_timeout)
    folder.mkdir(parents=True, exist_ok=True)
    env = base_env(folder, peer_timeout)
    port = _free_port()
    store = subprocess.Popen([str(STORE)], env=dict(env, RDZV_PORT=str(port), PYTHON=sys.executable),
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    nodes: list[Node] = []
    try:
        assert store.stdout is not None and f":{port}" in store.stdout.readline()
        args = ["--step-time", "0.2", "--checkpoint-at", str(CHECKPOINT_AT)]
        env_b = dict(env, SPOTGUARD_TEST_SAVE_DELAY="2") if point == "save" else env
        a, b = Node(folder, "a", env, port, args), Node(folder, "b", env_b, port, args)
        nodes += [a, b]
        first = _wait(lambda: [e for n in nodes for e in n.events("checkpoint_committed")], 120,
                      "the first committed checkpoint", nodes)
        trial.expected_step = int(first[0]["step"])
        _wait(lambda: len(a.ranks()) == PER_NODE and len(b.ranks()) == PER_NODE, 30, "every hook", nodes)
        trial.b_ranks = sorted(b.ranks())
        if notice != "none":
            (b if notice == "B" else a).signal_workers(signal.SIGUSR1)  # the node's notice (the hook's handler)
        if point == "iteration":
            if notice == "B":
                _wait(lambda: b.events("notice_seen"), 30, "B's notice_seen", nodes)
            else:
                time.sleep(rng.uniform(0.0, 0.4))  # a random phase of the 0.2 s iterations
        else:
            _wait(lambda: _of_notice(b.events(TRIGGER[point])), 60, f"B's {TRIGGER[point]}", nodes)
        b.freeze()
        t0 = time.monotonic()
        if point == "commit":
            trial.expected_step = int(_of_notice(b.events("checkpoint_committed"))[0]["step"])
        a_pids = a.ranks()
        end = t0 + hang
        while time.monotonic() < end and not all(_gone(p) for p in a_pids.values()):
            time.sleep(0.005)  # polling process state: nothing to await
        if all(_gone(p) for p in a_pids.values()):
            trial.a_exit_seconds = round(time.monotonic() - t0, 3)
        else:
            trial.problems.append(f"node A's ranks still running {hang} s after the freeze (hung)")
        try:
            trial.agent_rc = a.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            trial.problems.append("node A's torchrun agent still running 30 s after its workers")
        for r in a_pids:
            lost = [e for e in a.events("peers_lost") if e.get("rank") == r]
            ex = [e for e in a.events("exit") if e.get("rank") == r]
            trial.a_codes[r] = ex[-1].get("code") if ex else None
            trial.a_how[r] = "peers_lost" if lost else ("hook_exit" if ex else "?")
    except Exception as exc:  # noqa: BLE001 - a trial reports, the caller asserts
        trial.problems.append(f"{type(exc).__name__}: {exc}")
    finally:
        for n in nodes:
            n.kill()
        store.send_signal(signal.SIGTERM)
        try:
            store.wait(timeout=10)
        except subprocess.TimeoutExpired:
            store.kill()
    if not trial.problems:
        try:
            trial.newest_step, bad = committed(folder)
            trial.problems += bad
            if trial.newest_step != trial.expected_step:
                trial.problems.append(f"newest committed step {trial.newest_step}, expected {trial.expected_step}")
            if trial.newest_step is not None:
                trial.resumed_step = resume_check(folder, env, trial.newest_step)
                if trial.resumed_step != trial.newest_step:
                    trial.problems.append(f"resumed from {trial.resumed_step}, newest committed {trial.newest_step}")
        except Exception as exc:  # noqa: BLE001
            trial.problems.append(f"{type(exc).__name__}: {exc}")
    trial.ok = not trial.problems
    trial.seconds = round(time.monotonic() - t_start, 1)
    return trial


def exit_bound(peer_timeout: float) -> float:
    """What the tests assert on freeze -> A's exit: the watch's own bound plus slack for a loaded 2-core machine."""
    return peer_timeout + 1.5 + 6.0


def judge(t: Trial, peer_timeout: float) -> list[str]:
    """What is wrong with a finished trial (the test and ``main`` both judge by this): its problems, node A
    past the bound, exit codes other than 69 (peers lost: the watch), 75 (the hook's own bounded wait ran out
    first: a notice deadline shorter than the peer timeout) and 143 (this run's state at its step committed);
    ``commit``: 143 on every rank of A (nothing lost), other points never 143 and the newest commit the one from
    before the freeze; no notice: only the watch (``peers_lost``) can end A's wait."""
    if t.problems:
        return list(t.problems)
    out: list[str] = []
    bound = exit_bound(peer_timeout)
    if t.a_exit_seconds is None or t.a_exit_seconds > bound:
        out.append(f"node A took {t.a_exit_seconds} s > {bound} s")
    codes = set(t.a_codes.values())
    if not codes <= {69, 75, 143}:
        out.append(f"node A's exit codes {t.a_codes}, want 69/75/143")
    if t.point == "commit":
        if codes != {143}:
            out.append(f"B frozen after the commit: node A's exit codes {t.a_codes}, want 143 on every rank")
    else:
        if 143 in codes:
            out.append(f"143 (nothing lost) from node A with nothing committed for it: {t.a_codes}")
        if t.newest_step != t.expected_step:
            out.append(f"newest committed step {t.newest_step}, expected {t.expected_step} (from before the freeze)")
    if t.notice == "none" and set(t.a_how.values()) != {"peers_lost"}:
        out.append(f"no notice, yet node A's ranks left by {t.a_how} (only the watch can end the wait)")
    return out


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description="freeze node B at every point of the grid; print one JSON line each")
    p.add_argument("--trials", type=int, default=1, help="trials per point")
    p.add_argument("--peer-timeout", type=float, default=3.0)
    p.add_argument("--points", default=",".join(f"{a}/{b}" for a, b in grid()))
    p.add_argument("--workdir", default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="also append the JSON lines to this file")
    args = p.parse_args(argv)
    work = Path(args.workdir or tempfile.mkdtemp(prefix="vanish-"))
    failed = 0
    for k in range(args.trials):
        for spec in args.points.split(","):
            point, notice = spec.split("/")
            t = run_trial(point, notice, work / f"{point}-{notice}-{k}", peer_timeout=args.peer_timeout,
                          seed=args.seed * 1000 + k)
            t.problems = judge(t, args.peer_timeout)
            t.ok = not t.problems
            failed += not t.ok
            line = json.dumps(asdict(t))
            print(line, flush=True)
            if args.out:
                with open(args.out, "a") as f:
                    f.write(line + "\n")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
