"""Real torchft replica groups on one machine: the worker, and the launch helpers tests, demo and benchmark share.

``python -m spotguard.ftreplica --replica-id g0 --lighthouse http://127.0.0.1:P
--socket /tmp/g0.sock --storage /tmp/ckpt --steps 60`` is one replica group (one
process, gloo on CPU) training a small deterministic model with torchft and a
``ReplicaGuard``. It prints JSON lines: the hook's events plus one
``replica_step`` per step (step, wall time, participants, a digest of the
weights) so a driver can check that survivors never stall or go back and that
a healed replacement holds exactly the survivors' weights.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import queue
import shutil
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any, Optional

__all__ = ["Lighthouse", "Group", "ReplicaJob", "start_lighthouse", "start_group", "drill", "lighthouse_binary", "main"]


#: the worker's learning rate: LR * lr_factor(k) for the step after k committed steps (LambdaLR)
LR = 1e-3


def lr_factor(k: int) -> float:
    return 0.95 ** k


def digest(model: Any, optim: Any) -> str:
    """SHA-256 of every parameter's and optimizer state tensor's bytes and the learning rates (the scheduler's
    effect): equal digests = bitwise equal state."""
    import torch  # noqa: PLC0415

    h = hashlib.sha256()
    h.update(repr([g["lr"] for g in optim.param_groups]).encode())
    for p in model.parameters():
        h.update(p.detach().cpu().contiguous().numpy().tobytes())
    for _, st in sorted(optim.state_dict()["state"].items()):
        for k in sorted(st):
            v = st[k]
            h.update(k.encode())
            h.update(v.detach().cpu().contiguous().numpy().tobytes() if isinstance(v, torch.Tensor)
                     else repr(v).encode())
    return h.hexdigest()[:16]


def _batch(step: int, replica: str, dim: int) -> tuple[Any, Any]:
    """Deterministic data for (step, replica): the same run gives the same gradients."""
    import torch  # noqa: PLC0415

    g = torch.Generator().manual_seed(step * 1009 + int(hashlib.sha256(replica.encode()).hexdigest()[:6], 16))
    x = torch.randn(16, dim, generator=g)
    return x, x.sum(dim=1, keepdim=True) * 0.1


def worker(args: argparse.Namespace) -> int:
    import torch  # noqa: PLC0415
    from torch.distributed import TCPStore  # noqa: PLC0415
    from torchft import Manager, ProcessGroupGloo, ProcessGroupNCCL  # noqa: PLC0415

    from .hook.core import Preempted  # noqa: PLC0415
    from .hook.torchft import STEP, ReplicaGuard  # noqa: PLC0415
    from .logs import configure_logging, get_logger  # noqa: PLC0415

    configure_logging("json", os.environ.get("SPOTGUARD_LOG_LEVEL", "info"), stream=sys.stdout)
    log = get_logger("spotguard.ftreplica", component="replica", replica=args.replica_id,
                     rank=int(os.environ.get("RANK", "0")))
    torch.manual_seed(0)  # every group starts from the same weights (torchft's init_sync heals them anyway)
    dim = args.dim
    dev = torch.device(args.device)
    model = torch.nn.Sequential(torch.nn.Linear(dim, dim), torch.nn.Tanh(), torch.nn.Linear(dim, 1)).to(dev)
    optim = torch.optim.AdamW(model.parameters(), lr=LR)
    sched = torch.optim.lr_scheduler.LambdaLR(optim, lr_factor)  # stepped after each committed step
    if args.hold:
        # a warm spare: imports done, no lighthouse contact yet; the driver writes a line to go
        log.info("replica_ready", pid=os.getpid())
        sys.stdout.flush()
        if not sys.stdin.readline():
            return 0  # the driver went away without releasing us
    # several processes per group (started by torchrun, --procs): the group's own process group, torchrun's
    # store for torchft, each rank its own data; else one process with a store of its own
    rank, procs = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    if procs > 1:
        import torch.distributed as dist  # noqa: PLC0415

        dist.init_process_group("gloo", timeout=timedelta(seconds=args.pg_timeout))
        store_addr, store_port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    else:
        store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        store_addr, store_port = "127.0.0.1", store.port
    data_id = args.replica_id if procs == 1 else f"{args.replica_id}:{rank}"

    # no load_state_dict/state_dict of its own: the ReplicaGuard registers its dict as what heals transport
    manager = Manager(
        pg=(ProcessGroupNCCL if dev.type == "cuda" else ProcessGroupGloo)(timeout=timedelta(seconds=args.pg_timeout)),
        load_state_dict=None,
        state_dict=None,
        min_replica_size=1,
        rank=rank, world_size=procs, store_addr=store_addr, store_port=store_port,
        lighthouse_addr=args.lighthouse, replica_id=args.replica_id, hostname="127.0.0.1",
        timeout=timedelta(seconds=args.pg_timeout), quorum_timeout=timedelta(seconds=60),
        connect_timeout=timedelta(seconds=20),
    )
    guard = ReplicaGuard(manager, {"model": model, "optim": optim, "sched": sched}, args.storage,
                         socket=args.socket)
    start = guard.resume()
    log.info("replica_started", step=start, pid=os.getpid(), digest=digest(model, optim))
    opt = guard.optimizer(optim)
    voting = 0  # replicas that voted in the last committed step

    def more() -> bool:
        # --end-with N: past --steps, go on until a committed step had N replicas voting (a replacement has
        # joined), so a replacement that starts slowly on a busy machine still finds survivors to heal from
        step = manager.current_step()
        if step < args.steps:
            return True
        return bool(args.end_with) and voting < args.end_with and step < args.steps * 10

    try:
        while more():
            if args.notify_at and manager.current_step() == args.notify_at and not guard.leaving:
                from .notice import Notice  # noqa: PLC0415
                from .timefmt import utcnow  # noqa: PLC0415

                now = utcnow()  # a notice without a daemon (the GPU check): the same path as a daemon's
                guard.notify(Notice(id=f"notify-at-{args.notify_at}", source="drill", kind="preemption",
                                    deadline=now + timedelta(seconds=60), received_at=now))
            opt.zero_grad()  # starts the quorum; it runs while we "compute"
            if args.step_time > 0:
                time.sleep(args.step_time)
            x, y = (t.to(dev) for t in _batch(manager.current_step(), data_id, dim))
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
            flat = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
            if procs > 1:  # data parallel inside the group first (its own process group), then across groups
                torch.distributed.all_reduce(flat)
                flat /= procs
            manager.allreduce(flat).wait()
            off = 0
            for p in model.parameters():
                n = p.numel()
                p.grad.copy_(flat[off:off + n].view_as(p))
                off += n
            committed = opt.step()
            lr = optim.param_groups[0]["lr"]  # the rate this step used (a heal in should_commit loads the leader's)
            d = digest(model, optim)  # the state of the step (a group leaving inside step() exits with it)
            if committed:
                voting = manager.num_participants()
                sched.step()  # after step(): a whole-job leave's checkpoint must hold this (ReplicaGuard)
            log.info(STEP, step=manager.current_step(), committed=committed, t=round(time.time(), 4),
                     participants=manager.num_participants(), digest=d, lr=lr)
    except Preempted as exc:
        log.info("replica_exit", code=exc.code, step=exc.step, t=round(time.time(), 4), digest=digest(model, optim))
        sys.stdout.flush()
        os._exit(int(exc.code))  # torchft's threads: leave at once, the state lives on in the survivors
    log.info("replica_done", step=manager.current_step(), digest=digest(model, optim), t=round(time.time(), 4))
    try:
        guard.close()  # a whole-job leave at the last step writes its checkpoint here
    except Preempted as exc:
        log.info("replica_exit", code=exc.code, step=exc.step, t=round(time.time(), 4), digest=digest(model, optim))
        sys.stdout.flush()
        os._exit(int(exc.code))
    sys.stdout.flush()
    manager.shutdown(wait=False)
    os._exit(0)


# ------------------------------------------------------------------ launching


def lighthouse_binary() -> Optional[str]:
    """The ``torchft_lighthouse`` console script next to this interpreter, else on PATH."""
    here = Path(sys.executable).parent / "torchft_lighthouse"
    return str(here) if here.exists() else shutil.which("torchft_lighthouse")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Lighthouse:
    proc: subprocess.Popen[Any]
    addr: str

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def start_lighthouse(flags: list[str], log_path: Optional[Path] = None, timeout: float = 20.0) -> Lighthouse:
    """Start the Rust lighthouse on a free loopback port; returns once it accepts connections."""
    exe = lighthouse_binary()
    if exe is None:
        raise RuntimeError("torchft_lighthouse not found: install torchft-nightly (make test installs it)")
    port = _free_port()
    out = open(log_path, "ab") if log_path else subprocess.DEVNULL  # noqa: SIM115 - owned by the child
    proc = subprocess.Popen([exe, "--bind", f"127.0.0.1:{port}", *flags], stdout=out, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"torchft_lighthouse exited with code {proc.returncode}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return Lighthouse(proc, f"http://127.0.0.1:{port}")
        except OSError:
            time.sleep(0.02)  # waiting for a child to bind: nothing to await
    proc.kill()
    raise RuntimeError("torchft_lighthouse did not listen in time")


@dataclass
class Group:
    """One replica group's process and the JSON events it printed (read by a thread)."""

    name: str
    proc: subprocess.Popen[str]
    events: "queue.Queue[Optional[dict[str, Any]]]" = field(default_factory=queue.Queue)
    seen: list[dict[str, Any]] = field(default_factory=list)

    def wait_for(self, pred: Any, timeout: float) -> Optional[dict[str, Any]]:
        """The first event (from now on) that matches ``pred``; None at timeout or process end."""
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            try:
                ev = self.events.get(timeout=left)
            except queue.Empty:
                return None
            if ev is None:
                return None
            if pred(ev):
                return ev

    def steps(self) -> list[dict[str, Any]]:
        return [e for e in self.seen if e.get("event") == "replica_step" and e.get("committed")]

    def release(self) -> None:
        """Let a group started with ``hold=True`` join the lighthouse now (it has imported everything)."""
        assert self.proc.stdin is not None, "release() is for groups started with hold=True"
        self.proc.stdin.write("go\n")
        self.proc.stdin.flush()


