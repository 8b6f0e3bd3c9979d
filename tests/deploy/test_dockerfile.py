"""The Dockerfile: hadolint clean, daemon-only, non-root, healthcheck; its install step replayed.

There is no Docker engine here, so the build stage's install RUN is replayed
into a clean virtualenv, from the same files the Dockerfile COPYs.
"""

from __future__ import annotations

import json
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from .conftest import REPO, require_tool, run

DOCKERFILE = REPO / "Dockerfile"


def instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs, continuation lines joined, comments dropped."""
    out: list[tuple[str, str]] = []
    buf = ""
    for line in text.splitlines():
        s = line.strip()
        if not buf and (not s or s.startswith("#")):
            continue
        if s.startswith("#"):
            continue
        if s.endswith("\\"):
            buf += s[:-1] + " "
            continue
        buf += s
        word, _, rest = buf.partition(" ")
        out.append((word.upper(), rest.strip()))
        buf = ""
    return out


def stages(text: str) -> list[list[tuple[str, str]]]:
    result: list[list[tuple[str, str]]] = []
    for ins in instructions(text):
        if ins[0] == "FROM":
            result.append([])
        if result:
            result[-1].append(ins)
    return result


def test_hadolint_clean() -> None:
    hadolint = require_tool("hadolint")
    proc = run([hadolint, "--no-color", "--format", "json", str(DOCKERFILE)], check=False)
    findings = json.loads(proc.stdout or "[]")
    assert findings == [], "hadolint findings (fix, or ignore inline with a reason):\n" + json.dumps(findings, indent=1)
    assert proc.returncode == 0, proc.stderr


def test_hadolint_is_really_linting(tmp_path: Path) -> None:
    """Guard against a silent no-op linter: a bad Dockerfile must be flagged."""
    hadolint = require_tool("hadolint")
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM ubuntu\nRUN pip install foo\n")
    proc = run([hadolint, "--no-color", "--format", "json", str(bad)], check=False)
    codes = {f["code"] for f in json.loads(proc.stdout)}
    assert {"DL3006", "DL3013"} <= codes


def test_inline_ignores_carry_a_reason() -> None:
    """Any `# hadolint ignore=DLxxxx` must be explained by the comment line just above it."""
    lines = DOCKERFILE.read_text().splitlines()
    for i, line in enumerate(lines):
        if "hadolint ignore" in line:
            prev = lines[i - 1].strip() if i else ""
            assert prev.startswith("#") and "hadolint" not in prev and len(prev) > 10, \
                f"Dockerfile line {i + 1}: explain the ignore in a comment on the line above"


def test_structure() -> None:
    text = DOCKERFILE.read_text()
    st = stages(text)
    assert len(st) >= 2, "multi-stage build expected"
    args = dict(a.split("=", 1) for w, a in instructions(text) if w == "ARG" and "=" in a)
    base = args.get("PYTHON_IMAGE", "")
    assert re.fullmatch(r"python:3\.\d+-slim(-\w+)?", base), f"slim, tagged Python base expected, got {base!r}"
    for stage in st:
        assert stage[0][1].split()[0] in ("${PYTHON_IMAGE}", base)
    final = dict()
    for word, rest in st[-1]:
        final.setdefault(word, []).append(rest)
    user = final["USER"][-1]
    assert user.split(":")[0] not in ("root", "0"), "runtime must not run as root"
    assert "HEALTHCHECK" in final and "spotguard" in final["HEALTHCHECK"][0] and "status" in final["HEALTHCHECK"][0]
    assert "--check" in final["HEALTHCHECK"][0], "the health check is 'I can see notices', not just 'I answer'"
    assert any("/run/spotguard" in v for v in final["VOLUME"])
    assert json.loads(final["ENTRYPOINT"][0]) == ["spotguard"]
    assert json.loads(final["CMD"][0])[0] == "daemon"
    assert "SPOTGUARD_SOCKET=/run/spotguard/spotguard.sock" in " ".join(final["ENV"])
    # Nothing but the socket volume and (optionally) the metrics port.
    for exposed in final.get("EXPOSE", []):
        assert exposed.split("/")[0] in ("9464",), exposed
    pip_args = re.findall(r"pip install([^&;|]*)", " ".join(r for w, r in instructions(text) if w == "RUN"))
    assert pip_args and not any("torch" in a for a in pip_args), pip_args


def test_dockerignore_keeps_what_is_copied() -> None:
    ignore = (REPO / ".dockerignore").read_text().splitlines()
    assert "*" in ignore, "default-deny build context expected"
    allowed = {l[1:].rstrip("/") for l in ignore if l.startswith("!")}
    for word, rest in instructions(DOCKERFILE.read_text()):
        if word == "COPY" and "--from" not in rest:
            for src in shlex.split(rest)[:-1]:
                assert src.rstrip("/") in allowed, f"COPY {src} is excluded by .dockerignore"
                assert (REPO / src).exists(), src


def _install_step() -> tuple[list[str], str]:
    """The build stage's COPY sources and the RUN that creates /opt/spotguard."""
    build = stages(DOCKERFILE.read_text())[0]
    copies = [s for w, r in build if w == "COPY" for s in shlex.split(r)[:-1]]
    runs = [r for w, r in build if w == "RUN" and "/opt/spotguard/bin/pip install" in r]
    assert len(runs) == 1, "exactly one install RUN expected in the build stage"
    return copies, runs[0]


@pytest.mark.slow
def test_install_step_in_clean_venv(tmp_path: Path) -> None:
    """Replay the image's install step: same pip command, real dependency resolution (no --no-deps)."""
    copies, cmd = _install_step()
    assert "--no-deps" not in cmd
    src = tmp_path / "src"
    src.mkdir()
    for item in copies:
        p = REPO / item
        if p.is_dir():
            shutil.copytree(p, src / item, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        else:
            shutil.copy2(p, src / item)
    venv = tmp_path / "opt-spotguard"
    base_python = getattr(sys, "_base_executable", None) or sys.executable
    cmd = re.sub(r'(?<=[\s"\'])/src\b', str(src), cmd.replace("/opt/spotguard", str(venv)))
    cmd = re.sub(r"^python ", shlex.quote(base_python) + " ", cmd)
    proc = subprocess.run(["bash", "-euo", "pipefail", "-c", cmd], capture_output=True, text=True, timeout=240, cwd=tmp_path)
    assert proc.returncode == 0, f"install step failed:\n{cmd}\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    # The installed console script works and torch is absent.
    help_out = run([str(venv / "bin" / "spotguard"), "daemon", "--help"])
    assert "--socket" in help_out.stdout and "--cloud" in help_out.stdout
    probe = run([str(venv / "bin" / "python"), "-c", "import torch"], check=False)
    assert probe.returncode != 0 and "No module named 'torch'" in probe.stderr
    # The daemon's import path does not touch torch either.
    mods = run([str(venv / "bin" / "python"), "-c",
                "import sys, spotguard.cli, spotguard.daemon.app; print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch','numpy')))"])
    assert mods.stdout.strip() == "[]"
