"""Cloud name → configured watchers: the one place the daemon builds them from options."""

from __future__ import annotations

from typing import Optional

from .aws import AwsWatcher
from .azure import AzureWatcher
from .base import Watcher
from .gcp import GcpWatcher

__all__ = ["build_watchers", "CLOUDS"]

CLOUDS: tuple[str, ...] = ("aws", "gcp", "azure", "none")


def build_watchers(cloud: str, metadata_url: Optional[str], poll_interval: Optional[float], *,
                   azure_vm_name: Optional[str] = None) -> list[Watcher]:
    """``metadata_url`` replaces each cloud's link-local base (the watcher appends the
    standard paths); ``poll_interval`` None keeps each cloud's default (AWS 0.5 s,
    Azure 1 s). GCP does not poll: it uses hanging GETs, so it ignores the interval."""
    if poll_interval is not None and poll_interval <= 0:
        raise ValueError(f"poll interval must be positive, got {poll_interval}")
    base = metadata_url.rstrip("/") if metadata_url else None
    if cloud == "none":
        return []
    if cloud == "aws":
        return [
            AwsWatcher(
                base_url=base or "http://169.254.169.254",
                poll_interval=poll_interval if poll_interval is not None else 0.5,
            )
        ]
    if cloud == "gcp":
        return [GcpWatcher(base_url=base or "http://metadata.google.internal")]
    if cloud == "azure":
        return [
            AzureWatcher(
                base_url=base or "http://169.254.169.254",
                poll_interval=poll_interval if poll_interval is not None else 1.0,
                vm_name=azure_vm_name or None,
            )
        ]
    raise ValueError(f"unknown cloud {cloud!r} (one of {', '.join(CLOUDS)})")
