"""Review 3: a final report for an id the daemon never saw, from a daemon that was never restarted (or from a
trainer the killed earlier life did not have, or after the window): no earlier life's report.

The hook reports every notice it saves under, its own included (a custom/API notice: ``hook.notify``; a
signal notice). A report for such an id is no earlier daemon life's: it must not stand for the trainer in
the notice the daemon is still waiting on.
"""

from __future__ import annotations

import asyncio
from datetime import timedelta

import pytest

from spotguard.daemon.client import Subscription
from spotguard.notice import Notice
from spotguard.timefmt import utcnow

from .conftest import FakeWatcher, running_daemon
from .loopback import LoopbackServer



async def test_a_report_for_an_own_id_without_a_restart_decides_nothing(sock_path: str) -> None:
    async with LoopbackServer() as hook:
        w = FakeWatcher("aws")
        async with running_daemon(sock_path, [w], webhook_url=hook.url):
            await asyncio.sleep(0.5)  # past this life's reconnect grace (0.3 s here): no restart anywhere
            t = await Subscription(sock_path, rank=0, job="train").open()
            now = utcnow()
            await w.push(Notice(id="aws-spot-1", source="aws", kind="preemption",
                                deadline=now + timedelta(seconds=30), received_at=now))
            n = await t.next_notice(timeout=5)
            await t.ack(n.id)
            await t.checkpoint_started(n.id, step=90)
            # an ordinary checkpoint of the trainer's own (an API rebalance notice) finishes meanwhile
            await t.checkpoint_done("api-rebalance-7", step=40)
            await t.status()
            with pytest.raises(AssertionError, match="got 0"):  # no outcome while the trainer still writes 90
                await hook.wait_requests(1, timeout=2)
            await t.checkpoint_done(n.id, step=90)
            (post,) = await hook.wait_requests(1, timeout=15)
    outcome = post.json()["outcome"]
    assert (outcome["status"], outcome["step"]) == ("committed", 90), outcome
