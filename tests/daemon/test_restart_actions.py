"""Issue 24: cluster actions that survive the daemon's own restarts.

A restart (rollout, liveness kill, OOM) in the middle of a notice must neither decide the outcome before the
trainers reconnect (``no_subscribers`` -> ``CompleteLifecycleAction CONTINUE`` while they checkpoint), nor
send a false outcome because the daemon's own stop disconnected them (``incomplete``), nor send an outcome
twice. Real parts: in-process daemons on a real socket and state file, moto's Auto Scaling on loopback
(``moto_asg.py``), a loopback webhook receiver. The kill -9 variants run in tests/chaos/test_daemon_chaos.py.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from datetime import timedelta
from typing import Any

import pytest
import structlog

from spotguard.daemon.client import Subscription
from spotguard.daemon.persist import NoticeState, state_path_for
from spotguard.notice import Notice
from spotguard.timefmt import utcnow

from .conftest import FakeWatcher, eventually, running_daemon
from .loopback import LoopbackServer
from .fake_kube import kubeconfig_env  # noqa: F401 - a fixture
from .test_actions_asg import REGION, Moto, moto  # noqa: F401 - the fixture

GRACE = 2.5  # --reconnect-grace here (the default is 10 s); longer than the intake's 2 s of reconnect jitter


def asg_notice(nid: str, in_seconds: float = 120) -> Notice:
    """The AWS watcher's ASG notice: its content key is what a restarted daemon recognises it by."""
    now = utcnow()
    return Notice(id=nid, source="aws", kind="termination", deadline=now + timedelta(seconds=in_seconds),
                  received_at=now, detail="target-lifecycle-state=Terminated", key="asg|Terminated")


def aws_watcher(instance_id: str) -> FakeWatcher:
    w = FakeWatcher("aws")
    w.identity = {"instanceId": instance_id, "region": REGION}  # type: ignore[attr-defined]
    return w


def _completes(moto: Moto) -> list[dict[str, Any]]:
    return [c for c in moto.calls() if c["action"] == "CompleteLifecycleAction"]


def _saved_state(sock: str) -> dict[str, Any]:
    try:
        return json.loads(open(state_path_for(sock)).read())
    except (OSError, ValueError):
        return {}


def _subscriber_states(sock: str) -> list[str]:
    return [s["state"] for n in _saved_state(sock).get("notices", [])
            for s in n.get("actions", {}).get("subscribers", {}).values()]


async def _first_life(sock: str, moto: Moto, hook: LoopbackServer, iid: str) -> str:
    """A notice reaches one trainer, whose checkpoint starts; then the daemon stops (a rollout's SIGTERM)."""
    w = aws_watcher(iid)
    async with running_daemon(sock, [w], asg_lifecycle_hook="auto", webhook_url=hook.url,
                              reconnect_grace=GRACE):
        a = await Subscription(sock, rank=0, job="train").open()
        await w.push(asg_notice("aws-asg-life1"))
        n = await a.next_notice(timeout=5)
        await a.checkpoint_started(n.id, step=40)
        await eventually(lambda: bool(_saved_state(sock).get("notices")), timeout=10, what="the state file")
        await asyncio.sleep(0.3)  # the report's action state is written the same way, just after it
        await eventually(lambda: len(moto.calls()) >= 1, timeout=15, what="a heartbeat")
    await a.close()
    return n.id


async def test_clean_stop_during_a_notice_sends_no_outcome(sock_path: str, moto: Moto) -> None:  # noqa: F811
    """server.close() disconnects every trainer: that is the daemon leaving, not the trainers. Before: the
    outcome became 'incomplete' (a false Warning Event / webhook / Slack message on every rollout)."""
    iid = moto.group("stop-asg")
    async with LoopbackServer() as hook:
        with structlog.testing.capture_logs() as logs:
            await _first_life(sock_path, moto, hook, iid)
        await asyncio.sleep(0.5)
        assert hook.requests == [], [r.json()["outcome"] for r in hook.requests]
    assert not [r for r in logs if r["event"] == "action.outcome"]
    assert _completes(moto) == []
    assert _subscriber_states(sock_path) == ["checkpoint_started"], "the next life needs what was reported"