def _reader(g: Group, log: Any) -> None:
    assert g.proc.stdout is not None
    for raw in iter(g.proc.stdout.readline, ""):
        if log is not None:
            log.write(raw)
            log.flush()
        brace = raw.find("{")
        if brace < 0:
            continue
        try:
            ev = json.loads(raw[brace:])
        except json.JSONDecodeError:
            continue
        if isinstance(ev, dict):
            ev["_seen"] = time.time()
            g.seen.append(ev)
            g.events.put(ev)
    g.events.put(None)


def start_group(name: str, lighthouse: str, socket_path: str, storage: str, *, steps: int,
                step_time: float, log_path: Optional[Path] = None, pg_timeout: float = 10.0,
                env: Optional[dict[str, str]] = None, hold: bool = False, end_with: int = 0,
                procs: int = 1) -> Group:
    """One replica group's process (``procs`` > 1: a ``torchrun`` of that many); with ``hold`` it imports and
    waits for ``Group.release()`` (a warm spare)."""
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(procs),
                "--max-restarts", "0", "-m"] if procs > 1 else [sys.executable, "-m"]
    cmd = [*launcher, "spotguard.ftreplica", "--replica-id", name, "--lighthouse", lighthouse,
           "--socket", socket_path, "--storage", storage, "--steps", str(steps), "--step-time", str(step_time),
           "--pg-timeout", str(pg_timeout), *(["--hold"] if hold else []),
           *(["--end-with", str(end_with)] if end_with else [])]
    e = {**os.environ, "PYTHONUNBUFFERED": "1", "GLOO_SOCKET_IFNAME": os.environ.get("GLOO_SOCKET_IFNAME", "lo"),
         "RUST_LOG": os.environ.get("RUST_LOG", "warn"), **(env or {})}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=e,
                            stdin=subprocess.PIPE if hold else subprocess.DEVNULL)
    g = Group(name, proc)
    log = open(log_path, "a") if log_path else None  # noqa: SIM115 - closed with the reader thread's end
    threading.Thread(target=_reader, args=(g, log), daemon=True, name=f"ftgroup-{name}").start()
    return g


