"""One real torchft replica group (torchft's Manager, gloo, a lighthouse process) training with LocalSGD or
DiLoCo under a ``ReplicaGuard``, for ``test_local_sync_refused.py``. In the test's process (a process of its
own spent ~25 s importing torch and torchft on the loaded 2-core machine; the Manager and its Rust server are the
real ones either way). ``run()`` returns ``refused`` (the class named by the refusal, or None), the inner steps
taken, the manager's step and the syncs that reached the manager's own ``should_commit``."""

from __future__ import annotations

from datetime import timedelta

import torch
from torch.distributed import TCPStore
from torchft import Manager, ProcessGroupGloo
from torchft.local_sgd import DiLoCo, LocalSGD

from spotguard.torchft.engine import ReplicaGuard, UnsupportedLoop


def run(lighthouse: str, kind: str, storage: str, sock: str, steps: int) -> dict[str, object]:
    """Build the group, train ``steps`` inner steps (or until refused), shut it down; what happened."""
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 1)
    inner = torch.optim.AdamW(model.parameters(), lr=0.05)
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    manager = Manager(pg=ProcessGroupGloo(timeout=timedelta(seconds=10)), load_state_dict=None, state_dict=None,
                      min_replica_size=1, rank=0, world_size=1, store_addr="127.0.0.1", store_port=store.port,
                      lighthouse_addr=lighthouse, replica_id=f"ls-{kind}", hostname="127.0.0.1",
                      use_async_quorum=kind != "DiLoCo", timeout=timedelta(seconds=10),
                      quorum_timeout=timedelta(seconds=30), connect_timeout=timedelta(seconds=10))
    syncs = 0
    real = manager.should_commit

    def counted(*a: object, **k: object) -> bool:
        nonlocal syncs
        syncs += 1
        return bool(real(*a, **k))

    manager.should_commit = counted  # type: ignore[method-assign]  # beneath the guard's gate
    guard = ReplicaGuard(manager, {"model": model, "opt": inner}, storage, socket=sock)
    algo = (LocalSGD(manager, model, inner, sync_every=2) if kind == "LocalSGD" else
            DiLoCo(manager, [model], inner, torch.optim.SGD(model.parameters(), lr=0.7), sync_every=2))
    taken, refused = 0, None
    try:
        with algo:
            for _ in range(steps):
                inner.zero_grad()
                torch.nn.functional.mse_loss(model(torch.randn(16, 8)), torch.randn(16, 1)).backward()
                inner.step()
                taken += 1
    except UnsupportedLoop as exc:
        refused = exc.what
    finally:
        guard._done.set()
        guard.close()
        result = {"refused": refused, "taken": taken, "manager_step": manager.current_step(), "syncs": syncs}
        manager.shutdown(wait=True)
    return result
