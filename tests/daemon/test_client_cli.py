"""`spotguard status` / `spotguard drill` against a real daemon process, and the client helper."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys

import pytest

from spotguard.daemon.client import DaemonUnavailable, Subscription, request, request_sync
from spotguard.protocol import StatusReply, StatusRequest

from .conftest import REPO


CLI = [sys.executable, "-m", "spotguard"]  # the real entry point


def run_cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("SPOTGUARD_")}
    full_env.update(env or {})
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=30, env=full_env, cwd=REPO)


@pytest.mark.serial
def test_status_and_drill_against_real_daemon(spawn_daemon) -> None:
    dp = spawn_daemon("--node", "node-a")
    st = run_cli("status", "--socket", dp.sock)
    assert st.returncode == 0, st.stderr
    assert "cloud:       none" in st.stdout and "node-a" in st.stdout and "last notice: none" in st.stdout
    assert "signal" in st.stdout and "subscribers: 0" in st.stdout

    dr = run_cli("drill", "--socket", dp.sock, "--kind", "termination", "--deadline-in", "45")
    assert dr.returncode == 0, dr.stderr
    nid = dr.stdout.strip()
    assert nid.startswith("drill-")

    js = run_cli("status", "--json", env={"SPOTGUARD_SOCKET": dp.sock})
    assert js.returncode == 0, js.stderr
    state = json.loads(js.stdout)
    assert state["last_notice"]["id"] == nid and state["last_notice"]["kind"] == "termination"
    assert state["active_notices"][0]["id"] == nid
    assert 40 < state["active_notices"][0]["seconds_left"] <= 45
    human = run_cli("status", "--socket", dp.sock)
    assert nid in human.stdout and "drill/termination" in human.stdout


def test_drill_reaches_subscriber(spawn_daemon) -> None:
    dp = spawn_daemon()

    async def go() -> tuple[str, str]:
        sub = await Subscription(dp.sock).open()
        proc = await asyncio.create_subprocess_exec(*CLI, "drill", "--socket", dp.sock, "--json",
                                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=REPO)
        out, _ = await proc.communicate()
        notice = await sub.next_notice(timeout=10)
        await sub.close()
        return json.loads(out)["id"], notice.id

    reply_id, notice_id = asyncio.run(go())
    assert reply_id == notice_id


@pytest.mark.parametrize("cmd", ["status", "drill"])
def test_no_daemon_is_exit_1_with_clear_message(sockdir: str, cmd: str) -> None:
    path = os.path.join(sockdir, "absent.sock")
    r = run_cli(cmd, "--socket", path)
    assert r.returncode == 1
    assert path in r.stderr and "spotguard daemon" in r.stderr and "SPOTGUARD_SOCKET" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to switch to another uid")
def test_drill_cli_from_other_uid_exit_1(spawn_daemon, sockdir: str) -> None:
    os.chmod(sockdir, 0o755)
    dp = spawn_daemon("--socket-group", "65534")
    # Import first: after setuid the interpreter's own files may not be readable by nobody.
    code = ("import os, sys, argparse; from spotguard.daemon import client as c; "
            "p = argparse.ArgumentParser(); c.add_drill_arguments(p); a = p.parse_args(sys.argv[1:]); "
            "os.setgroups([]); os.setgid(65534); os.setuid(65534); sys.exit(c.drill_main(a))")
    r = subprocess.run([sys.executable, "-c", code, "--socket", dp.sock], capture_output=True, text=True,
                       timeout=30, cwd=REPO)
    assert r.returncode == 1
    assert "refused" in r.stderr and "uid 65534" in r.stderr


async def test_request_helper_errors(sockdir: str) -> None:
    with pytest.raises(DaemonUnavailable, match="absent.sock"):
        await request(os.path.join(sockdir, "absent.sock"), StatusRequest(), timeout=1)


def test_request_sync(spawn_daemon) -> None:
    dp = spawn_daemon()
    reply = request_sync(dp.sock, StatusRequest())
    assert isinstance(reply, StatusReply) and reply.state["cloud"] == "none"
