"""What the metadata emulator's state is made of: its configuration, one ``NoticeRecord`` per scheduled
notice, one ``Fault`` per injected failure, and the clouds' fixed vocabularies. Plain data, no event loop:
``state.py`` (``EmulatorState``) owns the live collections of them."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Optional

from ..timefmt import to_rfc3339

__all__ = ["EmulatorConfig", "Fault", "NoticeRecord", "ControlError", "CLOUDS", "KINDS", "FAULT_MODES",
           "cloud_of_path", "AWS_SPOT_ACTIONS", "AWS_EVENT_CODES", "AWS_CODE_DESCRIPTIONS", "AZURE_EVENT_TYPES",
           "AZURE_MIN_NOTICE", "DEFAULT_IN_SECONDS"]

CLOUDS: tuple[str, ...] = ("aws", "gcp", "azure")
KINDS: tuple[str, ...] = ("preemption", "rebalance", "maintenance", "termination")
FAULT_MODES: tuple[str, ...] = ("status", "hang", "slow", "malformed", "content_type", "reset")

AWS_SPOT_ACTIONS: tuple[str, ...] = ("terminate", "stop", "hibernate")
AWS_EVENT_CODES: tuple[str, ...] = (
    "system-reboot",
    "instance-reboot",
    "system-maintenance",
    "instance-retirement",
    "instance-stop",
)
AWS_CODE_DESCRIPTIONS: dict[str, str] = {
    "system-reboot": "scheduled reboot",
    "instance-reboot": "scheduled reboot",
    "system-maintenance": "scheduled maintenance",
    "instance-retirement": "The instance is running on degraded hardware",
    "instance-stop": "The instance is running on degraded hardware",
}
AZURE_EVENT_TYPES: tuple[str, ...] = ("Reboot", "Redeploy", "Freeze", "Preempt", "Terminate")
AZURE_MIN_NOTICE: dict[str, float] = {
    "Preempt": 30.0,
    "Terminate": 300.0,
    "Reboot": 900.0,
    "Freeze": 900.0,
    "Redeploy": 600.0,
}
# Default notice length per (cloud, kind) when the control call gives no in_seconds.
DEFAULT_IN_SECONDS: dict[tuple[str, str], float] = {
    ("aws", "preemption"): 120.0,
    ("aws", "rebalance"): 120.0,
    ("aws", "maintenance"): 3600.0,
    ("aws", "termination"): 120.0,
    ("gcp", "preemption"): 30.0,
    ("gcp", "maintenance"): 60.0,
    ("gcp", "termination"): 60.0,
}


class ControlError(ValueError):
    """A bad control-API request: becomes a 400 with the message."""


def cloud_of_path(path: str) -> Optional[str]:
    """Which cloud a request path belongs to (``None`` for control and unknown paths)."""
    if path.startswith("/latest/") or path == "/latest":
        return "aws"
    if path.startswith("/computeMetadata/"):
        return "gcp"
    if path.startswith("/metadata/"):
        return "azure"
    return None


@dataclass
class EmulatorConfig:
    """Switches for faithful failure behaviour; settable at start and via ``POST /_emulator/config``."""

    azure_vm_name: str = "vm-0"
    aws_token_put_hang: bool = False
    aws_imdsv1: bool = False
    aws_token_max_ttl: Optional[float] = None
    aws_recompute_time: bool = False
    # Seconds a spot notice is preceded by a rebalance recommendation (0 = off), as
    # amazon-ec2-metadata-mock and AWS Fault Injection Service do.
    aws_rebalance_lead: float = 0.0
    aws_disabled: bool = False
    gcp_ignore_wait: bool = False
    asg: bool = False
    azure_rate_limit: int = 5
    azure_iso_dates: bool = False  # NotBefore in ISO 8601 instead of the documented RFC 1123

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def update(self, values: dict[str, Any]) -> None:
        """Apply a partial update, type-checked so a typo in a test fails loudly."""
        fields = {f.name: f for f in dataclasses.fields(self)}
        for key, value in values.items():
            if key not in fields:
                raise ControlError(f"unknown config key {key!r} (known: {', '.join(sorted(fields))})")
            if key == "azure_vm_name":
                if not isinstance(value, str) or not value:
                    raise ControlError("azure_vm_name must be a non-empty string")
            elif key == "aws_token_max_ttl":
                if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0):
                    raise ControlError("aws_token_max_ttl must be a positive number or null")
            elif key == "aws_rebalance_lead":
                if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
                    raise ControlError("aws_rebalance_lead must be a number of seconds >= 0 (0 = off)")
            elif key == "azure_rate_limit":
                if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                    raise ControlError("azure_rate_limit must be an integer >= 0 (0 = off)")
            elif not isinstance(value, bool):
                raise ControlError(f"{key} must be a boolean")
        for key, value in values.items():
            setattr(self, key, value)


@dataclass
class NoticeRecord:
    """One scheduled notice; ``status`` is active|canceled|completed|started."""

    id: str
    cloud: str
    kind: str
    created: datetime
    deadline: datetime
    status: str = "active"
    action: str = ""  # AWS spot action
    code: str = ""  # AWS scheduled-event code
    description: str = ""
    event_type: str = ""  # Azure
    resources: list[str] = field(default_factory=list)  # Azure
    event_source: str = "Platform"  # Azure
    duration: int = -1  # Azure DurationInSeconds
    visible_from: Optional[datetime] = None  # AWS spot preceded by a rebalance: served from then on

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "id": self.id,
            "cloud": self.cloud,
            "kind": self.kind,
            "created": to_rfc3339(self.created),
            "deadline": to_rfc3339(self.deadline),
            "status": self.status,
        }
        for name in ("action", "code", "description", "event_type"):
            if getattr(self, name):
                out[name] = getattr(self, name)
        if self.cloud == "azure":
            out["resources"] = list(self.resources)
        return out


@dataclass
class Fault:
    """An injected failure; ``remaining`` None = until cleared."""

    id: str
    cloud: str
    mode: str
    path: str = ""
    status: int = 503
    delay: float = 2.0
    retry_after: Optional[int] = None
    remaining: Optional[int] = None
    hits: int = 0

    def matches(self, cloud: Optional[str], path: str) -> bool:
        if self.remaining is not None and self.remaining <= 0:
            return False
        if self.cloud != "*" and self.cloud != cloud:
            return False
        return path.startswith(self.path) if self.path else True

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)
