"""Socket security: who may connect and drill (real setuid subprocesses), floods that must not starve a
real subscriber, stale sockets, and paths another user planted (a symlinked socket or parent directory).

Limits (documented in docs/reliability.md): at most ``2 * max_subscribers + 32`` connections (544 by
default; beyond, one ``error`` line and close), ``max_subscribers`` (256) subscribers, 64 KiB a line,
256 queued messages per client (a client that does not read its replies is dropped), 10 s write stall.
"""

from __future__ import annotations

import errno
import json
import os
import resource
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from typing import Any, Optional

import pytest

from spotguard.daemon.server import UnsafeSocketPath, check_socket_dir, prepare_socket_path

from .conftest import REPO, daemon_cmd, short_dir, stop_process

root_only = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to switch uids / chown")

DAEMON_UID = 4242
OTHER_UID = 4343

_CLIENT = textwrap.dedent("""
    import json, os, socket, sys
    uid, groups, path, drill = int(sys.argv[1]), json.loads(sys.argv[2]), sys.argv[3], sys.argv[4] == "1"
    os.setgroups(groups)
    if uid:
        os.setgid(uid); os.setuid(uid)
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM); s.settimeout(10)
    try:
        s.connect(path)
    except OSError as exc:
        print(json.dumps({"connected": False, "errno": exc.errno})); sys.exit(0)
    f = s.makefile("rb")
    hello = json.loads(f.readline())
    out = {"connected": True, "hello": hello["type"]}
    if drill:
        s.sendall(b'{"type":"drill","kind":"rebalance","deadline_in":600}\\n')
        while True:
            m = json.loads(f.readline())
            if m["type"] in ("drill_ok", "error"):
                out["drill"] = m["type"]; out["error"] = m.get("error", ""); break
    print(json.dumps(out))
""")


