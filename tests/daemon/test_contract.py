"""SPEC.md contract points checked on the real entry point: `--help` everywhere, env-only
configuration of a real daemon process, socket permissions against a foreign uid,
JSON log lines carrying the notice id across a whole timeline, and the SIGTERM path
serving (status, replay to late subscribers) until every subscriber is done."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
import urllib.request

import pytest

from spotguard.cli import SUBCOMMANDS
from spotguard.daemon.client import Subscription, request
from spotguard.daemon.config import _OPTIONS
from spotguard.protocol import Drill, DrillOk, StatusReply, StatusRequest

from .conftest import REPO, DaemonProc, daemon_cmd, running_daemon

CLI = [sys.executable, "-m", "spotguard"]


def _clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPOTGUARD_") and k != "NOTIFY_SOCKET"}
    env.update(extra)
    return env


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# --- --help on every subcommand ----------------------------------------------------


@pytest.mark.parametrize("command", ["", *SUBCOMMANDS])
def test_help_works_on_every_subcommand(command: str) -> None:
    args = [command, "--help"] if command else ["--help"]
    r = subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=60, env=_clean_env(), cwd=REPO)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith(f"usage: spotguard {command}".rstrip()), r.stdout[:200]
    assert r.stderr == ""
    if not command:
        for name in SUBCOMMANDS:
            assert name in r.stdout
    if command == "daemon":
        flat = " ".join(r.stdout.split())
        for opt in _OPTIONS:  # every option and its env var are documented in --help
            assert f"--{opt.flag}" in flat and opt.env in flat, opt.flag


# --- every option through the environment of a real process ------------------------


@pytest.mark.serial
async def test_real_daemon_configured_by_env_only_and_flags_win(sockdir: str) -> None:
    """No flag but one: socket, cloud, metrics port, grace and node come from SPOTGUARD_*;
    --node on the command line beats SPOTGUARD_NODE; logs are JSON by default."""
    path = os.path.join(sockdir, "env.sock")
    nsock = os.path.join(sockdir, "notify.sock")
    notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    notify.bind(nsock)
    port = _free_port()
    env = _clean_env(SPOTGUARD_SOCKET=path, SPOTGUARD_CLOUD="none", SPOTGUARD_METRICS_PORT=str(port),
                     SPOTGUARD_SIGTERM_GRACE="7", SPOTGUARD_SIGTERM_NOTICE="1", SPOTGUARD_NODE="env-node", SPOTGUARD_PING_INTERVAL="0.05",
                     NOTIFY_SOCKET=nsock, PYTHONUNBUFFERED="1")
    log_path = os.path.join(sockdir, "env.log")
    with open(log_path, "wb") as log_file:
        proc = subprocess.Popen(daemon_cmd("--node", "flag-node"), env=env, stdout=log_file,
                                stderr=subprocess.STDOUT, cwd=REPO)
    dp = DaemonProc(proc, path, notify, log_path=log_path)
    try:
        await asyncio.to_thread(dp.wait_notify, "READY=1")
        sub = await Subscription(path).open()
        assert sub.hello is not None and sub.hello.node == "flag-node" and sub.hello.cloud == "none"
        # SPOTGUARD_PING_INTERVAL reached the server: a ping arrives long before the 10 s default.
        from spotguard.daemon.client import read_message
        from spotguard.protocol import Ping

        assert sub.reader is not None
        assert isinstance(await read_message(sub.reader, timeout=5), Ping)
        body = await asyncio.to_thread(
            lambda: urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=5).read())
        assert json.loads(body)["ok"] is True and json.loads(body)["socket"] == path
        proc.send_signal(signal.SIGTERM)
        notice = await sub.next_notice(timeout=10)
        assert notice.kind == "termination" and 4 < notice.seconds_left() <= 7.5  # SPOTGUARD_SIGTERM_GRACE=7
        await sub.checkpoint_done(notice.id, step=1)
        assert await asyncio.to_thread(proc.wait, 10) == 0
        await sub.close()
        lines = [ln for ln in dp.stderr_now().splitlines() if ln.strip()]
        assert lines and all(json.loads(ln)["event"] for ln in lines), "default log format must be JSON"
    finally:
        dp.stop()


# --- socket mode 0660: a foreign, non-root uid outside the group cannot connect ------

_CONNECT_AS_NOBODY = textwrap.dedent("""
    import json, os, socket, sys
    os.setgroups([]); os.setgid(65534); os.setuid(65534)
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM); s.settimeout(5)
    try:
        s.connect(sys.argv[1])
    except OSError as exc:
        print(json.dumps({"connected": False, "errno": exc.errno}))
    else:
        print(json.dumps({"connected": True, "first": s.makefile("rb").readline().decode()}))