async def test_restarted_daemon_waits_for_the_trainers_then_sends_one_true_outcome(
        sock_path: str, moto: Moto) -> None:  # noqa: F811
    """The restored notice reached a trainer in the earlier life: nothing is decided before it reconnects
    (before: no_subscribers at once, CONTINUE while it still checkpointed); once it reports, exactly one
    committed outcome, one webhook, one CONTINUE - after the commit."""
    iid = moto.group("restart-asg")
    async with LoopbackServer() as hook:
        nid = await _first_life(sock_path, moto, hook, iid)
        w = aws_watcher(iid)
        with structlog.testing.capture_logs() as logs:
            async with running_daemon(sock_path, [w], asg_lifecycle_hook="auto", webhook_url=hook.url,
                                      reconnect_grace=GRACE):
                await w.push(asg_notice("aws-asg-fresh-id"))  # the watcher's fresh id for the same notice
                await asyncio.sleep(1.5)  # the trainer's intake is still backing off
                assert _completes(moto) == [] and hook.requests == [], "decided before the trainer reconnected"
                b = await Subscription(sock_path, rank=0, job="train").open()  # the same trainer, reconnected
                n = await b.next_notice(timeout=5)
                assert n.id == nid
                await asyncio.sleep(GRACE)  # past the grace: still waiting for its report
                assert _completes(moto) == [] and hook.requests == []
                committed_at = time.time()
                await b.checkpoint_done(nid, step=40)
                await eventually(lambda: len(_completes(moto)) == 1 and len(hook.requests) == 1, timeout=15,
                                 what="the outcome")
                await asyncio.sleep(0.5)
                await b.close()
        assert [c["result"] for c in _completes(moto)] == ["CONTINUE"]
        assert _completes(moto)[0]["t"] >= committed_at
        (post,) = hook.requests
        assert post.json()["outcome"]["status"] == "committed" and post.json()["outcome"]["step"] == 40
        assert post.headers["Idempotency-Key"].startswith("spotguard-")
    (outcome,) = [r for r in logs if r["event"] == "action.outcome"]
    assert outcome["lives"] == 2


async def test_trainer_that_never_returns_is_unreported_never_no_subscribers(
        sock_path: str, moto: Moto) -> None:  # noqa: F811
    """Reached before the restart, gone since (its checkpoint_done may have been lost with the daemon): after
    the grace the outcome says so; it is not 'no_subscribers' and completes nothing."""
    iid = moto.group("gone-asg")
    async with LoopbackServer() as hook:
        await _first_life(sock_path, moto, hook, iid)
        w = aws_watcher(iid)
        async with running_daemon(sock_path, [w], asg_lifecycle_hook="auto", webhook_url=hook.url,
                                  reconnect_grace=GRACE):
            t0 = time.monotonic()
            await w.push(asg_notice("aws-asg-fresh-2"))
            (post,) = await hook.wait_requests(1, timeout=GRACE + 10)
            assert time.monotonic() - t0 >= GRACE - 0.1
            await asyncio.sleep(0.3)
    assert post.json()["outcome"]["status"] == "unreported"
    assert "daemon restart" in post.json()["summary"]
    assert _completes(moto) == []


