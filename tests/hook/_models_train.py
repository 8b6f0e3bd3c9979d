"""Model set-ups the API reference says work (``docs/api.md`` "Works with"), for ``torchrun --nproc-per-node 2``.

``--variant two-opts`` (two models, two optimizers, GAN-style), ``compile`` (``torch.compile`` under DDP),
``fsdp2`` (``fully_shard`` on a CPU device mesh), ``scaler`` (DDP + ``torch.amp.GradScaler``, whose scale
starts so high that it overflows and skips ``optimizer.step()`` now and then: the hook's clock is then
``scaler.update()``; lines carry the scale), ``ddp`` (plain DDP; ``--frozen-mib`` adds a large frozen
table to its state). ``--phase pre`` first runs the uninterrupted reference
loop without spotguard (``{"ref": step, "hex": loss}`` lines), then the same loop with the hook and a
notice handed to every rank at step ``--notify-at`` (exits 143); ``--phase resume`` resumes and runs to
``--steps`` (``{"step": step, "hex": loss}``). Rank 0 prints.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP


def build(variant: str, frozen_mib: int = 0) -> tuple[dict[str, Any], Callable[[torch.Tensor], torch.Tensor]]:
    torch.manual_seed(0)
    if variant == "two-opts":
        gen, disc = torch.nn.Linear(8, 8), torch.nn.Linear(8, 1)
        g, d = DDP(gen), DDP(disc)
        opt_d = torch.optim.Adam(disc.parameters(), lr=1e-2)
        opt_g = torch.optim.SGD(gen.parameters(), lr=0.05, momentum=0.9)

        def step(x: torch.Tensor) -> torch.Tensor:
            opt_d.zero_grad()
            d(g(x).detach()).pow(2).mean().backward()
            opt_d.step()
            opt_g.zero_grad()
            loss = (d(g(x)) - 1).pow(2).mean()
            loss.backward()
            opt_g.step()
            return loss

        return {"gen": g, "disc": d, "opt_d": opt_d, "opt_g": opt_g}, step
    net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    if frozen_mib:  # a large replicated state: a frozen table (in the model's state, never trained)
        net.register_parameter("table", torch.nn.Parameter(torch.randn(frozen_mib * 2**18), requires_grad=False))
    if variant == "compile":
        model: Any = DDP(torch.compile(net, backend="eager"))
    elif variant in ("scaler", "ddp"):
        model = DDP(net)
    elif variant == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        for layer in (net[0], net[2]):
            fully_shard(layer, mesh=mesh)
        model = fully_shard(net, mesh=mesh)
    else:
        raise SystemExit(f"unknown variant {variant}")
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)

    if variant == "scaler":
        # at 2**120 the large batches (steps 1, 5, 9: see batch()) overflow float32, so their optimizer.step() is
        # skipped and the scale halves; it grows back after 3 good steps (at 4 and 8) - on both ranks alike
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**120, growth_interval=3)

        def step2(x: torch.Tensor) -> torch.Tensor:
            opt.zero_grad()
            loss = model(x).pow(2).mean()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            sched.step()
            return loss

        return {"model": model, "optimizer": opt, "scheduler": sched, "scaler": scaler}, step2

    def step1(x: torch.Tensor) -> torch.Tensor:
        opt.zero_grad()
        loss = model(x).pow(2).mean()
        loss.backward()
        opt.step()
        sched.step()
        return loss

    return {"model": model, "optimizer": opt, "scheduler": sched}, step1


def extra(state: dict[str, Any]) -> dict[str, Any]:
    """The scale after the step, where there is a scaler (a skipped step halves it)."""
    sc = state.get("scaler")
    return {"scale": sc.get_scale()} if sc is not None else {}


def batch(step: int, variant: str = "") -> torch.Tensor:
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(step * 2 + dist.get_rank()))
    return x * 100 if variant == "scaler" and step % 4 == 1 else x  # a large batch: gradients overflow


def slow_store(root: str, seconds: float, fail: bool = False) -> Any:
    """A local store whose whole-file writes of DCP data files (``write_bytes``: what a survivor uploads for a
    doomed rank, and its own file once the save is handed to it) take ``seconds`` each: a link slower than
    the doomed rank's deadline."""
    from spotguard.storage.local import LocalStorage

    class Slow(LocalStorage):
        def write_bytes(self, key: str, data: bytes) -> None:
            if key.endswith(".distcp"):
                time.sleep(seconds)  # the simulated upload time, not a synchronisation
                if fail:  # the link broke during the upload: nothing of this file is in storage
                    raise OSError(f"injected upload failure: {key}")
            super().write_bytes(key, data)

    return Slow(root)


