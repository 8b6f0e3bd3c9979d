"""Liveness = the socket is served; readiness/alerts = seeing notices (issue 24).

``status --check`` fails while a metadata watcher is blind; used as a liveness probe it restarted the
daemon on every metadata flap (CrashLoopBackOff, no daemon at all while backing off). ``status --live``
passes as long as the daemon answers on its socket, and as an exec probe it must stay cheap: it starts a
fresh interpreter every period inside the daemon's memory limit, so it imports the standard library only.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

from spotguard import live
from spotguard.launch import Emulator, start_daemon, start_emulator
from spotguard.protocol import DEFAULT_SOCKET

CLI = [sys.executable, "-m", "spotguard"]
#: What an exec probe must never pull in: the event loop, TLS, the protocol/package, the cloud clients.
HEAVY = ("asyncio", "ssl", "email", "spotguard.notice", "spotguard.protocol", "spotguard.daemon", "aiohttp",
         "boto3", "botocore", "kubernetes_asyncio", "structlog", "prometheus_client")
PROBE = ("import json, resource, sys\n"
         "from spotguard.cli import main\n"
         "rc = main(sys.argv[1:])\n"
         "heavy = [m for m in {heavy!r} if m in sys.modules]\n"
         "print(json.dumps({{'rc': rc, 'heavy': heavy, 'maxrss_kb': resource.getrusage(resource.RUSAGE_SELF).ru_maxrss}}))\n")


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=60)


def probe_in_process(*args: str) -> dict:
    code = PROBE.format(heavy=HEAVY)
    out = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=60)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_live_passes_while_a_watcher_is_blind_and_check_fails(sockdir: str) -> None:
    emu: Emulator = start_emulator()
    try:
        emu.control("fault", {"mode": "status", "cloud": "*", "status": 404})  # GKE Workload Identity's answer
        sock = os.path.join(sockdir, "live.sock")
        d = start_daemon(sock, cloud="gcp", metadata_url=emu.url, extra_args=["--poll-interval", "0.1"])
        try:
            assert run("status", "--check", "--socket", sock).returncode == 1, "the watcher is blind: not ready"
            ok = run("status", "--live", "--socket", sock)
            assert ok.returncode == 0 and ok.stdout.startswith("ok:"), ok
            got = probe_in_process("status", "--live", "--json", "--socket", sock)
            assert got["rc"] == 0 and got["heavy"] == [], got
        finally:
            d.stop()
    finally:
        emu.stop()


def test_live_fails_without_a_daemon_and_on_a_socket_that_never_says_hello(sockdir: str) -> None:
    path = os.path.join(sockdir, "none.sock")
    gone = run("status", "--live", "--socket", path)
    assert gone.returncode == 1 and "cannot connect" in gone.stderr and "spotguard daemon --socket" in gone.stderr
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as mute:  # accepts (backlog), never answers: hung loop
        mute.bind(path)
        mute.listen(4)
        hung = run("status", "--live", "--timeout", "0.5", "--socket", path)
    assert hung.returncode == 1 and "no hello within 0.5s" in hung.stderr, hung
    os.unlink(path)
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as full:  # at its connection limit: refuses, but alive
        full.bind(path)
        full.listen(4)
        probe = subprocess.Popen([*CLI, "status", "--live", "--socket", path], stdout=subprocess.PIPE, text=True)
        conn, _ = full.accept()
        conn.sendall(b'{"type":"error","error":"too many connections (max 1)"}\n')
        assert probe.wait(60) == 0, "a daemon that answers with its refusal is alive"
        conn.close()
    bad = run("status", "--live", "--timeout", "soon")
    assert bad.returncode == 2 and "not a number of seconds" in bad.stderr


def test_the_probe_imports_only_the_standard_library(sockdir: str) -> None:
    got = probe_in_process("status", "--live", "--socket", os.path.join(sockdir, "absent.sock"))
    assert got["rc"] == 1 and got["heavy"] == [], got
    assert live.DEFAULT_SOCKET == DEFAULT_SOCKET