""")


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to switch to another uid")
@pytest.mark.parametrize("group, allowed", [(None, False), ("65534", True)])
async def test_foreign_uid_cannot_connect_unless_in_the_socket_group(sockdir: str, group: str | None,
                                                                     allowed: bool) -> None:
    import errno

    os.chmod(sockdir, 0o755)  # the directory is not what stops it: the socket's own mode is
    path = os.path.join(sockdir, "perm.sock")
    kw = {"socket_group": group} if group else {}
    async with running_daemon(path, **kw):
        proc = await asyncio.create_subprocess_exec(sys.executable, "-c", _CONNECT_AS_NOBODY, path,
                                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        out, err = await asyncio.wait_for(proc.communicate(), 30)
        assert proc.returncode == 0, err.decode()
        result = json.loads(out)
    if allowed:
        assert result["connected"] and json.loads(result["first"])["type"] == "hello"
    else:
        assert result == {"connected": False, "errno": errno.EACCES}


# --- JSON log lines: notice_id on every line of the timeline --------------------------


async def test_json_logs_carry_notice_id_on_every_timeline_line(spawn_daemon) -> None:
    dp = spawn_daemon("--sigterm-notice", "--sigterm-grace", "20")
    a = await Subscription(dp.sock, rank=0, world_size=2, job="tl").open()
    b = await Subscription(dp.sock, rank=1, world_size=2, job="tl").open()
    # A maintenance drill (ordinary checkpoint, training goes on): a report on an
    # emergency notice would count as "done" for the SIGTERM wait below.
    reply = await request(dp.sock, Drill(kind="maintenance", deadline_in=60))
    assert isinstance(reply, DrillOk)
    nid = reply.id
    for s in (a, b):
        assert (await s.next_notice(timeout=5)).id == nid
    await a.ack(nid)
    await a.checkpoint_started(nid, 7)
    await a.checkpoint_done(nid, step=7, uri="file:///c/step-00000007", nbytes=123, seconds=0.4)
    await b.ack(nid)
    await b.checkpoint_failed(nid, "disk full")
    await a.status()
    await b.status()
    # Then the daemon's own SIGTERM: its termination notice has a timeline too.
    dp.proc.send_signal(signal.SIGTERM)
    term = [await s.next_notice(timeout=10) for s in (a, b)]
    tid = term[0].id
    for s in (a, b):
        await s.checkpoint_done(tid, step=8)
    assert await asyncio.to_thread(dp.proc.wait, 10) == 0
    for s in (a, b):
        await s.close()

    raw = [ln for ln in dp.stderr_now().splitlines() if ln.strip()]
    records = [json.loads(ln) for ln in raw]  # every line is one JSON object
    assert all("timestamp" in r and "level" in r and "event" in r for r in records)
    for notice_id, expected in (
        (nid, ["drill.accepted", "notice.seen", "notice.delivered", "notice.acked", "notice.checkpoint_started",
               "notice.checkpoint_done", "notice.checkpoint_failed"]),
        (tid, ["signal.received", "notice.seen", "notice.delivered", "shutdown.waiting", "notice.checkpoint_done",
               "shutdown.ready"]),
    ):
        mentioning = [json.loads(ln) for ln in raw if notice_id in ln]
        assert mentioning and all(r.get("notice_id") == notice_id for r in mentioning), \
            [r for r in mentioning if r.get("notice_id") != notice_id]
        events = [r["event"] for r in mentioning]
        positions = [events.index(e) for e in expected]  # each present ...
        assert positions == sorted(positions), events  # ... in timeline order
    done = next(r for r in records if r["event"] == "notice.checkpoint_done" and r["notice_id"] == nid)
    assert (done["step"], done["bytes"], done["rank"], done["job"]) == (7, 123, 0, "tl")


# --- SIGTERM: keep serving until every subscriber is done --------------------------


async def test_sigterm_keeps_serving_until_every_subscriber_is_done(spawn_daemon) -> None:
    dp = spawn_daemon("--sigterm-notice", "--sigterm-grace", "30")
    a = await Subscription(dp.sock, rank=0, world_size=2, job="j").open()
    b = await Subscription(dp.sock, rank=1, world_size=2, job="j").open()
    t0 = time.monotonic()
    dp.proc.send_signal(signal.SIGTERM)
    notice = await a.next_notice(timeout=10)
    assert (await b.next_notice(timeout=10)).id == notice.id
    await a.checkpoint_done(notice.id, step=4)
    state = await a.status()  # a round trip after a's report: still serving, b is not done
    assert state["shutting_down"] == "SIGTERM" and dp.proc.poll() is None
    # `spotguard status` shows the shutdown, both subscribers and the last notice.
    proc = await asyncio.create_subprocess_exec(*CLI, "status", "--socket", dp.sock, stdout=subprocess.PIPE,
                                                stderr=subprocess.PIPE, cwd=REPO, env=_clean_env())
    out, err = await asyncio.wait_for(proc.communicate(), 30)
    text = out.decode()
    assert proc.returncode == 0, err.decode()
    assert "shutting down (SIGTERM)" in text and "subscribers: 2" in text and "rank 1/2 job j" in text
    assert f"last notice: {notice.id} signal/termination" in text and "cloud:       none" in text
    # A trainer that (re)connects now still gets the notice replayed, and is waited for.
    c = await Subscription(dp.sock, rank=0, world_size=1, job="late").open()
    assert (await c.next_notice(timeout=5)).id == notice.id
    await b.checkpoint_done(notice.id, step=4)
    assert isinstance(await request(dp.sock, StatusRequest()), StatusReply)
    assert dp.proc.poll() is None
    await c.checkpoint_failed(notice.id, "gave up")
    assert await asyncio.to_thread(dp.proc.wait, 10) == 0
    assert time.monotonic() - t0 < 15, "must exit once everyone is done, not at the 30 s deadline"
    for s in (a, b, c):
        await s.close()
