"""`spotguard checkpoints URI`: the table and JSON say exactly what resume would load."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest

from spotguard.storage import open_storage
from spotguard.storage.commit import LATEST_NAME, CommitRecord, commit, prepare_attempt

REPO = pathlib.Path(__file__).resolve().parents[2]


def _full_cli_works() -> str | None:
    """None if `python -m spotguard` can build its parser, else why not (another subcommand missing)."""
    r = subprocess.run([sys.executable, "-m", "spotguard", "--help"], capture_output=True, text=True, cwd=REPO)
    return None if r.returncode == 0 else (r.stderr.strip().splitlines() or ["?"])[-1]


_CLI_PROBLEM = _full_cli_works()
# Through the real entry point when the whole CLI imports; else the subcommand module alone.
CMD = [sys.executable, "-m", "spotguard", "checkpoints"] if _CLI_PROBLEM is None else [
    sys.executable, "-m", "spotguard.storage.listing"]


def run(*args: str, cwd: pathlib.Path | None = None) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    return subprocess.run([*CMD, *args], capture_output=True, text=True, cwd=cwd or REPO, env=env, timeout=60)


@pytest.fixture
def populated(tmp_path: pathlib.Path) -> pathlib.Path:
    root = tmp_path / "store"
    s = open_storage(str(root))
    for step in (100, 200):
        key = prepare_attempt(s, step)
        s.write_bytes(f"{key}/__0_0.distcp", b"x" * 3000)
        s.write_bytes(f"{key}/.metadata", b"m" * 72)
        commit(s, step, CommitRecord(step=step, reason="periodic", world_size=step // 50))
    key = prepare_attempt(s, 300)
    s.write_bytes(f"{key}/__0_0.distcp", b"x" * 10)
    key = prepare_attempt(s, 250)  # committed, then a shard truncated
    s.write_bytes(f"{key}/__0_0.distcp", b"x" * 2048)
    commit(s, 250, CommitRecord(step=250, reason="emergency", notice_id="gcp-1"))
    (root / key / "__0_0.distcp").write_bytes(b"x" * 5)
    s.write_bytes(LATEST_NAME, b"step-00000300\n")  # a lying hint
    return root


def test_table(populated: pathlib.Path) -> None:
    r = run(str(populated))
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0] == f"checkpoints under {populated.as_uri()}"
    assert lines[1].split() == ["STEP", "WORLD", "SIZE", "TIME", "(UTC)", "STATE"]
    rows = {line.split()[0]: line for line in lines[2:6]}
    assert [rows[s].split()[1] for s in ("100", "200", "300")] == ["2", "4", "-"]  # world size that wrote it
    assert "3.0 KiB" in rows["100"] and rows["100"].endswith("committed")
    assert rows["200"].endswith("committed, newest, not verified: resume verifies it first")  # no latest hint
    assert "incomplete (truncated shard __0_0.distcp: 5 of 2048 bytes)" in rows["250"]
    assert "incomplete (no commit record" in rows["300"] and rows["300"].endswith("latest hint ignored")
    assert lines[-1].startswith("resume would try step-00000200 first: committed, not verified")


def test_json_and_file_uri(populated: pathlib.Path) -> None:
    r = run(populated.as_uri(), "--json")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["newest_committed"] == "step-00000200" and doc["latest_hint"] == "step-00000300"
    by_step = {c["step"]: c for c in doc["checkpoints"]}
    assert [c["step"] for c in doc["checkpoints"]] == [100, 200, 250, 300]
    assert by_step[200]["committed"] and by_step[200]["newest"] and by_step[200]["bytes"] == 3072
    assert by_step[200]["record"]["reason"] == "periodic"
    assert by_step[200]["world_size"] == 4 and by_step[300]["world_size"] is None
    assert by_step[250]["state"] == "incomplete" and "truncated" in by_step[250]["problem"]
    assert by_step[300]["latest"] and by_step[300]["record"] is None
    assert by_step[100]["time"].endswith("Z")


def test_relative_path_and_empty_store(tmp_path: pathlib.Path) -> None:
    (tmp_path / "empty").mkdir()
    r = run("empty", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == f"no checkpoints under {(tmp_path / 'empty').as_uri()}"


@pytest.mark.parametrize(
    "uri, message",
    [
        ("gopher://x/y", "unsupported storage URI"),
        ("/nonexistent/spotguard/store", "no such directory"),
    ],
)
def test_bad_uri_exits_2_with_clear_error(uri: str, message: str) -> None:
    r = run(uri)
    assert r.returncode == 2
    assert r.stderr.startswith("spotguard checkpoints: error:") and message in r.stderr
    assert "Traceback" not in r.stderr


@pytest.mark.skipif(_CLI_PROBLEM is not None, reason=f"`python -m spotguard` does not build yet: {_CLI_PROBLEM}")
def test_real_entry_point_help() -> None:
    r = subprocess.run([sys.executable, "-m", "spotguard", "checkpoints", "--help"], capture_output=True,
                       text=True, cwd=REPO, timeout=60)
    assert r.returncode == 0 and "--json" in r.stdout


def test_control_characters_from_storage_are_escaped_in_the_table() -> None:
    """A forged quarantine mark's reason may carry terminal escapes: the table never prints them raw."""
    from spotguard.storage.listing import _printable

    assert _printable("flip\x1b]0;owned\x07 in shard") == "flip\\x1b]0;owned\\x07 in shard"
    assert _printable("plain reason, 42 bytes") == "plain reason, 42 bytes"


@pytest.mark.parametrize("w", [
    {"doomed": [1], "bytes_per_rank": [10, 20], "safe_seconds": [0.5]},  # a list, not the {rank: s} mapping
    {"doomed": [1], "bytes_per_rank": {"a": 1}, "safe_seconds": {}},
    {"doomed": [{"r": 1}], "bytes_per_rank": [1, 2]},
    {"doomed": list(range(100_000)), "bytes_per_rank": [1] * 100_000, "safe_seconds": {"0": 0.1}},
    {"doomed": ["1"], "bytes_per_rank": "12", "safe_seconds": {"1": "soon"}},
    {"doomed": [10**200, -5, True], "bytes_per_rank": [1, 2]},
    {"doomed": [1], "bytes_per_rank": [1, 2], "evacuated": {"1": {"to": "x", "bytes": 3}}},
    {"doomed": [1], "bytes_per_rank": [1, 2], "evacuated": {"1": [0, 3]}, "safe_seconds": {"1": 0.1}},
    {"doomed": [1], "bytes_per_rank": [1, 2], "evacuated": {str(r): {"to": r, "bytes": 1} for r in range(10_000)}},
])
def test_hostile_writers_field_never_breaks_the_table(w: dict) -> None:
    """``extra["writers"]`` is read from storage (any writer, any version): a wrong type or a huge list gives
    no note or a short one, never an exception (the whole listing would fail) or a megabyte line."""
    from types import SimpleNamespace

    from spotguard.storage.listing import writers_note

    note = writers_note(SimpleNamespace(record=SimpleNamespace(extra={"writers": w})))  # type: ignore[arg-type]
    assert note is None or len(note) < 300, note
