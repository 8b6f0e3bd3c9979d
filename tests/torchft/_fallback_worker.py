"""One torchft replica group (a fake manager: one process, its SUM all-reduce the identity) for the deadline
fallback tests. Modes (argv[1]):

- ``stall``: after the notice no step commits any more (the other groups left and ``min_replica_size`` is 2, or
  the quorum stalls): the loop keeps iterating with uncommitted steps until the fallback writes.
- ``posteval``: right after the last step that commits, the loop runs an evaluation (eval mode, no_grad) of
  ``EVAL`` seconds; the notice comes at its start; later steps never commit.
- ``allleave``: the single group leaves (the whole job): the write is deferred to the next training forward,
  and the loop runs the same long evaluation first. With ``GROUPS=n`` it is one of n groups that all leave at the
  same step (the others' votes mirror this one's), ``REPLICA_RANK`` its rank in the quorum (0 writes), ``CKPT``
  the storage the groups share.
- ``slowstep``: the notice comes right before a step that commits, and that optimizer step is still running when
  the fallback fires (a slow optimizer, or work between ``opt.step()`` and ``after_step()``): the fallback is
  deferred, then the group leaves normally (``Preempted``); the process lingers past the deadline (cleanup).
- ``commitrace``: the notice comes right before a step that commits, and the fallback fires after
  ``should_commit()`` counted the step but before the optimizer stepped (torchft increments its step inside
  ``should_commit``): the state is still that of the previous step.
- ``sigterm``: ``stall`` whose notice is far off (``DEADLINE``), then two iterations later a SIGTERM (its
  deadline ``SPOTGUARD_SIGNAL_GRACE`` away: a node drain's grace period) — the nearer deadline must count.
- ``sgdstall``: ``stall`` with plain SGD (an optimizer without state): between each forward and its backward
  (gradients None) the loop waits until the fallback's save is over or touched the parameters (DCP's fake
  ``step()`` on a stateless optimizer would bump their version under the training thread's autograd graph).

Under ``torchrun`` (``WORLD_SIZE`` > 1) the processes are one replica group of several (gloo, the same data on
every rank); ``NOTICE_RANK`` then names the one rank that gets the notice (the node that is reclaimed).

Per committed step it appends to ``digests.jsonl`` a digest of model/optimizer/scheduler state after the loop's
post-step work, and the torch RNG state right after the optimizer step. Exit codes are the hook's; 3 = the loop
ran out of time without leaving (the old behaviour: nothing written, the VM dies).
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time
from datetime import timedelta
from typing import Any

import torch

from spotguard.hook.core import Preempted
from spotguard.notice import Notice
from spotguard.timefmt import utcnow
from spotguard.torchft.engine import ReplicaGuard


class _Work:
    def wait(self) -> None:
        pass


class Manager:
    _pg = None

    def __init__(self) -> None:
        self.step = 0
        self.stalled = False
        self.after_count: Any = None  # commitrace: called inside should_commit once the step is counted
        self.voters = 2  # another group takes part (its vote: not leaving) unless "allleave"
        self.mirror = False  # the other groups vote as this one (GROUPS)

    def current_step(self) -> int:
        return self.step

    def num_participants(self) -> int:
        return self.voters

    def participating_rank(self) -> int:
        return int(os.environ.get("REPLICA_RANK", "0"))

    def allreduce(self, t: Any, reduce_op: Any = None) -> _Work:
        if self.mirror:
            t *= self.voters  # GROUPS=n: n groups noticed at the same step, each voting as this one
        elif self.voters == 2:
            t[1] += 1  # the other group: participating, not leaving
        return _Work()

    def start_quorum(self) -> None:
        pass

    def should_commit(self) -> bool:
        if self.stalled:
            time.sleep(0.05)
            return False
        self.step += 1
        if self.after_count is not None:
            self.after_count()
        return True

    def shutdown(self, wait: bool = True) -> None:
        pass

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.step = sd["step"]


def build(ckpt: str, sock: str, sgd: bool = False, **kw: Any) -> tuple[Any, Any, Any, Manager, ReplicaGuard]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16), torch.nn.Dropout(0.3),
                                torch.nn.Linear(16, 1))
    opt = (torch.optim.SGD(model.parameters(), lr=0.05) if sgd else
           torch.optim.AdamW(model.parameters(), lr=0.05))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.9 ** s)
    mgr = Manager()
    guard = ReplicaGuard(mgr, {"model": model, "opt": opt, "sched": sched}, ckpt, socket=sock, **kw)
    return model, opt, sched, mgr, guard


def digest(model: Any, opt: Any, sched: Any) -> str:
    h = hashlib.sha256()
    for k, v in sorted(model.state_dict().items()):
        h.update(k.encode())
        h.update(v.detach().contiguous().numpy().tobytes())
    for st in opt.state_dict()["state"].values():
        for k, v in sorted(st.items()):
            h.update(k.encode())
            h.update((v if torch.is_tensor(v) else torch.tensor(v)).detach().contiguous().numpy().tobytes())
    h.update(repr(sched.state_dict()["last_epoch"]).encode())
    h.update(repr(opt.param_groups[0]["lr"]).encode())
    return h.hexdigest()


def notify(guard: ReplicaGuard, deadline_s: float) -> None:
    now = utcnow()
    guard.notify(Notice(id="n-fallback", source="drill", kind="preemption",
                        deadline=now + timedelta(seconds=deadline_s), received_at=now))
    guard.hook._flush_intake()


def main() -> None:
    from spotguard.logs import configure_logging  # noqa: PLC0415

    configure_logging("json", "info", stream=sys.stdout)
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        import torch.distributed as dist  # noqa: PLC0415

        dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    noticed = os.environ.get("NOTICE_RANK", os.environ.get("RANK", "0")) == os.environ.get("RANK", "0")
    mode, workdir = sys.argv[1], sys.argv[2]
    deadline_s = float(os.environ.get("DEADLINE", "4"))
    eval_s = float(os.environ.get("EVAL", "0"))
    notice_at = int(os.environ.get("NOTICE_AT", "5"))
    model, opt, sched, mgr, guard = build(os.environ.get("CKPT") or os.path.join(workdir, "ckpt"),
                                          os.path.join(workdir, "none.sock"),
                                          sgd=mode == "sgdstall",
                                          **({"every": float(os.environ["EVERY"]), "keep": 2}
                                             if os.environ.get("EVERY") else {}))
    if mode == "allleave":
        mgr.voters = int(os.environ.get("GROUPS", "1"))
        mgr.mirror = mgr.voters > 1
    if os.environ.get("FAIL_WRITE"):  # the storage fails under the emergency write (a full disk, a lost bucket)
        def fail(key: str, snap: Any) -> None:
            raise OSError(28, "No space left on device")
        guard.hook._write = fail  # type: ignore[method-assign]
    g = guard.optimizer(opt)
    out = open(os.path.join(workdir, "digests.jsonl"), "a")
    x = torch.randn(32, 8)
    y = torch.randn(32, 1)
    slow = [False]
    if mode == "slowstep":
        def in_step(*_: Any) -> None:  # after the update, still inside opt.step(): wait for the deferred fallback
            t_wait = time.monotonic() + 20
            while slow[0] and guard._pending is None and time.monotonic() < t_wait:
                time.sleep(0.01)
        opt.register_step_post_hook(in_step)
    t_end = time.monotonic() + 30
    i = 0
    while time.monotonic() < t_end:
        g.zero_grad()
        model.train()
        loss = torch.nn.functional.mse_loss(model(x), y)
        if mode == "sgdstall" and i > notice_at and guard._over.wait(deadline_s):  # gradients None: fallback
            p0 = next(model.parameters())
            v0, t_wait = p0._version, time.monotonic() + 10
            while p0._version == v0 and not guard.hook._life.exit_requested and time.monotonic() < t_wait:
                time.sleep(0.01)
        loss.backward()
        if i == notice_at and mode == "allleave" and mgr.mirror:  # the groups take their notice together
            print(json.dumps({"event": "worker_ready"}), flush=True)
            sys.stdin.readline()
        if i == notice_at and mode != "posteval":
            if noticed:
                notify(guard, deadline_s)
            if mode in ("stall", "sgdstall", "sigterm"):
                mgr.stalled = True
            slow[0] = mode == "slowstep"
            if mode == "commitrace":
                mgr.after_count = lambda: guard._over.wait(20)  # the watchdog writes in this window
        if mode == "sigterm" and i == notice_at + 2:
            import signal  # noqa: PLC0415

            os.kill(os.getpid(), signal.SIGTERM)
        rng_after_step = None
        try:
            committed = g.step()
        except Preempted as p:
            if mode == "slowstep":
                print(json.dumps({"event": "worker_left", "code": p.code}), flush=True)
                time.sleep(deadline_s + 1)  # cleanup (a W&B upload, a launcher) outlasting the deadline
            raise
        if committed:
            rng_after_step = torch.get_rng_state()
        sched.step() if committed else None
        if committed:
            out.write(json.dumps({"step": mgr.step, "digest": digest(model, opt, sched),
                                  "rng": hashlib.sha256(rng_after_step.numpy().tobytes()).hexdigest()}) + "\n")
            out.flush()
            if mode in ("posteval", "allleave") and i == notice_at:
                mgr.stalled = True
                if mode == "posteval":
                    notify(guard, deadline_s)  # during the evaluation after the last step that commits
                model.eval()
                with torch.no_grad():
                    t_eval = time.monotonic() + eval_s
                    while time.monotonic() < t_eval:
                        model(x)
                        time.sleep(0.05)
        i += 1
    print("never left", flush=True)
    sys.exit(3)


if __name__ == "__main__":
    main()
