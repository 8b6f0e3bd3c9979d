"""``--cloud auto``: which cloud is this VM on?

DMI first (local files, no network, no waiting), then, only when DMI says
nothing, short concurrent probes of the three metadata endpoints, each with the
header its cloud requires. The probes all go to the link-local address (GCP
answers there too), so no DNS lookup of ``metadata.google.internal`` can stall
start-up off-cloud.
"""

from __future__ import annotations

import asyncio
import os
from typing import Optional

import aiohttp

from ...logs import get_logger

__all__ = ["detect_cloud", "detect_cloud_sync", "detect_from_dmi", "probe_metadata", "AZURE_ASSET_TAG"]


log = get_logger("spotguard.watchers.detect")

# Every Azure VM carries this chassis asset tag (ASCII "MSFT AZURE VM"; cloud-init
# matches the same value); plain Hyper-V does not.
AZURE_ASSET_TAG = "7783-7084-3265-9085-8269-3286-77"
LINK_LOCAL = "http://169.254.169.254"
_DMI_FILES = (
    "sys_vendor",
    "product_name",
    "bios_vendor",
    "bios_version",
    "board_vendor",
    "chassis_asset_tag",
    "chassis_vendor",
)
# When several endpoints answer (an emulator speaks all three), prefer in this order.
_PREFERENCE = ("aws", "gcp", "azure")


def _read(root: str, name: str) -> str:
    try:
        with open(os.path.join(root, name), encoding="utf-8", errors="replace") as fh:
            return fh.read().strip()
    except OSError:
        return ""


def detect_from_dmi(dmi_root: str = "/sys/class/dmi/id") -> Optional[str]:
    """``aws``/``gcp``/``azure`` from DMI strings, or None when they say nothing."""
    dmi = {name: _read(dmi_root, name) for name in _DMI_FILES}
    vendors = " ".join(dmi[n] for n in ("sys_vendor", "bios_vendor", "board_vendor", "chassis_vendor")).lower()
    product = dmi["product_name"].lower()
    if (
        "amazon" in vendors
        or "amazon ec2" in dmi["chassis_asset_tag"].lower()
        or "amazon" in dmi["bios_version"].lower()
    ):
        return "aws"
    if "google" in vendors or "google compute engine" in product:
        return "gcp"
    if dmi["chassis_asset_tag"] == AZURE_ASSET_TAG and "microsoft" in vendors:
        return "azure"
    return None


async def _status(
    session: aiohttp.ClientSession, method: str, url: str, headers: dict[str, str], timeout: float
) -> Optional[int]:
    """The answer's status, or None when nothing answered in time."""
    try:
        async with session.request(method, url, headers=headers, timeout=aiohttp.ClientTimeout(total=timeout)) as r:
            return r.status
    except (aiohttp.ClientError, asyncio.TimeoutError, OSError, ValueError):
        return None


async def _probe_one(session: aiohttp.ClientSession, cloud: str, base: str, timeout: float) -> Optional[str]:
    if cloud == "aws":
        # Token PUT and a tokenless GET at once: behind a hop limit of 1 the PUT times
        # out, but the GET still answers (200 with IMDSv1, 401 without): both say "EC2".
        put, get = await asyncio.gather(
            _status(
                session, "PUT", base + "/latest/api/token", {"X-aws-ec2-metadata-token-ttl-seconds": "60"}, timeout
            ),
            _status(session, "GET", base + "/latest/dynamic/instance-identity/document", {}, timeout),
        )
        return cloud if put == 200 or get in (200, 401) else None
    if cloud == "gcp":
        status = await _status(
            session, "GET", base + "/computeMetadata/v1/instance/id", {"Metadata-Flavor": "Google"}, timeout
        )
    else:
        status = await _status(
            session, "GET", base + "/metadata/instance/compute?api-version=2021-02-01", {"Metadata": "true"}, timeout
        )
    return cloud if status == 200 else None


async def probe_metadata(base_url: Optional[str] = None, timeout: float = 0.5) -> list[str]:
    """Clouds whose metadata endpoint answered, in preference order."""
    base = (base_url or LINK_LOCAL).rstrip("/")
    async with aiohttp.ClientSession(trust_env=False) as session:
        found = await asyncio.gather(*(_probe_one(session, c, base, timeout) for c in _PREFERENCE))
    return [c for c in _PREFERENCE if c in found]


async def detect_cloud(
    dmi_root: str = "/sys/class/dmi/id", probe_base_url: Optional[str] = None, timeout: float = 0.5
) -> str:
    """``aws``, ``gcp``, ``azure`` or ``none``: DMI, then metadata probes bounded by ``timeout``."""
    cloud = detect_from_dmi(dmi_root)
    if cloud is not None:
        log.info("cloud_detected", cloud=cloud, by="dmi")
        return cloud
    try:
        answered = await asyncio.wait_for(probe_metadata(probe_base_url, timeout), timeout=timeout + 0.5)
    except asyncio.TimeoutError:
        answered = []
    if not answered:
        log.info("cloud_detected", cloud="none", by="probe")
        return "none"
    if len(answered) > 1:
        log.warning("cloud_ambiguous", answered=answered, chosen=answered[0], fix="pass --cloud explicitly")
    log.info("cloud_detected", cloud=answered[0], by="probe")
    return answered[0]


def detect_cloud_sync(
    dmi_root: str = "/sys/class/dmi/id", probe_base_url: Optional[str] = None, timeout: float = 0.5
) -> str:
    """For callers without a running event loop."""
    return asyncio.run(detect_cloud(dmi_root, probe_base_url, timeout))
