"""One rank of a 2-process gloo job that saves or loads a DDP model + Adam through a storage URI.

Run as a script (``python _dcp_worker.py MODE URI RANK WORLD PORT OUTDIR``) so that
tests can SIGKILL it mid-upload. ``save`` trains 3 steps, saves with the storage's
DCP writer, rank 0 commits, and dumps what it saved to OUTDIR/expect-<rank>.pt;
``load`` builds a differently-initialised model, loads the newest committed
checkpoint and dumps what it loaded to OUTDIR/got-<rank>.pt.
Same order as the hook: rank 0 prepare_attempt, barrier, dcp.save, barrier, commit.
"""

from __future__ import annotations

import os
import sys
import time

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from spotguard.storage import open_storage
from spotguard.hook.dist import gather_writes
from spotguard.storage.commit import CommitRecord, commit, newest_committed, prepare_attempt
from spotguard.storage.safeload import SafeLoadPlanner

DIM = int(os.environ.get("SG_TEST_DIM", "1024"))


def build(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(DIM, DIM), torch.nn.ReLU(), torch.nn.Linear(DIM, 8))
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    return ddp, torch.optim.Adam(ddp.parameters(), lr=1e-3)


def flat(model: torch.nn.Module, opt: torch.optim.Optimizer, rank_state: torch.Tensor) -> dict[str, torch.Tensor]:
    msd, osd = get_state_dict(model, opt)
    out = {f"model.{k}": v.detach().clone() for k, v in msd.items()}
    for pk, st in osd["state"].items():
        for name, v in st.items():
            out[f"optim.{pk}.{name}"] = torch.as_tensor(v).detach().clone()
    out["rank_state"] = rank_state.clone()
    return out


def main() -> int:
    mode, uri, rank, world, port, outdir = sys.argv[1:7]
    rank_i, world_i = int(rank), int(world)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank_i, world_size=world_i)
    storage = open_storage(uri)
    if mode == "save":
        model, opt = build(0)
        torch.manual_seed(100 + rank_i)
        for _ in range(3):
            x = torch.randn(16, DIM)
            model(x).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
        rank_state = torch.randn(1000) + rank_i  # per-rank state under a rank-unique key
        msd, osd = get_state_dict(model, opt)
        state = {"model": msd, "optim": osd, f"rank{rank_i}": rank_state}
        step = int(os.environ.get("SG_TEST_STEP", "3"))
        if rank_i == 0:
            prepare_attempt(storage, step)
        dist.barrier()
        t0 = time.monotonic()
        deadline = os.environ.get("SG_TEST_DEADLINE")
        if deadline:
            storage.deadline = time.monotonic() + float(deadline)
        ok = True
        try:
            dcp.save(state, storage_writer=storage.dcp_writer(f"step-{step:08d}"))
        except Exception as exc:  # noqa: BLE001
            print(f"rank {rank_i}: save failed: {type(exc).__name__}: {exc}", file=sys.stderr)
            ok = False
        storage.deadline = None
        flag = torch.tensor([0 if ok else 1])
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if int(flag[0]):
            dist.destroy_process_group()
            return 3
        # the record names what every rank reports writing (the hook's gather)
        written = gather_writes(dist.group.WORLD, storage.write_log.take(f"step-{step:08d}"))
        if rank_i == 0:
            commit(storage, step, CommitRecord(step=step, world_size=world_i, reason="manual",
                                               seconds=round(time.monotonic() - t0, 3)), written)
        dist.barrier()
        torch.save(flat(model, opt, rank_state), os.path.join(outdir, f"expect-{rank_i}.pt"))
    else:
        model, opt = build(1234)
        # one step so Adam has state tensors to load into
        model(torch.randn(2, DIM)).sum().backward()
        opt.step()
        opt.zero_grad()
        info = newest_committed(storage)
        assert info is not None, "no committed checkpoint"
        msd, osd = get_state_dict(model, opt)
        rank_state = torch.zeros(1000)
        state = {"model": msd, "optim": osd, f"rank{rank_i}": rank_state}
        assert info.record is not None and info.record.checksums, "commit record without checksums"
        dcp.load(state, storage_reader=storage.dcp_reader(info.dir, info.record.checksums), planner=SafeLoadPlanner())
        set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
        torch.save(flat(model, opt, rank_state), os.path.join(outdir, f"got-{rank_i}.pt"))
        dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