def drill(socket_path: str, deadline_in: float = 30.0) -> str:
    """Ask one group's daemon for a synthetic preemption notice; returns its id."""
    from .daemon.client import request_sync  # noqa: PLC0415
    from .protocol import Drill, DrillOk  # noqa: PLC0415

    reply = request_sync(socket_path, Drill(kind="preemption", deadline_in=deadline_in), timeout=5.0)
    if not isinstance(reply, DrillOk):
        raise RuntimeError(f"drill refused on {socket_path}: {reply}")
    return reply.id


class ReplicaJob:
    """A lighthouse and replica groups, each with its own spotguard daemon on its own socket.

    Used as a context manager by the tests, the benchmark and the demo; stops
    everything it started at the end. A replacement group gets a fresh daemon
    (the old one would replay the notice its predecessor left for).
    """

    def __init__(self, work: Path, *, groups: int, step_time: float, steps: int,
                 lighthouse_flags: Optional[list[str]] = None, end_with: int = 0, procs: int = 1) -> None:
        from .hook.torchft import lighthouse_args  # noqa: PLC0415

        self.work = Path(work)
        self.step_time = step_time
        self.total = steps
        self.end_with = end_with  # groups go on past ``steps`` until a committed step had this many replicas
        self.procs = procs  # processes per group (torchrun when > 1)
        flags = lighthouse_args(groups=groups, step_seconds=step_time) if lighthouse_flags is None else lighthouse_flags
        self.lh: Lighthouse = start_lighthouse(flags, self.work / "lighthouse.log")
        self.daemons: dict[str, Any] = {}
        self.groups: dict[str, Group] = {}

    def __enter__(self) -> "ReplicaJob":
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def group(self, name: str, *, hold: bool = False) -> Group:
        """Start a group with its own daemon; ``hold=True``: a warm spare that joins at ``Group.release()``."""
        from .launch import start_daemon  # noqa: PLC0415

        sock = str(self.work / f"{name}.sock")
        self.daemons[name] = start_daemon(sock, log_path=self.work / f"{name}-daemon.log")
        g = start_group(name, self.lh.addr, sock, str(self.work / "ckpt"), steps=self.total,
                        step_time=self.step_time, log_path=self.work / f"{name}.log", hold=hold,
                        end_with=self.end_with, procs=self.procs)
        self.groups[name] = g
        return g

    def notice(self, name: str, deadline_in: float = 30.0) -> str:
        return drill(self.daemons[name].socket, deadline_in)

    def drop_daemon(self, name: str) -> None:
        d = self.daemons.pop(name, None)
        if d is not None:
            d.stop()

    def stop(self) -> None:
        for g in self.groups.values():
            if g.proc.poll() is None:
                g.proc.kill()
                g.proc.wait()
        for name in list(self.daemons):
            self.drop_daemon(name)
        self.lh.stop()


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m spotguard.ftreplica", description=__doc__.splitlines()[0])
    p.add_argument("--replica-id", required=True)
    p.add_argument("--lighthouse", required=True, help="http://host:port of torchft_lighthouse")
    p.add_argument("--socket", default=None, help="this group's spotguard daemon socket")
    p.add_argument("--storage", required=True, help="where the emergency checkpoint goes (all groups leave)")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--step-time", type=float, default=0.1, help="simulated compute per step, seconds")
    p.add_argument("--dim", type=int, default=32)
    p.add_argument("--pg-timeout", type=float, default=10.0, help="torchft collective timeout, seconds")
    p.add_argument("--end-with", type=int, default=0,
                   help="past --steps, go on until a committed step had this many replicas voting (at most 10x --steps)")
    p.add_argument("--device", default="cpu", help="cpu (torchft's Gloo group) or cuda (its NCCL group)")
    p.add_argument("--notify-at", type=int, default=0, help="hand the guard a notice itself at this step")
    p.add_argument("--hold", action="store_true",
                   help="import, print replica_ready, then wait for a line on stdin before joining")
    return worker(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