async def test_outcome_sent_in_an_earlier_life_is_never_sent_again(sock_path: str, moto: Moto) -> None:  # noqa: F811
    iid = moto.group("once-asg")
    async with LoopbackServer() as hook:
        w = aws_watcher(iid)
        async with running_daemon(sock_path, [w], asg_lifecycle_hook="auto", webhook_url=hook.url,
                                  reconnect_grace=GRACE):
            a = await Subscription(sock_path, rank=0).open()
            await w.push(asg_notice("aws-asg-once"))
            n = await a.next_notice(timeout=5)
            await a.checkpoint_done(n.id, step=5)
            await eventually(lambda: len(_completes(moto)) == 1 and len(hook.requests) == 1, timeout=15,
                             what="the outcome")
            await eventually(lambda: any(sorted(x.get("actions", {}).get("sent", [])) == ["asg", "webhook"]
                                         for x in _saved_state(sock_path).get("notices", [])),
                             timeout=10, what="'sent' persisted")
            await a.close()
        w2 = aws_watcher(iid)
        with structlog.testing.capture_logs() as logs:
            async with running_daemon(sock_path, [w2], asg_lifecycle_hook="auto", webhook_url=hook.url,
                                      reconnect_grace=GRACE):
                await w2.push(asg_notice("aws-asg-once-again"))
                await eventually(lambda: any(r["event"] == "action.outcome_restored" for r in logs), timeout=5,
                                 what="the restored outcome")
                await asyncio.sleep(GRACE + 0.5)
        assert len(hook.requests) == 1 and len(_completes(moto)) == 1
    (restored,) = [r for r in logs if r["event"] == "action.outcome_restored"]
    assert restored["status"] == "committed" and restored["sending"] == []


