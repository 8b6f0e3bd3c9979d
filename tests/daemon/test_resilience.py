"""Daemon resilience: kill -9 and restart with a notice active (same id, same deadline), clock jumps,
the notice state file's own defences, and memory over 10 000 polls with errors mixed in."""

from __future__ import annotations

import asyncio
import gc
import json
import os
import signal
import subprocess
import time
from datetime import timedelta
from typing import Any, Optional

import pytest

from spotguard.daemon import book as book_mod
from spotguard.daemon.book import NoticeBook
from spotguard.daemon.client import DaemonUnavailable, Subscription, request
from spotguard.daemon.persist import NoticeState, parse_state, state_path_for
from spotguard.daemon.watchers.aws import AwsWatcher
from spotguard.daemon.watchers.azure import AzureWatcher
from spotguard.daemon.watchers.base import Backoff
from spotguard.emulator.server import running_emulator
from spotguard.notice import Notice
from spotguard.protocol import StatusReply, StatusRequest
from spotguard.timefmt import to_rfc3339, utcnow

from .conftest import REPO, daemon_cmd, make_notice, running_daemon


# --- helpers ---------------------------------------------------------------------------


async def _status(sock: str, timeout: float = 2.0) -> dict[str, Any]:
    reply = await request(sock, StatusRequest(), timeout=timeout)
    assert isinstance(reply, StatusReply), reply
    return reply.state


async def _until(pred: Any, timeout: float, what: str) -> Any:
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    last: Any = None
    while loop.time() < end:
        try:
            val = await pred()
        except (DaemonUnavailable, OSError, asyncio.TimeoutError) as exc:
            val, last = None, exc
        if val:
            return val
        await asyncio.sleep(0.05)  # polling another process's state: nothing to await
    raise AssertionError(f"timed out waiting for {what} (last error {last!r})")


