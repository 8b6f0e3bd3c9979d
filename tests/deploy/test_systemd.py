"""systemd/spotguard.service and the trainer drop-in: `systemd-analyze verify` clean,
`systemd-analyze security --offline=yes` exposure <= 3.0, and the contract's directives.

verify runs offline against a throw-away root (--root) holding a copy of the
distribution's unit files, the units under test and stub executables, so no
running systemd (and no installed spotguard) is needed.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest

from .conftest import REPO, require_tool, run

UNIT = REPO / "systemd" / "spotguard.service"
DROPIN = REPO / "systemd" / "trainer-dropin.conf"
TRAINER = REPO / "systemd" / "trainer.service.example"
SYSUSERS = REPO / "systemd" / "spotguard.sysusers.conf"
ACTIONS_DROPIN = REPO / "systemd" / "spotguard-actions.conf"
MAX_EXPOSURE = 3.0


def parse_unit(path: Path) -> dict[str, list[tuple[str, str]]]:
    sections: dict[str, list[tuple[str, str]]] = {}
    current = None
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("[") and line.endswith("]"):
            current = line[1:-1]
            sections.setdefault(current, [])
            continue
        assert current is not None, f"{path}: key outside a section: {line}"
        key, sep, value = line.partition("=")
        assert sep, f"{path}: not KEY=VALUE: {line}"
        sections[current].append((key.strip(), value.strip()))
    return sections


def values(unit: dict[str, list[tuple[str, str]]], section: str, key: str) -> list[str]:
    return [v for k, v in unit.get(section, []) if k == key]


def one(unit: dict[str, list[tuple[str, str]]], section: str, key: str) -> str:
    vals = values(unit, section, key)
    assert vals, f"[{section}] {key}= missing"
    return vals[-1]


def env(unit: dict[str, list[tuple[str, str]]]) -> dict[str, str]:
    out = {}
    for v in values(unit, "Service", "Environment"):
        k, _, val = v.strip('"').partition("=")
        out[k] = val
    return out


def unit_socket(u: dict[str, list[tuple[str, str]]]) -> str:
    argv = one(u, "Service", "ExecStart").split()
    if "--socket" in argv:
        return argv[argv.index("--socket") + 1]
    return env(u).get("SPOTGUARD_SOCKET", "/run/spotguard/spotguard.sock")


def _system_unit_dir() -> Path:
    for d in ("/usr/lib/systemd/system", "/lib/systemd/system"):
        if (Path(d) / "multi-user.target").exists():
            return Path(d)
    pytest.skip("no distribution unit files (multi-user.target) to verify against: install the `systemd` package")


def _stub(root: Path, exec_start: str) -> None:
    exe = root / exec_start.split()[0].lstrip("@-:+!").lstrip("/")
    exe.parent.mkdir(parents=True, exist_ok=True)
    exe.write_text("#!/bin/sh\nexit 0\n")
    exe.chmod(0o755)


@pytest.fixture
def offline_root(tmp_path: Path) -> Path:
    """A root with the distro's units, spotguard.service, an example trainer and its drop-in."""
    root = tmp_path / "root"
    lib = root / "usr/lib/systemd/system"
    shutil.copytree(_system_unit_dir(), lib, symlinks=True)
    etc = root / "etc/systemd/system"
    (etc / "trainer.service.d").mkdir(parents=True)
    shutil.copy(UNIT, etc / "spotguard.service")
    shutil.copy(TRAINER, etc / "trainer.service")
    shutil.copy(DROPIN, etc / "trainer.service.d" / "spotguard.conf")
    _stub(root, one(parse_unit(UNIT), "Service", "ExecStart"))
    _stub(root, one(parse_unit(TRAINER), "Service", "ExecStart"))
    return root


def _verify(root: Path) -> str:
    sa = require_tool("systemd-analyze")
    proc = run([sa, "verify", f"--root={root}", "spotguard.service", "trainer.service"], check=False, timeout=60)
    return (proc.stdout + proc.stderr).strip() + ("" if proc.returncode == 0 else f"\n(exit {proc.returncode})")


def test_verify_clean(offline_root: Path) -> None:
    out = _verify(offline_root)
    assert out == "", "systemd-analyze verify is not clean:\n" + out


def test_verify_is_really_verifying(offline_root: Path) -> None:
    """Guard: a bad key in the drop-in must be reported, so an empty output means something."""
    conf = offline_root / "etc/systemd/system/trainer.service.d/spotguard.conf"
    conf.write_text(conf.read_text() + "\nNoSuchDirective=1\n")
    assert "NoSuchDirective" in _verify(offline_root)


def test_actions_dropin_verifies_and_lifts_the_address_deny(offline_root: Path) -> None:
    """Issue 24: IPAddressDeny=any blocks the Auto Scaling API, webhooks and the Kubernetes API; the
    opt-in drop-in resets it, and `systemd-analyze verify` reads it (a bad key in it is reported)."""
    d = parse_unit(ACTIONS_DROPIN)
    assert values(d, "Service", "IPAddressDeny") == [""], "an empty assignment resets the unit's deny list"
    assert values(parse_unit(UNIT), "Service", "IPAddressDeny") == ["any"], "the base unit stays closed"
    conf = offline_root / "etc/systemd/system/spotguard.service.d/actions.conf"
    conf.parent.mkdir(parents=True)
    shutil.copy(ACTIONS_DROPIN, conf)
    out = _verify(offline_root)
    assert out == "", "systemd-analyze verify is not clean with the actions drop-in:\n" + out
    conf.write_text(conf.read_text() + "\nNoSuchDirective=1\n")
    assert "NoSuchDirective" in _verify(offline_root)
    assert "spotguard-actions.conf" in (REPO / "docs" / "deploy.md").read_text()


