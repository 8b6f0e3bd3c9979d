"""One real torchft replica group (the worker that tests, demo and benchmark launch through ``launch.py``).

``python -m spotguard.torchft.worker --replica-id g0 --lighthouse http://127.0.0.1:P
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
import socket
import sys
import time
from datetime import timedelta
from typing import Any, Optional

__all__ = ["LR", "lr_factor", "digest", "worker", "main"]


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

    from ..hook.core import Preempted  # noqa: PLC0415
    from ..logs import configure_logging, get_logger  # noqa: PLC0415
    from .engine import STEP, ReplicaGuard  # noqa: PLC0415

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
                from ..notice import Notice  # noqa: PLC0415
                from ..timefmt import utcnow  # noqa: PLC0415

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


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m spotguard.torchft.worker", description=__doc__.splitlines()[0])
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
