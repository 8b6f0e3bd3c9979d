"""r24 review: false outcomes the restart-safe action layer still sends (webhook receiver on loopback).

Found by the review of issue 24 (the first failed before a final report stood for sibling emergency notices; the second held).
"""
from __future__ import annotations

import asyncio
from datetime import timedelta

from .conftest import FakeWatcher, eventually, running_daemon, sock_path, sockdir  # noqa: F401
from .loopback import LoopbackServer
from spotguard.daemon.client import Subscription
from spotguard.notice import Notice
from spotguard.timefmt import utcnow

GRACE = 1.5


def asg_notice(nid: str) -> Notice:
    now = utcnow()
    return Notice(id=nid, source="aws", kind="termination", deadline=now + timedelta(seconds=120),
                  received_at=now, detail="target-lifecycle-state=Terminated", key="asg|Terminated")


def spot_notice(nid: str) -> Notice:
    now = utcnow()
    return Notice(id=nid, source="aws", kind="preemption", deadline=now + timedelta(seconds=120),
                  received_at=now, detail="instance-action=terminate", key="spot|terminate")


async def test_two_emergency_notices_one_checkpoint_gives_one_true_outcome(sock_path: str) -> None:  # noqa: F811
    """A spot interruption inside an ASG: IMDS shows instance-action AND target-lifecycle-state=Terminated.
    The hook checkpoints once and reports checkpoint_done for the one notice it acted on (save.py _finish_ok),
    then exits. Claim: exactly one true outcome. Seen: the ASG notice's outcome is 'incomplete' (false Warning
    Event/webhook/Slack), so asg.on_outcome never completes the hook: the VM idles until HeartbeatTimeout."""
    w = FakeWatcher("aws")
    async with LoopbackServer() as hook:
        async with running_daemon(sock_path, [w], webhook_url=hook.url):
            t = await Subscription(sock_path, rank=0, job="train").open()
            await w.push(spot_notice("aws-spot-1"))
            await w.push(asg_notice("aws-asg-1"))
            a = await t.next_notice(timeout=5)
            await t.next_notice(timeout=5)
            await t.checkpoint_started(a.id, step=40)
            await t.checkpoint_done(a.id, step=40)
            await t.close()  # the trainer exits 143 after its commit
            await eventually(lambda: len(hook.requests) >= 2, timeout=10, what="two outcomes")
            await asyncio.sleep(0.3)
        statuses = {r.json()["notice"]["id"]: r.json()["outcome"]["status"] for r in hook.requests}
    assert set(statuses.values()) == {"committed"}, statuses


async def test_two_trainers_same_pid_rank_job_restart_gives_true_outcome(sock_path: str) -> None:  # noqa: F811
    """Two trainer pods on one node, both PID 7 in their containers, rank 0, TORCHELASTIC_RUN_ID=none (torchrun's
    default): the subscriber key pid:rank:job collides. After a daemon restart both reconnect within the grace
    and both report checkpoint_done. Claim: one true outcome ('committed'); seen: 'unreported'."""
    async with LoopbackServer() as hook:
        w = FakeWatcher("aws")
        async with running_daemon(sock_path, [w], webhook_url=hook.url, reconnect_grace=GRACE):
            a = await Subscription(sock_path, pid=7, rank=0, job="none").open()
            b = await Subscription(sock_path, pid=7, rank=0, job="none").open()
            await w.push(asg_notice("aws-asg-life1"))
            n = await a.next_notice(timeout=5)
            await b.next_notice(timeout=5)
            await a.checkpoint_started(n.id, step=40)
            await b.checkpoint_started(n.id, step=40)
            await asyncio.sleep(0.5)
        await a.close()
        await b.close()
        w = FakeWatcher("aws")
        async with running_daemon(sock_path, [w], webhook_url=hook.url, reconnect_grace=GRACE):
            await w.push(asg_notice("aws-asg-fresh"))
            a = await Subscription(sock_path, pid=7, rank=0, job="none").open()
            b = await Subscription(sock_path, pid=7, rank=0, job="none").open()
            await a.next_notice(timeout=5)
            await b.next_notice(timeout=5)
            await a.checkpoint_done(n.id, step=40)
            await b.checkpoint_done(n.id, step=40)
            await eventually(lambda: len(hook.requests) >= 1, timeout=10, what="the outcome")
            await a.close()
            await b.close()
        statuses = [r.json()["outcome"]["status"] for r in hook.requests]
    assert statuses == ["committed"], statuses