class _Tee:
    """stderr (where the hook's JSON lines go), also touching ``marker`` once this rank logs
    ``checkpoint_handed_over``: what ``--survivor-waits`` waits for."""

    def __init__(self, inner: Any, marker: str) -> None:
        self.inner, self.marker = inner, marker

    def write(self, text: str) -> int:
        n = self.inner.write(text)
        if '"checkpoint_handed_over"' in text:
            self.inner.flush()
            open(self.marker, "w").close()
        return n

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def waiting_store(root: str, marker: str) -> Any:
    """A local store whose DCP writer's local plan (``prepare_local_plan``: before this rank's write and the
    save's gathers) first waits, at most ``HANDOVER_WAIT_S``, for ``marker`` (a doomed rank handed its save
    over): it prints whether that came before this rank's part of ``dcp.save`` began."""
    from spotguard.storage.local import LocalStorage

    class Waiting(LocalStorage):
        def dcp_writer(self, key: str, **kw: Any) -> Any:
            writer = super().dcp_writer(key, **kw)
            orig = writer.prepare_local_plan

            def prepare_local_plan(plan: Any) -> Any:
                t0 = time.monotonic()
                while not os.path.exists(marker) and time.monotonic() - t0 < HANDOVER_WAIT_S:
                    time.sleep(0.02)  # polling a file another process creates: nothing to await
                print(json.dumps({"survivor_write": dist.get_rank(), "handover_before_write": os.path.exists(marker),
                                  "waited": round(time.monotonic() - t0, 3)}), flush=True)
                return orig(plan)

            writer.prepare_local_plan = prepare_local_plan
            return writer

    return Waiting(root)


HANDOVER_WAIT_S = 20.0


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--variant", required=True)
    p.add_argument("--phase", choices=("pre", "resume"), required=True)
    p.add_argument("--storage", required=True)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--notify-at", type=int, default=4)
    p.add_argument("--notify-rank", type=lambda v: [int(x) for x in v.split(",")], default=[-1],
                   help="hand the notice to these ranks only, comma-separated (-1: every rank)")
    p.add_argument("--notice-seconds", type=float, default=30.0, help="the notice's deadline, from when it is handed")
    p.add_argument("--slow-upload", type=float, default=0.0,
                   help="seconds each whole-file upload of a data file takes (a survivor's, a slow link)")
    p.add_argument("--fail-upload", action="store_true", help="each slow whole-file data upload then fails")
    p.add_argument("--frozen-mib", type=int, default=0, help="a frozen replicated table of this size in the model")
    p.add_argument("--survivor-waits", action="store_true",
                   help="ranks without the notice start their DCP data write only once a doomed rank handed over")
    p.add_argument("--also", default="", help="RANK,KIND,SECONDS[,AFTER]: a second notice to that rank, right after (or AFTER s)")
    p.add_argument("--rank-env", default="", help="RANK:NAME=VALUE: that env var set on that rank only (a node "
                   "whose environment differs from the others')")
    args = p.parse_args()
    if args.rank_env and args.rank_env.split(":", 1)[0] == os.environ.get("RANK"):
        name, _, value = args.rank_env.split(":", 1)[1].partition("=")
        os.environ[name] = value
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    rank = dist.get_rank()

    def out(**kw: Any) -> None:
        if rank == 0:
            print(json.dumps(kw), flush=True)

    if args.phase == "pre":
        ref_state, step = build(args.variant, args.frozen_mib)
        for i in range(args.steps):
            out(ref=i, hex=step(batch(i, args.variant)).item().hex(), **extra(ref_state))
        del ref_state

    from spotguard import install_preemption_hook
    from spotguard.notice import Notice
    from spotguard.timefmt import utcnow

    state, step = build(args.variant, args.frozen_mib)
    marker = f"{args.storage}.handed-over"
    if args.survivor_waits:
        sys.stderr = _Tee(sys.stderr, marker)  # before the hook configures its log stream
    store: Any = args.storage
    if args.slow_upload:
        store = slow_store(args.storage, args.slow_upload, args.fail_upload)
    elif args.survivor_waits and args.phase == "pre" and rank not in args.notify_rank:
        store = waiting_store(args.storage, marker)
    hook = install_preemption_hook(state, storage=store)
    start = hook.resume()
    for i in range(start, args.steps):
        if args.phase == "pre" and i == args.notify_at:
            if -1 in args.notify_rank or rank in args.notify_rank:
                now = utcnow()
                hook.notify(Notice(id="drill-models", source="drill", kind="preemption",
                                   deadline=now + timedelta(seconds=args.notice_seconds), received_at=now))
            if args.also:
                # the first notices are in every rank's hook before the second one starts a round (a rank that
                # reached this step late would otherwise join a round its own notice missed)
                dist.barrier()
            if args.also and int(args.also.split(",")[0]) == rank:
                _, kind, secs, *later = args.also.split(",")

                def also() -> None:
                    now = utcnow()
                    hook.notify(Notice(id="drill-also", source="drill", kind=kind,
                                       deadline=now + timedelta(seconds=float(secs)), received_at=now))

                threading.Timer(float(later[0]), also).start() if later else also()  # later: during the save
            time.sleep(0.5)  # the ranks agree off the training thread in ms: a deterministic stop step
        out(step=i, hex=step(batch(i, args.variant)).item().hex(), **extra(state))
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
