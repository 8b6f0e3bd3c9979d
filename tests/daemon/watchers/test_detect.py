"""Cloud detection (DMI, then probes) and the watcher registry."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from spotguard.daemon.watchers.aws import AwsWatcher
from spotguard.daemon.watchers.azure import AzureWatcher
from spotguard.daemon.watchers.detect import AZURE_ASSET_TAG, detect_cloud, detect_from_dmi, probe_metadata
from spotguard.daemon.watchers.gcp import GcpWatcher
from spotguard.daemon.watchers.registry import build_watchers
from spotguard.emulator.server import Emulator


def dmi(tmp_path: Path, **files: str) -> str:
    for name, value in files.items():
        (tmp_path / name).write_text(value + "\n")
    return str(tmp_path)


@pytest.mark.parametrize(
    "files,cloud",
    [
        ({"sys_vendor": "Amazon EC2", "product_name": "p4d.24xlarge", "bios_vendor": "Amazon EC2"}, "aws"),
        ({"sys_vendor": "Xen", "bios_version": "4.11.amazon"}, "aws"),  # older Xen instance types
        ({"sys_vendor": "Google", "product_name": "Google Compute Engine", "bios_vendor": "Google"}, "gcp"),
        (
            {
                "sys_vendor": "Microsoft Corporation",
                "product_name": "Virtual Machine",
                "chassis_asset_tag": AZURE_ASSET_TAG,
            },
            "azure",
        ),
        (  # the literal tag of a real Azure VM, not only the module's constant
            {"sys_vendor": "Microsoft Corporation", "chassis_asset_tag": "7783-7084-3265-9085-8269-3286-77"},
            "azure",
        ),
        (
            {"sys_vendor": "Microsoft Corporation", "product_name": "Virtual Machine", "chassis_asset_tag": "None"},
            None,
        ),  # Hyper-V
        ({"sys_vendor": "QEMU", "product_name": "Standard PC (Q35 + ICH9, 2009)"}, None),
        ({}, None),
    ],
)
def test_detect_from_dmi(tmp_path: Path, files: dict[str, str], cloud: str | None) -> None:
    assert detect_from_dmi(dmi(tmp_path, **files)) == cloud


@pytest.mark.parametrize("cloud", ["aws", "gcp", "azure"])
async def test_dmi_wins_without_network(tmp_path: Path, cloud: str, closed_port_url: str) -> None:
    files = {
        "aws": {"sys_vendor": "Amazon EC2"},
        "gcp": {"product_name": "Google Compute Engine"},
        "azure": {"sys_vendor": "Microsoft Corporation", "chassis_asset_tag": AZURE_ASSET_TAG},
    }[cloud]
    assert await detect_cloud(dmi(tmp_path, **files), probe_base_url=closed_port_url) == cloud


@pytest.mark.serial
async def test_none_when_dmi_is_silent_and_nothing_answers(tmp_path: Path, closed_port_url: str) -> None:
    t0 = time.monotonic()
    assert await detect_cloud(dmi(tmp_path, sys_vendor="QEMU"), probe_base_url=closed_port_url, timeout=0.3) == "none"
    assert time.monotonic() - t0 < 1.0


async def test_probes_with_the_right_headers(emu: Emulator, tmp_path: Path) -> None:
    # The emulator speaks all three (and 403/400s without the right headers).
    assert await probe_metadata(emu.url, timeout=1.0) == ["aws", "gcp", "azure"]
    assert await detect_cloud(str(tmp_path), probe_base_url=emu.url, timeout=1.0) == "aws"
    emu.fault("status", cloud="aws", status=404)
    assert await detect_cloud(str(tmp_path), probe_base_url=emu.url, timeout=1.0) == "gcp"
    emu.fault("status", cloud="gcp", status=404)
    assert await detect_cloud(str(tmp_path), probe_base_url=emu.url, timeout=1.0) == "azure"


async def test_probe_finds_aws_when_token_put_hangs_but_v1_answers(emu: Emulator, tmp_path: Path) -> None:
    emu.configure(aws_token_put_hang=True)
    emu.fault("status", cloud="gcp", status=404)
    emu.fault("status", cloud="azure", status=404)
    # The tokenless GET answers 401: still EC2.
    assert await detect_cloud(str(tmp_path), probe_base_url=emu.url, timeout=0.3) == "aws"


def test_registry_builds_one_watcher_per_cloud() -> None:
    assert build_watchers("none", None, None) == []
    (a,) = build_watchers("aws", "http://127.0.0.1:8999/", 0.25)
    assert isinstance(a, AwsWatcher) and a.base_url == "http://127.0.0.1:8999" and a.poll_interval == 0.25
    (a,) = build_watchers("aws", None, None)
    assert isinstance(a, AwsWatcher) and a.base_url == "http://169.254.169.254" and a.poll_interval == 0.5
    (g,) = build_watchers("gcp", "http://127.0.0.1:8999", 3.0)
    assert isinstance(g, GcpWatcher) and g.base_url == "http://127.0.0.1:8999"
    (g,) = build_watchers("gcp", None, None)
    assert isinstance(g, GcpWatcher) and g.base_url == "http://metadata.google.internal"
    (z,) = build_watchers("azure", "http://127.0.0.1:8999", None)
    assert isinstance(z, AzureWatcher) and z.base_url == "http://127.0.0.1:8999" and z.poll_interval == 1.0
    with pytest.raises(ValueError):
        build_watchers("alibaba", None, None)
    with pytest.raises(ValueError):
        build_watchers("aws", None, 0)