def _as(uid: int, groups: list[int], path: str, drill: bool = False) -> dict[str, Any]:
    r = subprocess.run([sys.executable, "-c", _CLIENT, str(uid), json.dumps(groups), path, "1" if drill else "0"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    return dict(json.loads(r.stdout))


_AS_UID = textwrap.dedent("""
    import json, os, sys
    import spotguard.cli, spotguard.daemon.app, spotguard.daemon.config, spotguard.daemon.server  # noqa
    import spotguard.daemon.persist, spotguard.daemon.watchers.signal, spotguard.logs  # noqa
    uid = int(sys.argv[1])
    os.setgroups([]); os.setgid(uid); os.setuid(uid)
    sys.exit(spotguard.cli.main(json.loads(sys.argv[2])))
""")


class _RealDaemon:
    """``spotguard daemon --cloud none`` as ``uid`` (setuid before exec), readiness via its log line."""

    def __init__(self, sock: str, log: str, uid: Optional[int] = None, *args: str) -> None:
        env = {k: v for k, v in os.environ.items() if not k.startswith("SPOTGUARD_") and k != "NOTIFY_SOCKET"}
        env["PYTHONUNBUFFERED"] = "1"

        argv = ["daemon", "--cloud", "none", "--socket", sock, "--log-format", "json", *args]
        if uid is None:
            cmd = daemon_cmd(*argv[1:])
        else:
            # Start as root (the interpreter lives under /root), import everything, then drop to ``uid``.
            cmd = [sys.executable, "-c", _AS_UID, str(uid), json.dumps(argv)]
        self.log = log
        with open(log, "wb") as f:
            self.proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=REPO)
        end = time.monotonic() + 30
        while "daemon.ready" not in open(log, errors="replace").read():
            if self.proc.poll() is not None or time.monotonic() > end:
                raise AssertionError(f"daemon did not start: {open(log).read()[-2000:]}")
            time.sleep(0.05)  # another process's readiness: nothing to await

    def stop(self) -> None:
        stop_process(self.proc)


# --- who may connect, who may drill -----------------------------------------------------


@root_only
def test_connect_and_drill_rights_by_uid_and_group() -> None:
    """Daemon as uid 4242: 4242 and root connect and drill; 4343 cannot connect; 4343 in the socket's
    group (4242) connects but may not drill."""
    d = short_dir()
    os.chmod(d, 0o755)
    run = os.path.join(d, "run")
    os.mkdir(run, 0o750)
    os.chown(run, DAEMON_UID, DAEMON_UID)
    sock = os.path.join(run, "sg.sock")
    daemon = _RealDaemon(sock, os.path.join(d, "d.log"), DAEMON_UID)
    try:
        st = os.stat(sock)
        assert (st.st_uid, st.st_gid, st.st_mode & 0o777) == (DAEMON_UID, DAEMON_UID, 0o660)
        own = _as(DAEMON_UID, [], sock, drill=True)
        assert own["connected"] and own["drill"] == "drill_ok", own
        root = _as(0, [], sock, drill=True)
        assert root["connected"] and root["drill"] == "drill_ok", root
        stranger = _as(OTHER_UID, [], sock)
        assert stranger == {"connected": False, "errno": errno.EACCES}, stranger
        member = _as(OTHER_UID, [DAEMON_UID], sock, drill=True)  # in the socket's group (and the dir's)
        assert member["connected"] and member["drill"] == "error" and "drill refused" in member["error"], member
    finally:
        daemon.stop()
        shutil.rmtree(d, ignore_errors=True)


# --- floods -------------------------------------------------------------------------------


def _drill(sock: str) -> str:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(10)
    s.connect(sock)
    f = s.makefile("rb")
    f.readline()
    s.sendall(b'{"type":"drill","kind":"rebalance","deadline_in":600}\n')
    while True:
        m = json.loads(f.readline())
        if m["type"] == "drill_ok":
            s.close()
            return str(m["id"])
        assert m["type"] != "error", m


@pytest.mark.serial
def test_flood_of_connections_and_messages_does_not_starve_a_subscriber(capsys: Any) -> None:
    """1000 connections held open + 40 clients streaming lines without reading replies: a real
    subscriber still gets a drilled notice within 2 s, and the daemon's limits hold."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < 2400:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, 4096), hard))
    d = short_dir()
    sock = os.path.join(d, "f.sock")
    daemon = _RealDaemon(sock, os.path.join(d, "d.log"))
    held: list[socket.socket] = []
    stop = threading.Event()
    flooders: list[threading.Thread] = []
    sent = [0]
    try:
        sub = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sub.settimeout(10)
        sub.connect(sock)
        subf = sub.makefile("rb")
        assert json.loads(subf.readline())["type"] == "hello"
        sub.sendall(b'{"type":"subscribe","pid":1,"rank":0}\n{"type":"status"}\n')
        while json.loads(subf.readline())["type"] != "status":
            pass

        refused = 0
        for _ in range(1000):
            c = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)  # blocking connect: waits for backlog room
            try:
                c.connect(sock)
                c.settimeout(10)
            except OSError:
                refused += 1
                c.close()
                continue
            held.append(c)

        def flood(kind: int) -> None:
            lines = [b'{"type":"status"}\n', b'{"type":"ack","id":"nope"}\n', b'{"type":"x-unknown","a":1}\n',
                     b'{"type":"subscribe","pid":2}\n'][kind % 4] * 512
            try:
                c = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                c.connect(sock)
                c.settimeout(1)
                while not stop.is_set():
                    try:
                        c.sendall(lines)
                        sent[0] += 512
                    except socket.timeout:
                        continue
            except OSError:
                pass  # dropped by the daemon (queue overflow / too many): that is the bound working

        for i in range(40):
            t = threading.Thread(target=flood, args=(i,), daemon=True)
            t.start()
            flooders.append(t)
        time.sleep(1.0)  # let the flood build up
        latencies = []
        for _ in range(3):
            t0 = time.monotonic()
            nid = _drill(sock)
            while True:
                m = json.loads(subf.readline())
                if m["type"] == "notice" and m["id"] == nid:
                    break
            latencies.append(time.monotonic() - t0)
        # A trainer starting in the middle of the flood can still subscribe and gets the next notice.
        late = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        late.settimeout(10)
        late.connect(sock)
        latef = late.makefile("rb")
        assert json.loads(latef.readline())["type"] == "hello"
        late.sendall(b'{"type":"subscribe","pid":3,"rank":1}\n{"type":"status"}\n')
        while True:
            m = json.loads(latef.readline())
            if m["type"] == "status":
                clients = m["clients"]
                break
        nid = _drill(sock)
        got = set()
        while len(got) < 2:
            for f, name in ((subf, "first"), (latef, "late")):
                if name in got:
                    continue
                m = json.loads(f.readline())
                if m["type"] == "notice" and m["id"] == nid:
                    got.add(name)
        stop.set()
        # The oldest idle connections were evicted to make room (EOF), never more than the limit held.
        evicted = 0
        for c in held[:200]:
            try:
                c.settimeout(2)
                if c.recv(65536) == b"" or not c.recv(65536):
                    evicted += 1
            except (OSError, socket.timeout):
                pass
        with capsys.disabled():
            print(f"\n[flood] 1000 connects ({refused} refused at connect; daemon held {clients} <= 544, "
                  f"{evicted}/200 of the oldest evicted), {sent[0]} flood lines from 40 clients; drill->notice "
                  f"latency under flood: {[round(x, 3) for x in latencies]} s")
        assert max(latencies) < 2.0, latencies
        assert clients <= 544 and evicted > 0
        assert daemon.proc.poll() is None
    finally:
        stop.set()
        for c in held:
            c.close()
        daemon.stop()
        shutil.rmtree(d, ignore_errors=True)


# --- stale sockets, planted paths ------------------------------------------------------------


def test_stale_socket_of_a_killed_daemon_is_replaced_at_start() -> None:
    d = short_dir()
    sock = os.path.join(d, "s.sock")
    first = _RealDaemon(sock, os.path.join(d, "1.log"))
    first.proc.send_signal(signal.SIGKILL)
    first.proc.wait()
    assert os.path.exists(sock)  # left behind
    second = _RealDaemon(sock, os.path.join(d, "2.log"))
    try:
        assert "socket.stale_removed" in open(os.path.join(d, "2.log")).read()
    finally:
        second.stop()
        shutil.rmtree(d, ignore_errors=True)


@root_only
def test_symlinked_socket_planted_by_another_user_is_refused() -> None:
    d = short_dir()
    try:
        target = os.path.join(d, "attacker.sock")
        link = os.path.join(d, "sg.sock")
        os.symlink(target, link)
        os.lchown(link, OTHER_UID, OTHER_UID)
        with pytest.raises(UnsafeSocketPath, match="symlink"):
            prepare_socket_path(link)
        assert os.path.islink(link) and not os.path.exists(target)
    finally:
        shutil.rmtree(d, ignore_errors=True)


@root_only
def test_symlinked_parent_directory_planted_by_another_user_is_refused() -> None:
    """/tmp/x/run -> a directory the attacker owns: the daemon must not create its socket there."""
    d = short_dir()
    try:
        attacker_dir = os.path.join(d, "attacker")
        os.mkdir(attacker_dir)
        os.chown(attacker_dir, OTHER_UID, OTHER_UID)
        link = os.path.join(d, "run")
        os.symlink(attacker_dir, link)
        os.lchown(link, OTHER_UID, OTHER_UID)
        sock = os.path.join(link, "sg.sock")
        with pytest.raises(UnsafeSocketPath, match="symlink owned by uid 4343"):
            check_socket_dir(sock)
        # Even a root-owned link to the attacker's directory: the directory itself is refused.
        os.unlink(link)
        os.symlink(attacker_dir, link)
        with pytest.raises(UnsafeSocketPath, match="owned by uid 4343"):
            check_socket_dir(sock)
        # The real daemon refuses to start (exit 2, one line), and nothing appears in that directory.
        r = subprocess.run(daemon_cmd("--cloud", "none", "--socket", sock), capture_output=True, text=True,
                           timeout=60, cwd=REPO, env={k: v for k, v in os.environ.items()
                                                      if not k.startswith("SPOTGUARD_")})
        assert r.returncode == 2 and "owned by uid 4343" in r.stderr, r.stderr
        assert os.listdir(attacker_dir) == []
        # A root-owned link to a root-owned directory is fine (e.g. /var/run -> /run).
        good = os.path.join(d, "good")
        os.mkdir(good)
        os.unlink(link)
        os.symlink(good, link)
        check_socket_dir(sock)
    finally:
        shutil.rmtree(d, ignore_errors=True)


@root_only
def test_world_writable_root_dir_like_emptydir_is_allowed_but_planted_names_are_not() -> None:
    """Kubernetes emptyDir: root-owned 0777. Allowed; a symlink or file planted at the name is refused."""
    d = short_dir()
    try:
        shared = os.path.join(d, "shared")
        os.mkdir(shared)
        os.chmod(shared, 0o777)
        sock = os.path.join(shared, "sg.sock")
        check_socket_dir(sock)
        open(sock, "w").close()
        os.chown(sock, OTHER_UID, OTHER_UID)
        with pytest.raises(UnsafeSocketPath, match="not a socket"):
            prepare_socket_path(sock)
    finally:
        shutil.rmtree(d, ignore_errors=True)
