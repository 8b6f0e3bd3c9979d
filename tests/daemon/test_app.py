"""The daemon as a whole: supervision, drills, approval, status, logs, and SIGTERM on a real process."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest
import structlog

from spotguard.daemon.client import Subscription, request
from spotguard.notice import Cancel
from spotguard.protocol import Drill, DrillOk, ErrorReply, StatusReply, StatusRequest
from spotguard.timefmt import parse_rfc3339

from .conftest import DaemonProc, FakeWatcher, eventually, make_notice, running_daemon


async def test_crashing_watcher_is_restarted_and_daemon_stays_up(sock_path: str) -> None:
    w = FakeWatcher("aws", crashes=3)
    with structlog.testing.capture_logs() as logs:
        async with running_daemon(sock_path, [w], restart_backoff=(0.01, 0.02)) as d:
            sub = await Subscription(sock_path).open()
            await w.push(make_notice("aws-after-crash"), timeout=10)  # consumed only by the 4th events() call
            assert (await sub.next_notice(timeout=5)).id == "aws-after-crash"
            assert w.calls == 4
            state = await sub.status()
            aws = next(x for x in state["watchers"] if x["source"] == "aws")
            assert aws["restarts"] == 3 and aws["running"] is True
            assert d.metrics.watcher_restarts.labels("aws")._value.get() == 3
            await sub.close()
    crashes = [r for r in logs if r["event"] == "watcher.crashed"]
    assert len(crashes) == 3 and all(r["source"] == "aws" for r in crashes)


async def test_watcher_whose_events_return_is_restarted(sock_path: str) -> None:
    class Once(FakeWatcher):
        async def events(self):  # type: ignore[override]
            self.calls += 1
            if self.calls == 1:
                return
            async for e in super().events():
                yield e

    w = Once("gcp")
    async with running_daemon(sock_path, [w]):
        sub = await Subscription(sock_path).open()
        await w.push(make_notice("gcp-1", source="gcp"), timeout=10)
        assert (await sub.next_notice(timeout=5)).id == "gcp-1"
        await sub.close()


@pytest.mark.serial
async def test_drill_is_delivered_with_fresh_ids(sock_path: str) -> None:
    async with running_daemon(sock_path) as d:
        sub = await Subscription(sock_path).open()
        r1 = await request(sock_path, Drill(kind="preemption", deadline_in=30))
        r2 = await request(sock_path, Drill(kind="maintenance", deadline_in=5))
        assert isinstance(r1, DrillOk) and isinstance(r2, DrillOk) and r1.id != r2.id
        n1 = await sub.next_notice(timeout=5)
        n2 = await sub.next_notice(timeout=5)
        assert (n1.id, n1.source, n1.kind) == (r1.id, "drill", "preemption")
        assert (n2.id, n2.kind) == (r2.id, "maintenance")
        assert abs(n1.seconds_left() - 30) < 2 and parse_rfc3339(r1.deadline) == n1.deadline
        assert d.metrics.notices.labels("drill", "preemption")._value.get() == 1
        await sub.close()


@pytest.mark.parametrize("drill, needle", [
    (Drill(kind="apocalypse", deadline_in=30), "unknown kind"),
    (Drill(kind="preemption", deadline_in=0), "deadline_in"),
    (Drill(kind="preemption", deadline_in=10**9), "deadline_in"),
])
async def test_bad_drill_gets_error_reply(sock_path: str, drill: Drill, needle: str) -> None:
    async with running_daemon(sock_path) as d:
        reply = await request(sock_path, drill)
        assert isinstance(reply, ErrorReply) and needle in reply.error
        assert d.book.total == 0


async def test_status_content(sock_path: str) -> None:
    w = FakeWatcher("azure")
    w.node = "vm-7"
    async with running_daemon(sock_path, [w], node=""):
        sub = await Subscription(sock_path, rank=3, local_rank=1, world_size=8, job="llm").open()
        await w.push(make_notice("az-1", source="azure", kind="termination"))
        await sub.next_notice(timeout=5)
        await sub.ack("az-1")
        await sub.checkpoint_started("az-1", 41)
        reply = await request(sock_path, StatusRequest())
        assert isinstance(reply, StatusReply)
        s = reply.state
        assert s["node"] == "vm-7" and s["cloud"] == "none"
        assert [x["source"] for x in s["watchers"]] == ["azure", "signal"]
        assert s["watchers"][0]["healthy"] is True and s["watchers"][0]["polls"] == 1
        (sub_info,) = s["subscribers"]
        assert (sub_info["rank"], sub_info["local_rank"], sub_info["world_size"], sub_info["job"]) == (3, 1, 8, "llm")
        assert sub_info["uid"] == os.getuid() and sub_info["pid"] == os.getpid()
        assert s["last_notice"]["id"] == "az-1"
        (active,) = s["active_notices"]
        (state,) = active["subscribers"].values()
        assert state["state"] == "checkpoint_started" and state["step"] == 41
        assert s["pid"] == os.getpid() and s["socket"] == sock_path
        await sub.close()


async def test_azure_approval_after_every_checkpoint_done(sock_path: str) -> None:
    w = FakeWatcher("azure")
    async with running_daemon(sock_path, [w], azure_ack_after_checkpoint=True):
        a = await Subscription(sock_path, rank=0).open()
        b = await Subscription(sock_path, rank=1).open()
        await w.push(make_notice("az-evt", source="azure"))
        await a.next_notice(timeout=5)
        await b.next_notice(timeout=5)
        await a.checkpoint_done("az-evt", step=10, uri="file:///ckpt", nbytes=1234, seconds=2.5)
        await a.status()  # round trip: the report was processed
        assert w.approved == []
        await b.checkpoint_done("az-evt", step=10)
        await asyncio.wait_for(w.approve_event.wait(), 5)
        await b.checkpoint_done("az-evt", step=10)  # repeated report: still approved once
        await b.status()
        assert [n.id for n in w.approved] == ["az-evt"]
        await a.close()
        await b.close()


async def test_no_approval_without_the_flag(sock_path: str) -> None:
    w = FakeWatcher("azure")
    async with running_daemon(sock_path, [w]):
        a = await Subscription(sock_path).open()
        await w.push(make_notice("az-evt", source="azure"))
        await a.next_notice(timeout=5)
        await a.checkpoint_done("az-evt", step=1)
        await a.status()
        assert w.approved == []
        await a.close()


async def test_expired_notice_is_not_replayed(sock_path: str) -> None:
    w = FakeWatcher("aws")
    async with running_daemon(sock_path, [w], expire_margin=0.0, housekeeping_interval=0.02) as d:
        with structlog.testing.capture_logs() as logs:
            await w.push(make_notice("aws-old", in_seconds=0.05))
            await eventually(lambda: d.book.get("aws-old") is None, what="expiry")
        assert any(r["event"] == "notice.expired" and r["notice_id"] == "aws-old" for r in logs)
        sub = await Subscription(sock_path).open()
        assert (await sub.status())["active_notices"] == []
        await sub.close()


@pytest.mark.serial
async def test_timeline_logs_carry_notice_id(sock_path: str) -> None:
    w = FakeWatcher("aws")
    with structlog.testing.capture_logs() as logs:
        async with running_daemon(sock_path, [w]) as d:
            subs = [await Subscription(sock_path, rank=i).open() for i in range(3)]
            await w.push(make_notice("aws-tl"))
            for s in subs:
                await s.next_notice(timeout=5)
            await eventually(lambda: not d.book.get("aws-tl").pending, what="writes done")
            await subs[0].ack("aws-tl")
            await subs[0].checkpoint_done("aws-tl", step=5, nbytes=10, seconds=0.5)
            await subs[0].status()
            await w.push(Cancel(id="aws-tl", source="aws"))
            for s in subs:
                await s.close()
    timeline = [r for r in logs if r.get("notice_id") == "aws-tl"]
    events = [r["event"] for r in timeline]
    for ev in ("notice.seen", "notice.delivered", "notice.acked", "notice.checkpoint_done", "notice.cancelled"):
        assert ev in events, events
    delivered = next(r for r in timeline if r["event"] == "notice.delivered")
    assert delivered["subscribers"] == 3 and delivered["latency_ms_max"] < 2000


# --- real process ------------------------------------------------------------------


def _sigterm_and_get_notice(dp: DaemonProc, sub: Subscription) -> "asyncio.Future":
    dp.proc.send_signal(signal.SIGTERM)
    return asyncio.ensure_future(sub.next_notice(timeout=10))


@pytest.mark.serial
async def test_sigterm_becomes_termination_notice_and_exit_after_checkpoint(spawn_daemon) -> None:
    dp = spawn_daemon("--sigterm-notice", "--sigterm-grace", "20")
    sub = await Subscription(dp.sock, rank=0).open()
    t0 = time.monotonic()
    notice = await _sigterm_and_get_notice(dp, sub)
    assert (notice.source, notice.kind) == ("signal", "termination")
    assert 17 < notice.seconds_left() <= 20.5
    await sub.ack(notice.id)
    await sub.checkpoint_done(notice.id, step=3, uri="file:///c", nbytes=100, seconds=0.1)
    rc = await asyncio.to_thread(dp.proc.wait, 10)
    assert rc == 0
    assert time.monotonic() - t0 < 8, "daemon should exit once the subscriber reported, long before the deadline"
    assert not os.path.exists(dp.sock)
    dp.wait_notify("STOPPING=1")
    records = dp.log_records()
    assert any(r.get("event") == "shutdown.ready" and r.get("notice_id") == notice.id for r in records)
    await sub.close()


@pytest.mark.serial
async def test_sigterm_exits_by_deadline_when_nobody_reports(spawn_daemon) -> None:
    dp = spawn_daemon("--sigterm-notice", "--sigterm-grace", "1.5")
    sub = await Subscription(dp.sock).open()
    t0 = time.monotonic()
    notice = await _sigterm_and_get_notice(dp, sub)
    assert notice.kind == "termination"
    rc = await asyncio.to_thread(dp.proc.wait, 10)
    elapsed = time.monotonic() - t0
    assert rc == 0
    assert 1.2 < elapsed < 5, elapsed
    await sub.close()


@pytest.mark.serial
async def test_sigterm_with_no_subscriber_exits_at_once(spawn_daemon) -> None:
    dp = spawn_daemon("--sigterm-notice", "--sigterm-grace", "30")
    t0 = time.monotonic()
    dp.proc.send_signal(signal.SIGTERM)
    assert await asyncio.to_thread(dp.proc.wait, 10) == 0
    assert time.monotonic() - t0 < 5


async def test_sigint_is_plain_shutdown(spawn_daemon) -> None:
    dp = spawn_daemon("--sigterm-grace", "30")
    sub = await Subscription(dp.sock).open()
    dp.proc.send_signal(signal.SIGINT)
    assert await asyncio.to_thread(dp.proc.wait, 10) == 0
    with pytest.raises(EOFError):
        await sub.next(timeout=5)  # no termination notice, just closed
    await sub.close()


async def test_huge_detail_is_truncated_to_fit_one_line(sock_path: str) -> None:
    w = FakeWatcher("azure")
    async with running_daemon(sock_path, [w]):
        sub = await Subscription(sock_path).open()
        await w.push(make_notice("az-huge", source="azure", detail="z" * 200_000))
        n = await sub.next_notice(timeout=5)
        assert n.id == "az-huge" and n.detail.endswith("[truncated]") and len(n.detail) < 5000
        await sub.close()


async def test_status_too_big_for_a_line_is_compacted(sock_path: str) -> None:
    async with running_daemon(sock_path) as d:
        real = d.status

        def bloated(compact: bool = False) -> dict:
            s = real(compact)
            if not compact:
                s["subscribers"] = [{"pad": "p" * 1000}] * 100
            return s

        d.status = bloated  # type: ignore[method-assign]
        reply = await request(sock_path, StatusRequest())
        assert isinstance(reply, StatusReply) and reply.state["cloud"] == "none"
        assert "subscribers_total" in reply.state


def test_second_daemon_on_same_socket_exits_2(spawn_daemon) -> None:
    first = spawn_daemon()
    second = spawn_daemon(sock=first.sock, wait_ready=False)
    assert second.proc.wait(20) == 2
    lines = second.stderr_now().strip().splitlines()
    assert len(lines) == 1 and "already serving" in lines[0], lines
    assert first.proc.poll() is None and os.path.exists(first.sock)


async def test_the_notice_loop_is_the_servers_handler_and_daemon_ingest_delegates(sock_path: str) -> None:
    """Wiring vs the notice loop (noticeloop.py): the server calls the loop, and ``Daemon.ingest`` (the name
    callers know) still delivers and books."""
    async with running_daemon(sock_path) as d:
        assert d.server is not None and d.server.handler is d.notices and d.notices.server is d.server
        sub = await Subscription(sock_path).open()
        entry = d.ingest(make_notice("direct-ingest"))
        assert entry is not None and d.book.get("direct-ingest") is entry and entry.broadcast_to == 1
        assert (await sub.next_notice(timeout=5)).id == "direct-ingest"
        await sub.close()


def test_the_notice_loop_asks_the_wiring_only_what_wiring_names() -> None:
    """The loop's one way back to ``Daemon`` is its ``Wiring`` protocol: a new ``self.wiring.x`` must be named
    there (so the two modules never share attributes silently)."""
    import ast
    from pathlib import Path

    import spotguard.daemon.noticeloop as nl

    tree = ast.parse(Path(nl.__file__).read_text(encoding="utf-8"))
    wiring = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Wiring")
    named = {n.target.id for n in wiring.body if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)}
    named |= {n.name for n in wiring.body if isinstance(n, ast.FunctionDef)}
    asked = {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Attribute)
             and n.value.attr == "wiring"}
    assert asked and asked <= named, sorted(asked - named)
    assert named == {"cloud", "node", "sources", "status", "sd_status", "request_stop"}