def exposure() -> float:
    sa = require_tool("systemd-analyze")
    proc = run([sa, "security", "--offline=yes", "--no-pager", str(UNIT)], check=False, timeout=60)
    m = re.search(r"Overall exposure level for spotguard\.service:\s*([0-9.]+)", proc.stdout)
    assert m, proc.stdout + proc.stderr
    return float(m.group(1))


def test_security_exposure() -> None:
    score = exposure()
    print(f"systemd-analyze security --offline=yes: exposure {score}")
    assert score <= MAX_EXPOSURE, f"exposure {score} > {MAX_EXPOSURE}"
    # The same bound through systemd's own threshold check (exit status).
    sa = require_tool("systemd-analyze")
    proc = run([sa, "security", "--offline=yes", f"--threshold={int(MAX_EXPOSURE * 10)}", str(UNIT)], check=False)
    assert proc.returncode == 0, proc.stdout[-2000:]


def test_unit_contract() -> None:
    u = parse_unit(UNIT)
    assert one(u, "Service", "Type") == "notify"
    assert float(re.sub(r"s$", "", one(u, "Service", "WatchdogSec"))) > 0
    assert one(u, "Service", "RuntimeDirectory") == "spotguard"
    assert one(u, "Service", "RuntimeDirectoryMode") in ("0750", "0770", "750", "770")
    assert one(u, "Service", "Restart") in ("on-failure", "always", "on-abnormal")
    exec_start = one(u, "Service", "ExecStart").split()
    assert exec_start[0].endswith("/spotguard") and exec_start[1] == "daemon"
    e = env(u)
    assert unit_socket(u).startswith("/run/spotguard/")
    # Settings live in Environment= so that drop-ins can override them (flags would win).
    assert "--cloud" not in exec_start and "--socket" not in exec_start
    assert e["SPOTGUARD_CLOUD"] == "auto"
    # Not root; the socket group is the unit's group.
    assert one(u, "Service", "User") not in ("root", "0")
    group = one(u, "Service", "Group")
    assert e.get("SPOTGUARD_SOCKET_GROUP", group) == group
    # SIGTERM is a clean stop (<= 2 s), not a notice: a restart never stops training. With
    # SPOTGUARD_SIGTERM_NOTICE the daemon waits for the grace, so systemd must wait longer.
    stop = float(re.sub(r"s$", "", one(u, "Service", "TimeoutStopSec")))
    if e.get("SPOTGUARD_SIGTERM_NOTICE", "0") in ("1", "true", "yes", "on"):
        assert stop > float(e.get("SPOTGUARD_SIGTERM_GRACE", "25"))
    else:
        assert 2 < stop <= 30
    # Network: metadata over IP, socket over AF_UNIX; nothing exotic.
    families = set(one(u, "Service", "RestrictAddressFamilies").split())
    assert families == {"AF_UNIX", "AF_INET", "AF_INET6"}
    allow = " ".join(values(u, "Service", "IPAddressAllow"))
    assert "link-local" in allow and "localhost" in allow
    assert one(u, "Service", "NoNewPrivileges") == "yes"
    assert one(u, "Service", "CapabilityBoundingSet") == ""
    assert "multi-user.target" in one(u, "Install", "WantedBy")
    assert "network.target" in one(u, "Unit", "After")


def test_dropin_orders_trainer_after_daemon() -> None:
    u, d = parse_unit(UNIT), parse_unit(DROPIN)
    after = " ".join(values(d, "Unit", "After")).split()
    wants = " ".join(values(d, "Unit", "Wants") + values(d, "Unit", "Requires")).split()
    assert "spotguard.service" in after, "trainer must start after (and so stop before) spotguard"
    assert "spotguard.service" in wants
    de = env(d)
    assert de["SPOTGUARD_SOCKET"] == unit_socket(u)
    assert "SPOTGUARD_STORAGE" in de
    assert one(d, "Service", "SupplementaryGroups") == one(u, "Service", "Group")
    # Termination ordering: ExecStop waits for the active notice's checkpoint, then SIGTERM; the
    # hook's SIGTERM grace fits both the stop timeout and torchrun's 30 s; GCP/Azure VMs are gone
    # ~30 s after the soft-off, so the stop timeout is not longer than that.
    stop_timeout = float(re.sub(r"s$", "", one(d, "Service", "TimeoutStopSec")))
    assert 25 <= stop_timeout <= 30
    exec_stop = one(d, "Service", "ExecStop").split()
    assert exec_stop[0].endswith("/spotguard") and exec_stop[1] == "wait-checkpoint"
    assert float(exec_stop[exec_stop.index("--timeout") + 1]) < stop_timeout
    assert 0 < float(de["SPOTGUARD_SIGNAL_GRACE"]) <= min(30, stop_timeout)


def test_sysusers_creates_the_unit_user() -> None:
    u = parse_unit(UNIT)
    entries = [l.split() for l in SYSUSERS.read_text().splitlines() if l.strip() and not l.startswith("#")]
    assert ["u", one(u, "Service", "User")] == entries[0][:2]
