"""Footprint (issue 24): the memory peak must not come at the notice. The ASG action built its boto3
client (the Auto Scaling service model and endpoint data, ~11 MB) at the notice, when the container is
closest to its memory limit; it now loads them in ``start()``. Checked on botocore's loader cache
rather than by timing or RSS (figures: ``python -m benchmarks.footprint``, docs/performance.md)."""

from __future__ import annotations

import pytest

boto3 = pytest.importorskip("boto3", reason="boto3 missing: `make storage-tools`")

from spotguard.daemon.actions.asg import AsgLifecycleAction  # noqa: E402


def _autoscaling_model_loaded() -> bool:
    loader = boto3.DEFAULT_SESSION._session.get_component("data_loader") if boto3.DEFAULT_SESSION else None
    return loader is not None and any("autoscaling" in str(k) for k in getattr(loader, "_cache", {}))


async def test_asg_action_loads_the_autoscaling_model_at_start(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(boto3, "DEFAULT_SESSION", None)  # a fresh default session: nothing cached yet
    monkeypatch.delenv("AWS_REGION", raising=False)
    monkeypatch.delenv("AWS_DEFAULT_REGION", raising=False)  # no region known before the identity document
    assert not _autoscaling_model_loaded()
    action = AsgLifecycleAction(None)
    await action.start()
    try:
        assert _autoscaling_model_loaded(), "the Auto Scaling model would be loaded at the notice"
    finally:
        await action.close()
