"""``examples/torchrun_train.py``'s model and data in a loop with slow phases, for notices at any moment.

Each iteration: [load] next(loader) -> [fwd] forward -> [bwd] backward -> opt.step() [step: inside it]
-> sched.step() -> [after]. ``--phases load,fwd,bwd,step,after`` gives each phase a duration (seconds of
sleep; ``step`` runs inside ``optimizer.step`` through a pre-hook registered after spotguard's), so a
notice can be sent at a chosen phase: ``--notice-at ITER:PHASE`` makes rank ``--notice-rank`` send itself
SIGUSR1 at the start of that phase of iteration ITER (0-based). Outside optimizer steps: ``--accum N``
micro-batches per step (DDP ``no_sync`` for all but the last; ``micro:K`` as PHASE = at micro-batch K),
``--eval-after ITER:SECONDS`` an evaluation (eval mode, no optimizer step, a final all-reduce) after
iteration ITER (PHASE ``eval``), ``--stall-before ITER:SECONDS`` a loader stall (PHASE ``stall``),
``--warmup SECONDS`` before the first step (PHASE ``warmup``, ITER ignored). The math never depends on
the sleeps, so an interrupted and resumed run must end bitwise equal to ``--no-hook``.

``--notice-timer ITER:SECONDS`` sends it that long after iteration ITER starts (a random phase).
``--phases-from ITER`` keeps the earlier iterations fast (``--micro-time`` too), ``--phases-until ITER`` the
later ones. Rank 0 prints ``{"step": i, "loss": l, "t": wall-clock}`` after each iteration.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import random
import signal
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

HERE = Path(__file__).resolve().parent


def _example() -> Any:
    spec = importlib.util.spec_from_file_location("_sg_example", HERE.parents[1] / "examples" / "torchrun_train.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _pair(raw: str | None) -> tuple[int, float] | None:
    if not raw:
        return None
    a, b = raw.split(":")
    return int(a), float(b)


class SwapEMA:
    """torch_ema's ExponentialMovingAverage in miniature: shadow weights, swapped in through ``param.data``."""

    def __init__(self, params: list[torch.nn.Parameter], decay: float = 0.9) -> None:
        self.params, self.decay = params, decay
        self.shadow = [p.detach().clone() for p in params]
        self.backup: list[torch.Tensor] = []

    @torch.no_grad()
    def update(self) -> None:
        for s, p in zip(self.shadow, self.params):
            s.mul_(self.decay).add_(p.detach(), alpha=1 - self.decay)

    def store(self) -> None:
        self.backup = [p.data.clone() for p in self.params]

    def copy_to(self) -> None:
        for s, p in zip(self.shadow, self.params):
            p.data.copy_(s)

    def restore(self) -> None:
        for b, p in zip(self.backup, self.params):
            p.data.copy_(b)
        self.backup = []

    def state_dict(self) -> dict[str, Any]:
        return {"shadow": [s.clone() for s in self.shadow]}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        for s, v in zip(self.shadow, sd["shadow"]):
            s.copy_(v)


def _slow_first_save(root: str, delay: float) -> Any:
    """A local store whose first checkpoint write from the agreement thread takes ``delay`` s per item."""
    import threading  # noqa: PLC0415

    sys.path.insert(0, str(HERE))
    from _slowstore import _SlowWriter  # noqa: PLC0415

    from spotguard.storage.local import LocalStorage  # noqa: PLC0415

    class SlowFirst(LocalStorage):
        slowed = False

        def dcp_writer(self, key: str, *, thread_count: int | None = None) -> Any:
            if self.slowed or threading.current_thread().name != "spotguard-agreement":
                return super().dcp_writer(key, thread_count=thread_count)
            self.slowed = True
            self._mkdirs(self._path(key))
            w = _SlowWriter(self, key, single_file_per_rank=True, sync_files=True, thread_count=1, overwrite=True)
            w.delay = delay
            return w

    return SlowFirst(root)