class _Daemon:
    """A real ``spotguard daemon`` process (asyncio subprocess, so the in-process emulator keeps running)."""

    def __init__(self, sock: str, log: str, *args: str) -> None:
        self.sock, self.log, self.args = sock, log, args
        self.proc: Optional[asyncio.subprocess.Process] = None

    async def start(self) -> "_Daemon":
        env = {k: v for k, v in os.environ.items() if not k.startswith("SPOTGUARD_") and k != "NOTIFY_SOCKET"}
        with open(self.log, "ab") as f:
            self.proc = await asyncio.create_subprocess_exec(
                *daemon_cmd("--socket", self.sock, "--log-format", "json", *self.args),
                stdout=f, stderr=subprocess.STDOUT, env=env, cwd=REPO)

        async def up() -> bool:
            assert self.proc is not None
            if self.proc.returncode is not None:
                raise AssertionError(f"daemon exited {self.proc.returncode}: {open(self.log).read()[-3000:]}")
            return (await _status(self.sock))["pid"] == self.proc.pid

        await _until(up, 20, "daemon ready")
        return self

    async def kill9(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        await self.proc.wait()

    async def stop(self) -> None:
        if self.proc is not None and self.proc.returncode is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                await asyncio.wait_for(self.proc.wait(), 10)
            except asyncio.TimeoutError:
                self.proc.kill()
                await self.proc.wait()

    def records(self) -> list[dict[str, Any]]:
        out = []
        for line in open(self.log, errors="replace"):
            try:
                out.append(json.loads(line))
            except ValueError:
                pass
        return out


# --- kill -9 with an active notice ------------------------------------------------------


@pytest.mark.parametrize("cloud,extra_config", [
    ("gcp", {}),
    ("aws", {}),
    ("aws", {"aws_recompute_time": True}),  # a mock that recomputes `time` on every request
    ("azure", {}),
], ids=["gcp", "aws", "aws-recomputed-time", "azure"])
async def test_kill9_restart_keeps_notice_id_and_deadline(sockdir: str, cloud: str,
                                                          extra_config: dict[str, Any]) -> None:
    sock = os.path.join(sockdir, "r.sock")
    async with running_emulator(azure_rate_limit=0, **extra_config) as emu:
        args = ("--cloud", cloud, "--metadata-url", emu.url, "--poll-interval", "0.2")
        first = await _Daemon(sock, os.path.join(sockdir, "d1.log"), *args).start()
        second: Optional[_Daemon] = None
        try:
            async with Subscription(sock, rank=0) as sub:
                emu.notice(cloud, "preemption", 120)
                before = await sub.next_notice(timeout=20)
            # Written off the delivery path, just after it (a kill -9 in those few ms loses only the id).
            await _until(lambda: _persisted(sock, before.id), 10, "the state file")
            await first.kill9()
            assert os.path.exists(sock), "kill -9 leaves the socket file behind (stale)"
            second = await _Daemon(sock, os.path.join(sockdir, "d2.log"), *args).start()  # stale socket handled
            async with Subscription(sock, rank=1) as sub2:  # a new subscriber (restarted trainer)
                after = await sub2.next_notice(timeout=20)
                state = await sub2.status()
            assert after.id == before.id, (before, after)
            assert after.deadline == before.deadline and after.received_at == before.received_at
            assert [n["id"] for n in state["active_notices"]] == [before.id]
            restored = [r for r in second.records() if r.get("event") == "notice.restored"]
            assert restored and restored[0]["notice_id"] == before.id
            # Repeated polls after the restart never produce a second notice.
            await _until(lambda: _polled(sock, cloud, 1 if cloud == "gcp" else 3), 15, "more polls")
            assert [n["id"] for n in (await _status(sock))["active_notices"]] == [before.id]
            # The provider withdraws it: the cancel carries the persisted id, and the file forgets it.
            if cloud != "aws":
                emu.cancel(cloud)
                async with Subscription(sock, rank=2) as sub3:
                    await _until(lambda: _no_active(sock), 15, "the cancel")
                    del sub3
                async def forgotten() -> bool:  # written off the delivery path, just after the cancel
                    return json.loads(open(state_path_for(sock)).read())["notices"] == []

                await _until(forgotten, 10, "the state file to forget the cancelled notice")
        finally:
            await first.stop()
            if second is not None:
                await second.stop()


async def _persisted(sock: str, notice_id: str) -> bool:
    """The state file (written off the delivery path) names the notice."""
    try:
        saved = json.loads(open(state_path_for(sock)).read())
    except (OSError, ValueError):
        return False
    return any(n["id"] == notice_id for n in saved["notices"])


async def _polled(sock: str, cloud: str, n: int) -> bool:
    st = await _status(sock)
    w = [w for w in st["watchers"] if w["source"] == cloud]
    return bool(w) and w[0]["polls"] >= n


async def _no_active(sock: str) -> bool:
    return (await _status(sock))["active_notices"] == []


async def test_reconnecting_subscriber_gets_the_notice_again_after_restart(sockdir: str) -> None:
    """The same subscriber connection is lost with the daemon; on reconnect it is replayed the same notice."""
    sock = os.path.join(sockdir, "r.sock")
    async with running_emulator() as emu:
        args = ("--cloud", "gcp", "--metadata-url", emu.url)
        d1 = await _Daemon(sock, os.path.join(sockdir, "d1.log"), *args).start()
        d2: Optional[_Daemon] = None
        try:
            sub = await Subscription(sock, rank=0).open()
            emu.notice("gcp", "termination", 60)
            first = await sub.next_notice(timeout=20)
            await _until(lambda: _persisted(sock, first.id), 10, "the state file")
            await d1.kill9()
            with pytest.raises((EOFError, ConnectionError)):
                while True:
                    await sub.next(timeout=5)
            await sub.close()
            d2 = await _Daemon(sock, os.path.join(sockdir, "d2.log"), *args).start()
            async with Subscription(sock, rank=0) as again:
                replayed = await again.next_notice(timeout=20)
            assert (replayed.id, replayed.deadline, replayed.kind) == (first.id, first.deadline, "termination")
        finally:
            await d1.stop()
            if d2 is not None:
                await d2.stop()


async def test_in_process_restart_keeps_id_and_expired_entries_are_dropped(sockdir: str) -> None:
    """Same rule without processes: a keyed notice re-yielded under a fresh id keeps the first id."""
    from .conftest import FakeWatcher

    sock = os.path.join(sockdir, "p.sock")
    n1 = Notice(id="gcp-first", source="gcp", kind="preemption", deadline=utcnow() + timedelta(seconds=30),
                key="instance/preempted|TRUE|abc")
    w = FakeWatcher("gcp")
    async with running_daemon(sock, [w]) as d:
        await w.push(n1)
        assert [n.id for n in d.book.notices()] == ["gcp-first"]
    w2 = FakeWatcher("gcp")
    n2 = Notice(id="gcp-second", source="gcp", kind="preemption", deadline=utcnow() + timedelta(seconds=30),
                key="instance/preempted|TRUE|abc")
    async with running_daemon(sock, [w2]) as d:
        await w2.push(n2)
        [got] = d.book.notices()
        assert (got.id, to_rfc3339(got.deadline)) == ("gcp-first", to_rfc3339(n1.deadline))  # ms on the wire
        from spotguard.notice import Cancel

        await w2.push(Cancel(id="gcp-second", source="gcp"))  # the watcher cancels by its own id
        assert d.book.notices() == []
    # An entry whose deadline passed long ago is not restored.
    old = Notice(id="gcp-old", source="gcp", kind="preemption", deadline=utcnow() - timedelta(hours=1), key="k")
    NoticeState(state_path_for(sock)).save([old])
    w3 = FakeWatcher("gcp")
    async with running_daemon(sock, [w3]) as d:
        await w3.push(Notice(id="gcp-new", source="gcp", kind="preemption",
                             deadline=utcnow() + timedelta(seconds=30), key="k"))
        assert [n.id for n in d.book.notices()] == ["gcp-new"]


# --- the state file's defences ----------------------------------------------------------


def test_state_file_refuses_symlink_foreign_owner_and_garbage(sockdir: str) -> None:
    path = os.path.join(sockdir, "s.sock.notices.json")
    good = Notice.from_wire(make_notice("aws-1", in_seconds=60).to_wire())  # millisecond precision, as on the wire
    good = Notice(**{**good.__dict__, "key": "spot|x"})
    st = NoticeState(path)
    assert st.save([good]) and list(st.load().values()) == [good]
    mode = os.stat(path).st_mode & 0o777
    assert mode == 0o600, oct(mode)
    # A symlink planted at the path is never followed for reading.
    target = os.path.join(sockdir, "target.json")
    os.replace(path, target)
    os.symlink(target, path)
    assert NoticeState(path).load() == {}
    # ...and writing replaces the link itself, leaving its target alone.
    before = open(target).read()
    assert NoticeState(path).save([good])
    assert not os.path.islink(path) and open(target).read() == before
    # A file owned by another uid is ignored.
    if os.geteuid() == 0:
        os.chown(path, 65534, 65534)
        assert NoticeState(path).load() == {}
        os.chown(path, 0, 0)
    # Garbage: never raises, loads nothing.
    for junk in (b"", b"\xff\xfe", b"[]", b'{"format": 1, "notices": [1, {"key": 3}]}', b"{" * 100000):
        with open(path, "wb") as f:
            f.write(junk)
        assert NoticeState(path).load() == {}
    # A FIFO does not block the daemon's start.
    os.unlink(path)
    os.mkfifo(path)
    assert NoticeState(path).load() == {}


def test_state_write_failure_is_logged_not_raised(sockdir: str) -> None:
    st = NoticeState(os.path.join(sockdir, "no-such-dir", "x.json"))
    n = Notice(id="a", source="aws", kind="preemption", deadline=utcnow() + timedelta(seconds=60), key="k")
    assert st.save([n]) is False
    assert parse_state(b"not json")[0] == {}


# --- clock jumps -----------------------------------------------------------------------


def test_wall_clock_jump_does_not_expire_or_keep_notices(monkeypatch: pytest.MonkeyPatch) -> None:
    """Expiry runs on the monotonic clock: a wall-clock step of hours changes nothing; monotonic time does."""
    book = NoticeBook(expire_margin=60)
    book.add(make_notice("n", in_seconds=30))
    real = utcnow()
    monkeypatch.setattr(book_mod, "utcnow", lambda: real + timedelta(hours=5))  # NTP step forward
    assert book.expire() == [] and [n.id for n in book.notices()] == ["n"]
    monkeypatch.setattr(book_mod, "utcnow", lambda: real - timedelta(hours=5))  # and backward
    assert book.expire() == []
    monkeypatch.setattr(book_mod, "utcnow", lambda: real)
    mono = time.monotonic()
    monkeypatch.setattr(book_mod.time, "monotonic", lambda: mono + 95)  # 30 s deadline + 60 s margin passed
    assert [e.id for e in book.expire()] == ["n"]


@pytest.mark.serial
async def test_sigterm_grace_waits_on_monotonic_time(sockdir: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The SIGTERM wait computes its end once, then counts loop (monotonic) time: a wall jump mid-wait
    does not end it early."""
    from spotguard.daemon import app as app_mod
    from spotguard import notice as notice_mod

    sock = os.path.join(sockdir, "t.sock")
    async with running_daemon(sock, sigterm_grace=1.5, sigterm_notice=True) as d:
        async with Subscription(sock, rank=0) as sub:
            loop = asyncio.get_running_loop()
            t0 = loop.time()
            d._on_sigterm()
            await sub.next_notice(timeout=5)
            real = utcnow()
            monkeypatch.setattr(notice_mod, "utcnow", lambda: real + timedelta(hours=3))
            monkeypatch.setattr(app_mod, "utcnow", lambda: real + timedelta(hours=3))
            await asyncio.wait_for(d._stop.wait(), 10)
            waited = loop.time() - t0
    assert 1.2 < waited < 5, waited


# --- memory over a long run of polls -----------------------------------------------------


def _rss_kib() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


@pytest.mark.serial
@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize("cloud", ["azure", "aws"])
async def test_memory_flat_over_10000_polls_with_errors(sockdir: str, cloud: str, capsys: Any) -> None:
    """10 000 polls (faults every few hundred: 503, garbage, reset, hang) through a daemon; RSS stays flat."""
    sock = os.path.join(sockdir, "m.sock")
    polls = 10_000
    async with running_emulator(azure_rate_limit=0) as emu:
        # polls back to back (an interval below any exchange's ~1 ms: the loop never sleeps after a good answer,
        # which on a 2-core box cost ~1-10 ms of timer wake-up a poll: Azure polls one path, serially) and a
        # 0.1 s timeout for the "hang" faults (18 of them; a good exchange takes ~1 ms, so still only a hang)
        if cloud == "azure":
            w: Any = AzureWatcher(emu.url, poll_interval=1e-6, min_request_spacing=0.0, request_timeout=0.1,
                                  vm_name=None)
        else:
            w = AwsWatcher(emu.url, poll_interval=1e-6, request_timeout=0.1, put_timeout=0.1)
        # the poll loops' backoff (one per path, from this factory): Azure's own starts at 0.25 s (IMDS's rate
        # limit), which would make the ~120 injected faults cost ~70 s of sleeping
        w._new_backoff = lambda: Backoff(base=0.0005, cap=0.002)
        async with running_daemon(sock, [w], housekeeping_interval=0.05) as d:
            async with Subscription(sock, rank=0) as sub:
                marks: dict[int, int] = {}
                modes = ["status", "malformed", "reset", "status", "content_type", "hang"]
                i = 0
                t0 = time.monotonic()
                while w.health.polls < polls:
                    await asyncio.sleep(0.01)
                    p = w.health.polls
                    if p // 250 > i:
                        i = p // 250
                        mode = modes[i % len(modes)]
                        extra = {"status": 503} if mode == "status" else {}
                        emu.fault(mode, cloud=cloud, count=3, **extra)
                        if i % 8 == 0:  # notices come and go as well
                            emu.notice(cloud, "maintenance" if cloud == "aws" else "preemption", 600)
                        if i % 8 == 4:
                            emu.reset()
                            emu.configure(azure_rate_limit=0)
                    for mark in (1000, 5000, polls):
                        if p >= mark and mark not in marks:
                            gc.collect()
                            marks[mark] = _rss_kib()
                    assert time.monotonic() - t0 < 200, f"only {p} polls"
                seconds = time.monotonic() - t0
                state = await sub.status()
    errors = w.health.errors
    growth = marks[polls] - marks[1000]
    with capsys.disabled():
        print(f"\n[rss] {cloud}: {w.health.polls} polls ({errors} errors) in {seconds:.1f}s; RSS KiB after "
              f"1000={marks[1000]} 5000={marks[5000]} {polls}={marks[polls]} (growth {growth} KiB); "
              f"book seen={len(d.book._seen)} active={len(state['active_notices'])}")
    assert errors >= 50, "faults must be mixed in"
    assert growth < 4096, f"RSS grew {growth} KiB between 1000 and {polls} polls"
