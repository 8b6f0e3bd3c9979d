"""r24 review: the rollout that upgrades from the previous version still sends a premature no_subscribers.

The first moments of a restarted daemon decide no outcome only if it *knows* it restarted: notices in the
state file, "subscribers" written by a clean stop of THIS version, or a stale socket (kill -9). The previous
version's clean stop removes the socket and writes no "subscribers" field (nor a state file without keyed
notices), so on the very rollout that deploys issue 24 a notice seen in the first second, while the trainers'
intakes are still in their <= 2 s reconnect backoff, is decided 'no_subscribers' at once -> asg.on_outcome
CompleteLifecycleAction CONTINUE (status in ("committed", "no_subscribers")) while the trainers are about to
checkpoint. Same when the state file is unreadable (other uid after a runAsUser change, write failed).

[older_version] failed before every daemon life waited the reconnect grace; [this_version] is the control.
"""
from __future__ import annotations

import asyncio

import pytest
import json
from datetime import timedelta

from .conftest import FakeWatcher, eventually, running_daemon, sock_path, sockdir  # noqa: F401
from .loopback import LoopbackServer
from spotguard.daemon.client import Subscription
from spotguard.daemon.persist import state_path_for
from spotguard.notice import Notice
from spotguard.timefmt import utcnow


def asg_notice(nid: str) -> Notice:
    now = utcnow()
    return Notice(id=nid, source="aws", kind="termination", deadline=now + timedelta(seconds=120),
                  received_at=now, detail="target-lifecycle-state=Terminated", key="asg|Terminated")


@pytest.mark.parametrize("previous", ["older_version", "this_version"])  # this_version passes (control)
async def test_notice_right_after_upgrade_waits_for_reconnecting_trainers(sock_path: str, previous: str) -> None:  # noqa: F811
    async with LoopbackServer() as hook:
        async with running_daemon(sock_path, [FakeWatcher("aws")], webhook_url=hook.url):
            t = await Subscription(sock_path, rank=0, job="train").open()  # a trainer, subscribed, no notice
            await asyncio.sleep(0.2)
        await t.close()
        # What the previous version leaves after its clean stop: no "subscribers" field.
        if previous == "older_version":
            with open(state_path_for(sock_path), "w") as f:
                json.dump({"format": 1, "notices": []}, f)
        w = FakeWatcher("aws")
        async with running_daemon(sock_path, [w], webhook_url=hook.url, reconnect_grace=3.0):
            await w.push(asg_notice("aws-asg-1"))  # the first IMDS poll, milliseconds after the bind
            await asyncio.sleep(1.0)  # the trainer's intake is still in its reconnect backoff
            early = [r.json()["outcome"]["status"] for r in hook.requests]
            t = await Subscription(sock_path, rank=0, job="train").open()  # reconnects, gets the replay
            n = await t.next_notice(timeout=5)
            await t.checkpoint_done(n.id, step=7)
            await asyncio.sleep(0.5)
            await t.close()
    assert early == [], f"outcome decided before the trainers could reconnect: {early} (ASG would CONTINUE)"
