"""Issue 2 "Packaging and set-up": one pyproject, Python >= 3.10, typed, one console
script, daemon dependencies only (never torch), and the daemon's import path free of
torch; `.ci/run` is `make test` and nothing else; README shows both commands first."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from importlib.metadata import entry_points

import pytest

try:
    import tomllib
except ImportError:  # Python 3.10
    tomllib = pytest.importorskip("tomli")

from .conftest import REPO


def _pyproject() -> dict:
    with open(os.path.join(REPO, "pyproject.toml"), "rb") as f:
        return tomllib.load(f)


def test_pyproject_declares_the_package() -> None:
    project = _pyproject()["project"]
    assert project["name"] == "spotguard" and project["requires-python"] == ">=3.10"
    assert project["scripts"] == {"spotguard": "spotguard.cli:main"}
    deps = [re.split(r"[<>=!~ \[;]", d, maxsplit=1)[0].lower() for d in project["dependencies"]]
    assert "torch" not in deps and {"aiohttp", "structlog"} <= set(deps)
    assert "py.typed" in _pyproject()["tool"]["setuptools"]["package-data"]["spotguard"]
    assert os.path.isfile(os.path.join(REPO, "spotguard", "py.typed"))


def test_console_script_is_installed() -> None:
    (ep,) = [e for e in entry_points(group="console_scripts") if e.name == "spotguard"]
    assert ep.value == "spotguard.cli:main"


def test_daemon_import_path_never_imports_torch() -> None:
    code = ("import sys; from spotguard.cli import build_parser; build_parser('daemon'); "
            "import spotguard.daemon.app, spotguard.daemon.watchers.registry, spotguard.emulator.server, "
            "spotguard.daemon.client; print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'numpy')))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=REPO)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[]"


def test_ci_runs_make_test_only_and_readme_shows_both_commands_first() -> None:
    with open(os.path.join(REPO, ".ci", "run")) as f:
        commands = [ln.strip() for ln in f if ln.strip() and not ln.lstrip().startswith("#")]
    assert commands[-1] == "make test"
    assert all(c.startswith(("set ", "cd ")) for c in commands[:-1]), commands
    with open(os.path.join(REPO, "README.md")) as f:
        readme = f.read()
    first_block = readme[readme.index("```"):]
    first_block = first_block[:first_block.index("```", 3)]
    assert "make test" in first_block and "make demo" in first_block
    with open(os.path.join(REPO, "Makefile")) as f:
        targets = set(re.findall(r"^([a-z-]+):", f.read(), flags=re.M))
    assert {"test", "demo", "bench"} <= targets
