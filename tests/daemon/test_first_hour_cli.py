"""A user's first hour with the CLI and the daemon (issue 18), each mistake made against real processes."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import time
from pathlib import Path

from spotguard.daemon.book import NoticeBook
from spotguard.daemon.client import Subscription, _fmt_status
from spotguard.protocol import CancelMsg

from .conftest import REPO, make_notice
from .test_client_cli import CLI, run_cli


def _status(sock: str) -> dict:
    out = run_cli("status", "--socket", sock, "--json")
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def _wait(pred, timeout: float, what: str):  # type: ignore[no-untyped-def]
    """Poll a status query (another process's state: nothing to await) until ``pred`` holds."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        val = pred()
        if val:
            return val
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


# -- item 10 --------------------------------------------------------------------------------------


def test_misspelled_daemon_flag_is_one_line_naming_the_fix() -> None:
    out = run_cli("daemon", "--clod", "gcp")
    assert out.returncode == 2
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1, out.stderr  # not the top-level usage
    assert "unknown option --clod (did you mean --cloud?)" in lines[0] and "spotguard daemon --help" in lines[0]
    assert "usage:" not in out.stderr and "'gcp'" not in out.stderr
    other = run_cli("status", "--jsn")
    assert other.returncode == 2 and "did you mean --json?" in other.stderr and len(other.stderr.splitlines()) == 1


# -- item 11 --------------------------------------------------------------------------------------


def test_status_into_a_closed_pipe_has_no_traceback(spawn_daemon) -> None:
    dp = spawn_daemon()
    read_end, write_end = os.pipe()
    os.close(read_end)  # the reader is gone, as after `| grep -q active` matched
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPOTGUARD_")}
    try:
        out = subprocess.run([*CLI, "status", "--socket", dp.sock], stdout=write_end, stderr=subprocess.PIPE,
                             timeout=30, env=env, cwd=REPO)
    finally:
        os.close(write_end)
    assert out.returncode == 141, out.stderr  # 128 + SIGPIPE, like coreutils
    assert b"Traceback" not in out.stderr and b"BrokenPipeError" not in out.stderr, out.stderr
    # ... and through a real shell pipeline, as in the README
    sh = subprocess.run(f"{' '.join(CLI)} status --socket {dp.sock} | head -c1 >/dev/null", shell=True,
                        capture_output=True, text=True, timeout=30, env=env, cwd=REPO)
    assert "Traceback" not in sh.stderr, sh.stderr


# -- item 9 ---------------------------------------------------------------------------------------


def test_socket_path_that_is_a_regular_file_gets_a_hint_that_works(tmp_path: Path, spawn_daemon) -> None:
    regular = tmp_path / "spotguard.sock"
    regular.write_text("not a socket\n")
    out = run_cli("status", env={"SPOTGUARD_SOCKET": str(regular)})
    assert out.returncode == 1
    assert f"{regular} is a regular file, not the daemon's socket" in out.stderr, out.stderr
    assert "move" in out.stderr and "/run/spotguard/spotguard.sock" in out.stderr
    # Following the hint (move it away, then start the daemon there) works.
    regular.rename(tmp_path / "moved-away")
    dp = spawn_daemon(sock=str(regular))
    assert run_cli("status", env={"SPOTGUARD_SOCKET": dp.sock}).returncode == 0


# -- item 5 ---------------------------------------------------------------------------------------


def test_drill_leaves_book_and_status_at_its_deadline(spawn_daemon) -> None:
    dp = spawn_daemon()
    dr = run_cli("drill", "--socket", dp.sock, "--deadline-in", "1.5", "--json")
    assert dr.returncode == 0, dr.stderr
    nid = json.loads(dr.stdout)["id"]
    assert [n["id"] for n in _status(dp.sock)["active_notices"]] == [nid]
    t0 = time.monotonic()
    _wait(lambda: _status(dp.sock)["active_notices"] == [], 20, "the drill to expire")
    assert time.monotonic() - t0 < 15  # at its deadline (+ the 1 s housekeeping), not deadline + 60 s
    human = run_cli("status", "--socket", dp.sock)
    assert "active:      0" in human.stdout and "left)" not in human.stdout


def test_drill_cancel_sends_cancel_to_subscribers_and_stops_the_replay(spawn_daemon) -> None:
    dp = spawn_daemon()

    async def go() -> None:
        sub = await Subscription(dp.sock).open()
        dr = run_cli("drill", "--socket", dp.sock, "--deadline-in", "120", "--json")
        nid = json.loads(dr.stdout)["id"]
        assert (await sub.next_notice(timeout=10)).id == nid
        out = run_cli("drill", "--socket", dp.sock, "--cancel", nid)
        assert out.returncode == 0 and f"drill {nid} cancelled" in out.stderr, out.stderr
        msg = await sub.next(timeout=10)
        assert isinstance(msg, CancelMsg) and msg.id == nid
        await sub.close()
        late = await Subscription(dp.sock).open()  # a job started now is not told of it
        assert (await late.status())["active_notices"] == []
        try:
            await late.next(timeout=1.0)
            raise AssertionError("a cancelled drill was replayed")
        except asyncio.TimeoutError:
            pass
        await late.close()
        bad = run_cli("drill", "--socket", dp.sock, "--cancel", "drill-nope")
        assert bad.returncode == 1 and "no active drill 'drill-nope'" in bad.stderr

    asyncio.run(go())


def test_drill_clear_ends_every_active_drill(spawn_daemon) -> None:
    """Issue 23: a rehearsal resets cleanly — ``drill --clear`` cancels every active drill (no ids needed)."""
    dp = spawn_daemon()

    async def go() -> None:
        sub = await Subscription(dp.sock).open()
        ids = [json.loads(run_cli("drill", "--socket", dp.sock, "--deadline-in", "120", "--json").stdout)["id"]
               for _ in range(2)]
        got = {(await sub.next_notice(timeout=10)).id for _ in ids}
        assert got == set(ids)
        out = run_cli("drill", "--socket", dp.sock, "--clear", "--json")
        assert out.returncode == 0, out.stderr
        assert sorted(json.loads(out.stdout)["cancelled"]) == sorted(ids)
        cancels = {(await sub.next(timeout=10)).id for _ in ids}
        assert cancels == set(ids)
        assert (await sub.status())["active_notices"] == []
        again = run_cli("drill", "--socket", dp.sock, "--clear")
        assert again.returncode == 0 and "0 drill(s) cancelled" in again.stderr
        await sub.close()

    asyncio.run(go())


def test_status_never_shows_negative_seconds_left() -> None:
    state = {"active_notices": [{"id": "aws-1", "source": "aws", "kind": "preemption",
                                 "deadline": "2026-12-03T07:00:00.000Z", "seconds_left": -12.5, "expires_in": 47.5}]}
    text = _fmt_status(state)
    assert "deadline passed 12.5s ago, replayed 48s more" in text and "-12.5" not in text


def test_book_expires_drills_at_their_deadline_and_cloud_notices_after_the_margin() -> None:
    book = NoticeBook(expire_margin=60)
    book.add(make_notice("drill-past", source="drill", in_seconds=-0.5))
    book.add(make_notice("aws-past", source="aws", in_seconds=-0.5))
    book.add(make_notice("drill-future", source="drill", in_seconds=30))
    assert [e.id for e in book.expire()] == ["drill-past"]
    assert {n.id for n in book.notices()} == {"aws-past", "drill-future"}
