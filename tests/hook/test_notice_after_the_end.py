"""A notice that arrives after the loop is over (``destroy_process_group()`` or ``hook.close()`` came first)
says so: ``notice_after_last_step``. The long oracle run found one 65 ms after the last step of a 2-rank
job that left no line at all — a finished run without a commit and without a why."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

import pytest
import structlog
import torch
import torch.distributed as dist
import torch.nn.functional as F

from spotguard.hook import Hook, events
from spotguard.notice import Notice
from spotguard.timefmt import utcnow


def _notice() -> Notice:
    now = utcnow()
    return Notice(id="late-1", source="drill", kind="termination", deadline=now + timedelta(seconds=30),
                  received_at=now)


def _train(h: Hook, model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    h.resume()
    for _ in range(3):
        opt.zero_grad()
        F.mse_loss(model(torch.randn(4, 3)), torch.zeros(4, 1)).backward()
        opt.step()


@pytest.mark.parametrize("end", ["close", "destroy_process_group"])
def test_a_notice_after_the_end_of_training_is_named(tmp_path: Path, end: str) -> None:
    if end == "destroy_process_group":
        dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rdzv'}", rank=0, world_size=1)
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    h = Hook({"model": model, "optimizer": opt}, str(tmp_path / "ckpt"), signals=False, intake=False)
    try:
        _train(h, model, opt)
        if end == "close":
            h.close()
        else:
            dist.destroy_process_group()
        with structlog.testing.capture_logs() as logs:
            h.notify(_notice())
        after = [e for e in logs if e.get("event") == events.NOTICE_AFTER_LAST_STEP]
        assert len(after) == 1 and after[0]["notice_id"] == "late-1" and after[0]["step"] == 3, logs
    finally:
        h.close()
        if dist.is_initialized():
            dist.destroy_process_group()