@pytest.mark.serial
async def test_state_file_fsync_is_off_the_delivery_path(sock_path: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """SkyPilot keeps the socket (and so the state file) under $HOME on disk: a 0.5 s fsync must not delay the
    notice (before: it ran on the event loop before the writers, 0.52 s); the state still persists."""
    real_fsync = os.fsync

    def slow_fsync(fd: int) -> None:
        time.sleep(0.5)
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", slow_fsync)
    w = FakeWatcher("gcp")
    async with running_daemon(sock_path, [w]) as d:
        a = await Subscription(sock_path).open()
        n = Notice(id="gcp-slowdisk", source="gcp", kind="preemption", deadline=utcnow() + timedelta(seconds=60),
                   key="instance/preempted|TRUE|slow")
        t0 = time.monotonic()
        w.push_nowait(n)
        got = await a.next_notice(timeout=5)
        latency = time.monotonic() - t0
        assert got.id == n.id
        assert latency < 0.25, f"notice took {latency:.3f}s behind a 0.5 s fsync"
        await eventually(lambda: any(x["id"] == n.id for x in _saved_state(sock_path).get("notices", [])),
                         timeout=5, what="the state file")
        await a.close()
        del d
    # What a daemon started after a kill -9 at this point reads:
    restored = NoticeState(state_path_for(sock_path)).load()
    assert [x.id for x in restored.values()] == [n.id]


def test_second_daemon_on_a_served_socket_waits_then_exits_2(spawn_daemon: Any, sockdir: str) -> None:
    """docs/deploy.md: a successor started while its predecessor still serves the socket waits up to
    TAKEOVER_WAIT (5 s) for it to stop, then exits 2 and never displaces it (the doc said 'then takes it')."""
    from spotguard.daemon.app import TAKEOVER_WAIT

    first = spawn_daemon()
    t0 = time.monotonic()
    second = spawn_daemon(sock=first.sock, wait_ready=False)
    rc = second.proc.wait(30)
    waited = time.monotonic() - t0
    assert rc == 2, second.stderr_now()[-2000:]
    assert TAKEOVER_WAIT <= waited < TAKEOVER_WAIT + 8, waited  # + interpreter start-up on a busy host
    assert "already serving" in second.stderr_now()
    assert first.proc.poll() is None and os.path.exists(first.sock), "the live daemon was displaced"
    doc = open(os.path.join(os.path.dirname(__file__), "..", "..", "docs", "deploy.md")).read()
    assert "waits up to 5 s for it to stop" in doc and "exits 2" in doc


@pytest.mark.parametrize("doc", [
    None, [], "x", 1, {"subscribers": []}, {"subscribers": {"1:0:": "done"}}, {"subscribers": {"k": {"state": 3}}},
    {"outcome": {"status": 1}}, {"outcome": {"status": "committed", "reason": "reported", "subscribers": "x"}},
    {"sent": "asg"}, {"sent": [1, "webhook"]}, {"lives": True}, {"lives": -1}, {"lives": 10 ** 40},
    {"notes": {"asg": {"heartbeats": [1]}}}, {"notes": []},
    {"subscribers": {str(i): {"state": "acked", "step": {"x": 1}} for i in range(2000)}},
])
def test_action_state_from_a_damaged_file_never_raises(doc: Any) -> None:
    """The state file is outside input: every field is checked, anything malformed is dropped."""
    from spotguard.daemon.actions import ActionState

    st = ActionState.from_dict(doc)
    json.dumps(st.to_dict())
    assert len(st.subscribers) <= 512 and st.lives >= 1
    assert all(isinstance(x, str) for x in st.sent)


async def test_a_true_outcome_is_never_swallowed_by_an_earlier_event(kubeconfig_env: Any) -> None:
    """The pod Event is named from the notice and its outcome: a false 'incomplete' Event of an earlier daemon
    life (or any earlier outcome) cannot make the true 'committed' one a 409 counted as success, never written."""
    pytest.importorskip("kubernetes_asyncio")
    from spotguard.daemon.actions import Outcome, SubscriberOutcome
    from spotguard.daemon.actions.kubernetes import KubernetesAction

    from .fake_kube import FakeKube

    async with FakeKube(node_name="node-a") as kube:
        kube.add_pod("ml", "p")
        kubeconfig_env(kube)
        act = KubernetesAction("node-a")
        await act.start()
        try:
            notice = asg_notice("aws-two-outcomes")
            started = SubscriberOutcome(client=1, state="checkpoint_started", pod="p", namespace="ml")
            done = SubscriberOutcome(client=1, state="checkpoint_done", step=9, pod="p", namespace="ml")
            assert await act.on_outcome(Outcome(notice, "node-a", "reported", (started,))) is True
            assert await act.on_outcome(Outcome(notice, "node-a", "reported", (done,))) is True
            assert await act.on_outcome(Outcome(notice, "node-a", "reported", (done,))) is True  # a repeat: 409
        finally:
            await act.close()
    events = [e for e in kube.events if e["involvedObject"]["kind"] == "Pod"]
    assert [e["type"] for e in events] == ["Warning", "Normal"], [e["message"] for e in events]
    assert "committed at step 9" in events[1]["message"]
    assert [s for m, p, s, _ in kube.log if p.endswith("/ml/events")] == [201, 201, 409]


# --- kill -9 before the notice reached the state file ------------------------------------------------------
# The state file is written from a worker thread just after the fan-out: a kill -9 in between leaves no trace
# of the notice, so the next life sees the same provider notice under a new id. A trainer reached by the
# earlier life checkpoints once and reports for the id it got (which this life never saw). Before: the report
# was dropped as `report.unknown_notice`, the new id ended `incomplete` once the trainer left (daemon chaos,
# SIGKILL before_delivery), or `no_subscribers` when it left before the new id was seen. The earlier life is
# simply absent here: that is exactly what such a kill leaves (the id it delivered is all the trainer knows).


async def _killed_life(sock_path: str, **daemon_kw: Any) -> None:
    """An earlier daemon life with the trainer (rank 0, job train, this pid) subscribed, SIGKILLed: the state
    file as it leaves it (its subscriber list, written while running; a clean stop leaves the list out)."""
    async with running_daemon(sock_path, [FakeWatcher("aws")], **daemon_kw):
        t = await Subscription(sock_path, rank=0, job="train").open()
        await eventually(lambda: bool(_saved_state(sock_path).get("subscribed")), what="the subscriber list")
        with open(state_path_for(sock_path), "rb") as f:
            killed = f.read()
        await t.close()
    with open(state_path_for(sock_path), "wb") as f:
        f.write(killed)


async def test_kill9_before_the_state_write_the_report_for_the_earlier_id_stands(
        sock_path: str, moto: Moto) -> None:  # noqa: F811
    iid = moto.group("kill9-asg")
    async with LoopbackServer() as hook:
        await _killed_life(sock_path, webhook_url=hook.url)
        w = aws_watcher(iid)
        with structlog.testing.capture_logs() as logs:
            async with running_daemon(sock_path, [w], asg_lifecycle_hook="auto", webhook_url=hook.url):
                t = await Subscription(sock_path, rank=0, job="train").open()  # the trainer, reconnected
                await w.push(asg_notice("aws-asg-second-life"))  # the same provider notice, a new id
                n = await t.next_notice(timeout=5)
                await t.ack(n.id)  # the intake acks every notice; the hook acts on the first one only
                committed_at = time.time()
                await t.checkpoint_done("aws-asg-first-life", step=40)  # the id the killed daemon delivered
                await t.close()  # the trainer exits after its checkpoint
                (post,) = await hook.wait_requests(1, timeout=15)
                outcome = post.json()["outcome"]
                assert (outcome["status"], outcome["step"]) == ("committed", 40), outcome  # before: incomplete
                await eventually(lambda: len(_completes(moto)) == 1, timeout=15, what="CompleteLifecycleAction")
    assert [c["result"] for c in _completes(moto)] == ["CONTINUE"]
    assert _completes(moto)[0]["t"] >= committed_at
    assert [r["status"] for r in logs if r["event"] == "action.outcome"] == ["committed"]


async def test_kill9_before_the_state_write_a_report_before_the_notice_is_seen_again_stands(
        sock_path: str) -> None:
    """The trainer reconnects and reports (then exits) before this life's watcher saw the notice again."""
    async with LoopbackServer() as hook:
        await _killed_life(sock_path, webhook_url=hook.url)
        w = FakeWatcher("aws")
        async with running_daemon(sock_path, [w], webhook_url=hook.url) as d:
            t = await Subscription(sock_path, rank=0, job="train").open()
            await t.checkpoint_done("aws-asg-first-life", step=41)
            await t.status()  # the report was read before the close
            await t.close()
            await eventually(lambda: not d.server.subscribers(), what="the trainer gone")
            await w.push(asg_notice("aws-asg-second-life"))
            (post,) = await hook.wait_requests(1, timeout=15)
    outcome = post.json()["outcome"]
    assert (outcome["status"], outcome["step"], len(outcome["subscribers"])) == ("committed", 41, 1), outcome


async def test_kill9_before_the_state_write_a_trainer_that_never_returns_is_unreported(sock_path: str) -> None:
    """The trainer got the notice from the killed life, committed while no daemon listened and exited: this
    life never hears from it. Its subscriber list (written while running; a clean stop leaves it out) says
    who that was: 'unreported', not 'no_subscribers' (which completes an ASG hook with CONTINUE)."""
    async with LoopbackServer() as hook:
        async with running_daemon(sock_path, [FakeWatcher("aws")], webhook_url=hook.url):
            t = await Subscription(sock_path, rank=0, job="train", pid=4242, pod="train-0", namespace="ml").open()
            await eventually(lambda: bool(_saved_state(sock_path).get("subscribed")), what="the subscriber list")
            with open(state_path_for(sock_path), "rb") as f:
                killed = f.read()  # the state file as a kill -9 right now leaves it
            await t.close()
        assert "subscribed" not in _saved_state(sock_path), "a clean stop writes no subscriber list"
        with open(state_path_for(sock_path), "wb") as f:
            f.write(killed)
        w = FakeWatcher("aws")
        async with running_daemon(sock_path, [w], webhook_url=hook.url):
            await w.push(asg_notice("aws-asg-second-life"))
            (post,) = await hook.wait_requests(1, timeout=15)
    outcome = post.json()["outcome"]
    assert outcome["status"] == "unreported", outcome
    assert [(s["pod"], s["state"]) for s in outcome["subscribers"]] == [("train-0", "unreported")]