class Broken:
    """A user's stateful object whose ``state_dict()`` raises."""

    def state_dict(self) -> dict[str, Any]:
        raise RuntimeError("metrics backend unavailable (test)")

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        pass


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--storage", default=None)
    p.add_argument("--out", default=None)
    p.add_argument("--no-hook", action="store_true")
    p.add_argument("--phases", default="0,0,0,0,0", help="load,fwd,bwd,step,after seconds")
    p.add_argument("--phases-from", type=int, default=0, help="iterations before this one run without sleeps")
    p.add_argument("--phases-until", type=int, default=None,
                   help="iterations from this one on run without sleeps again (default: none; what comes after "
                        "the iterations a test looks at need not cost its wall time)")
    p.add_argument("--notice-at", default=None, help="ITER:PHASE")
    p.add_argument("--notice-rank", type=int, default=0)
    p.add_argument("--notice-kind", default="signal", help="signal (SIGUSR1) or rebalance (hook.notify)")
    p.add_argument("--notice-timer", default=None, help="ITER:SECONDS: SIGUSR1 that long after ITER starts")
    p.add_argument("--accum", type=int, default=1)
    p.add_argument("--micro-time", type=float, default=0.0)
    p.add_argument("--eval-after", default=None, help="ITER:SECONDS")
    p.add_argument("--stall-before", default=None, help="ITER:SECONDS")
    p.add_argument("--warmup", type=float, default=0.0)
    p.add_argument("--raise-in-eval", type=float, default=-1.0, help="every rank raises this long into the eval")
    p.add_argument("--raise-in-bwd", type=float, default=-1.0,
                   help="every rank raises this long into the bwd phase of the iterations from --phases-from")
    p.add_argument("--ema-swap-eval", action="store_true",
                   help="an EMA (torch_ema style, in the dict) updated after sched.step() and swapped into the "
                        "model through param.data for the --eval-after evaluation")
    p.add_argument("--raising-state", action="store_true", help="a stateful object whose state_dict() raises")
    p.add_argument("--far-notice", action="store_true",
                   help="at --notice-at, notice-rank first gets a 300 s maintenance notice, then a 6 s preemption")
    p.add_argument("--slow-first-save", type=float, default=0.0,
                   help="the first background save writes this many seconds per item (a slow upload)")
    p.add_argument("--then-signal", type=float, default=-1.0,
                   help="with --notice-kind rebalance: SIGUSR1 this long after the rebalance notice")
    p.add_argument("--on-exit-dir", default=None, help="hook.on_exit writes <dir>/exit-<rank>.json")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--optim", default="sgd")
    args = p.parse_args()
    phases = [float(x) for x in args.phases.split(",")]
    load_t = fwd_t = bwd_t = after_t = 0.0
    eval_after, stall_before = _pair(args.eval_after), _pair(args.stall_before)
    notice_iter, notice_phase = (None, None)
    if args.notice_at:
        it, notice_phase = args.notice_at.split(":", 1)
        notice_iter = int(it)

    ex = _example()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.set_num_threads(1)
    ns = argparse.Namespace(seed=args.seed, hidden=args.hidden, optim=args.optim)
    net, opt, _ = ex.build(ns, rank)
    # lr changes at the scheduler step right after optimizer step 3: a checkpoint of step 3 must hold the new lr
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
    model = DDP(net)
    loader = ex.SyntheticLoader(args.seed, rank)
    torch.manual_seed(args.seed + 1 + rank)
    random.seed(args.seed + rank)
    np.random.seed(args.seed + rank)

    def notice(i: int | None, phase: str) -> None:
        if rank == args.notice_rank and phase == notice_phase and (i == notice_iter or phase == "warmup"):
            print(json.dumps({"notice_sent": phase, "iter": i, "t": time.time(), "rank": rank}), flush=True)
            if args.far_notice:
                from datetime import timedelta  # noqa: PLC0415

                from spotguard.notice import Notice  # noqa: PLC0415
                from spotguard.timefmt import utcnow  # noqa: PLC0415

                now = utcnow()
                hook.notify(Notice(id=f"maint-{i}", source="drill", kind="maintenance",
                                   deadline=now + timedelta(seconds=300), received_at=now))
                time.sleep(0.5)  # the round for it is in its agreement (its peer never joins)
                now = utcnow()
                hook.notify(Notice(id=f"preempt-{i}", source="drill", kind="preemption",
                                   deadline=now + timedelta(seconds=6), received_at=now))
            elif args.notice_kind == "rebalance":
                from datetime import timedelta  # noqa: PLC0415

                from spotguard.notice import Notice  # noqa: PLC0415
                from spotguard.timefmt import utcnow  # noqa: PLC0415

                now = utcnow()
                hook.notify(Notice(id=f"rebalance-{i}", source="drill", kind="rebalance",
                                   deadline=now + timedelta(seconds=60), received_at=now))
                if args.then_signal >= 0:
                    import threading  # noqa: PLC0415

                    threading.Timer(args.then_signal, os.kill, args=(os.getpid(), signal.SIGUSR1)).start()
            else:
                os.kill(os.getpid(), signal.SIGUSR1)

    ema = SwapEMA(list(net.parameters()))
    start = 0
    hook: Any = None
    if not args.no_hook:
        from spotguard import install_preemption_hook

        objs: dict[str, Any] = {"model": model, "optimizer": opt, "scheduler": sched, "loader": loader}
        if args.ema_swap_eval:
            objs["ema"] = ema
        if args.raising_state:
            objs["broken"] = Broken()
        storage: Any = args.storage
        if args.slow_first_save > 0:
            storage = _slow_first_save(args.storage, args.slow_first_save)
        hook = install_preemption_hook(objs, storage=storage)
        if args.on_exit_dir:
            @hook.on_exit
            def record(code: int, committed: bool) -> None:
                Path(args.on_exit_dir, f"exit-{rank}.json").write_text(json.dumps({"code": code,
                                                                                  "committed": committed}))
        start = hook.resume()
    state: dict[str, Any] = {"i": start, "step_t": 0.0}
    if any(phases) or args.notice_at:
        def inside_step(optimizer: Any, a: Any, k: Any) -> None:  # registered after spotguard's: inside the step
            notice(state["i"], "step")
            if state["step_t"] > 0:
                time.sleep(state["step_t"])
        opt.register_step_pre_hook(inside_step)

    if args.warmup > 0:
        notice(None, "warmup")
        time.sleep(args.warmup)
    model.train()
    for i in range(start, args.steps):
        state["i"] = i
        if args.notice_timer and rank == args.notice_rank and int(args.notice_timer.split(":")[0]) == i:
            import threading  # noqa: PLC0415

            delay = float(args.notice_timer.split(":")[1])

            def fire() -> None:
                print(json.dumps({"notice_sent": "timer", "iter": i, "t": time.time(), "rank": rank}), flush=True)
                os.kill(os.getpid(), signal.SIGUSR1)

            threading.Timer(delay, fire).start()
        slow = i >= args.phases_from and (args.phases_until is None or i < args.phases_until)
        load_t, fwd_t, bwd_t, state["step_t"], after_t = phases if slow else (0.0,) * 5
        if stall_before is not None and stall_before[0] == i:
            notice(i, "stall")
            time.sleep(stall_before[1])
        notice(i, "load")
        time.sleep(load_t)
        opt.zero_grad(set_to_none=True)
        total = 0.0
        for m in range(args.accum):
            x, y = next(loader)
            if m == 0:
                notice(i, "fwd")
            notice(i, f"micro:{m}")
            ctx = model.no_sync() if m < args.accum - 1 else contextlib.nullcontext()
            with ctx:
                noise = 1.0 + 0.01 * (random.random() + float(np.random.rand()))
                out = model(x) * noise
                if m == 0:
                    time.sleep(fwd_t)
                loss = F.mse_loss(out, y) / args.accum
                if m == 0:
                    notice(i, "bwd")
                loss.backward()
                if m == 0:
                    if args.raise_in_bwd >= 0 and i >= args.phases_from:
                        time.sleep(args.raise_in_bwd)
                        raise RuntimeError("a collective of the user's failed (test)")
                    time.sleep(bwd_t)
            total += float(loss.item())
            if args.micro_time > 0 and slow:
                time.sleep(args.micro_time)
        opt.step()
        sched.step()
        ema.update()
        notice(i, "after")
        if rank == 0:
            print(json.dumps({"step": i, "loss": round(total, 6), "t": time.time()}), flush=True)
        time.sleep(after_t)
        if eval_after is not None and eval_after[0] == i:
            notice(i, "eval")
            model.eval()
            if args.ema_swap_eval:
                ema.store()
                ema.copy_to()
            end = time.monotonic() + eval_after[1]
            g = torch.Generator().manual_seed(99)
            acc = torch.zeros(1)
            with torch.no_grad():
                while time.monotonic() < end:
                    acc += F.mse_loss(net(torch.randn(8, 32, generator=g)), torch.zeros(8, 1))
                    time.sleep(0.05)
                    if 0 <= args.raise_in_eval < eval_after[1] - (end - time.monotonic()):
                        raise RuntimeError("a collective of the user's failed (test)")
            dist.all_reduce(acc)
            if args.ema_swap_eval:
                ema.restore()
            model.train()

    if args.out and rank == 0:
        torch.save({"model": net.state_dict(), "optimizer": opt.state_dict(), "scheduler": sched.state_dict(),
                    "steps": args.steps}, args.out)
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
