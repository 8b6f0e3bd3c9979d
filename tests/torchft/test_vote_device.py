"""The leave vote travels on the device of torchft's process group (issue 25).

torchft's ``ProcessGroupNCCL`` registers only a CUDA backend: a CPU vote tensor made every
all-reduce fail and ``should_commit`` return False at every step of a GPU job. The classes
are torchft's own; constructing one touches no device.
"""

from __future__ import annotations

import pytest

process_group = pytest.importorskip("torchft.process_group")

from spotguard.torchft.engine import vote_device  # noqa: E402


@pytest.mark.parametrize("cls,device", [("ProcessGroupGloo", "cpu"), ("ProcessGroupBabyGloo", "cpu"),
                                        ("ProcessGroupNCCL", "cuda"), ("ProcessGroupBabyNCCL", "cuda")])
def test_the_vote_follows_the_process_group(cls: str, device: str) -> None:
    pg_cls = getattr(process_group, cls)
    pg = pg_cls.__new__(pg_cls)  # the type is what decides; no backend is configured
    assert vote_device(pg).type == device


def test_without_a_known_group_the_vote_stays_on_the_cpu() -> None:
    assert vote_device(None).type == "cpu"


@pytest.mark.parametrize("wrapper", ["ErrorSwallowingProcessGroupWrapper", "FakeProcessGroupWrapper"])
def test_a_wrapped_nccl_group_still_votes_on_cuda(wrapper: str) -> None:
    """torchft's wrappers keep the real group in ``_pg``: their own class name names no backend."""
    nccl = process_group.ProcessGroupNCCL.__new__(process_group.ProcessGroupNCCL)
    assert vote_device(getattr(process_group, wrapper)(nccl)).type == "cuda"
    gloo = process_group.ProcessGroupGloo.__new__(process_group.ProcessGroupGloo)
    assert vote_device(getattr(process_group, wrapper)(gloo)).type == "cpu"
