"""What the example scripts share: leaving the process group cleanly at the end of a run."""

from __future__ import annotations


def leave_process_group() -> None:
    """Leave together and destroy the process group the framework created (HF Trainer and Lightning do not).

    With gloo on torch 2.13 a process that exits with its group alive, or tears
    down while its peer still holds the connection, occasionally aborts (SIGABRT)
    in a gloo thread during interpreter shutdown — seen in the uninterrupted
    reference runs of the tests.
    """
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
