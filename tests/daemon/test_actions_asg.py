"""AWS Auto Scaling lifecycle hook (--asg-lifecycle-hook) against moto's Auto Scaling in server mode
on loopback (tests/daemon/moto_asg.py adds the two lifecycle calls moto lacks), with the real AWS
watcher reading the emulator's target-lifecycle-state."""

from __future__ import annotations

import asyncio
import atexit
import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any, Iterator

import pytest
import structlog

pytest.importorskip("boto3", reason="boto3 missing: `make storage-tools` (requirements-storage.txt)")
pytest.importorskip("moto.server", reason="moto[server] missing: `make storage-tools` (requirements-storage.txt)")

import boto3  # noqa: E402

from spotguard.daemon.client import Subscription  # noqa: E402
from spotguard.emulator.aws import IDENTITY  # noqa: E402
from spotguard.emulator.server import running_emulator  # noqa: E402

from .conftest import FakeWatcher, eventually, make_notice, running_daemon  # noqa: E402
from .test_e2e_emulator import FAST  # noqa: E402

HERE = Path(__file__).resolve().parent
REGION = "us-east-1"
EMULATOR_INSTANCE = str(IDENTITY["instanceId"])


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Moto:
    def __init__(self, tmp: Path) -> None:
        self.port = _free_port()
        self.log = tmp / "lifecycle.jsonl"
        self.url = f"http://127.0.0.1:{self.port}"
        env = {**os.environ, "MOTO_ASG_LOG": str(self.log), "MOTO_FIRST_INSTANCE_ID": EMULATOR_INSTANCE}
        self.proc = subprocess.Popen([sys.executable, str(HERE / "moto_asg.py"), "-H", "127.0.0.1", "-p", str(self.port)],
                                     env=env, stdout=open(tmp / "moto.out", "wb"), stderr=subprocess.STDOUT,
                                     start_new_session=True)
        end = time.monotonic() + 30
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"moto exited: {(tmp / 'moto.out').read_text()[-2000:]}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.5):
                    break
            except OSError:
                if time.monotonic() > end:
                    raise RuntimeError("moto did not start")
                time.sleep(0.1)
        self.asg = boto3.client("autoscaling", region_name=REGION, endpoint_url=self.url,
                                aws_access_key_id="testing", aws_secret_access_key="testing")

    def group(self, name: str, hook_timeout: int = 30, hook: str = "spotguard-drain",
              others: tuple[str, ...] = ()) -> str:
        """A group of one instance with a terminating hook (and ``others``: hooks other tools own);
        returns the instance id."""
        self.asg.create_launch_configuration(LaunchConfigurationName=f"{name}-lc", ImageId="ami-12c6146b",
                                             InstanceType="t3.micro")
        self.asg.create_auto_scaling_group(AutoScalingGroupName=name, LaunchConfigurationName=f"{name}-lc",
                                           MinSize=1, MaxSize=1, DesiredCapacity=1,
                                           AvailabilityZones=[f"{REGION}a"])
        for h in (hook, *others):
            self.asg.put_lifecycle_hook(LifecycleHookName=h, AutoScalingGroupName=name,
                                        LifecycleTransition="autoscaling:EC2_INSTANCE_TERMINATING",
                                        HeartbeatTimeout=hook_timeout, DefaultResult="ABANDON")
        (inst,) = self.asg.describe_auto_scaling_groups(AutoScalingGroupNames=[name])["AutoScalingGroups"][0]["Instances"]
        return inst["InstanceId"]

    def calls(self) -> list[dict[str, Any]]:
        if not self.log.exists():
            return []
        return [json.loads(line) for line in self.log.read_text().splitlines()]

    def state(self, instance_id: str) -> str:
        (i,) = self.asg.describe_auto_scaling_instances(InstanceIds=[instance_id])["AutoScalingInstances"]
        return i["LifecycleState"]

    def reset(self) -> None:
        """As freshly started: moto's state dropped (the first instance id is the emulator's again), the call
        log empty."""
        urllib.request.urlopen(urllib.request.Request(f"{self.url}/moto-api/reset", method="POST"), timeout=30).close()
        self.log.write_text("")

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(5)
        except subprocess.TimeoutExpired:
            self.proc.kill()


_SERVER: list[Moto] = []  # one moto server for the session's tests, reset before each (its start is seconds)


@pytest.fixture
def moto(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> Iterator[Moto]:
    if _SERVER and _SERVER[0].proc.poll() is None:
        m = _SERVER[0]
        m.reset()
    else:
        m = Moto(tmp_path_factory.mktemp("moto-asg"))
        _SERVER[:] = [m]
        atexit.register(m.stop)
    monkeypatch.setenv("AWS_ENDPOINT_URL", m.url)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.delenv("AWS_PROFILE", raising=False)
    yield m


def asg_notice(nid: str, in_seconds: float = 120):
    return make_notice(nid, kind="termination", in_seconds=in_seconds, detail="target-lifecycle-state=Terminated")


def aws_watcher(instance_id: str) -> FakeWatcher:
    w = FakeWatcher("aws")
    w.identity = {"instanceId": instance_id, "region": REGION}  # type: ignore[attr-defined]
    return w


async def test_heartbeat_then_continue_once_every_checkpoint_committed(sock_path: str, moto: Moto) -> None:
    iid = moto.group("train-asg")
    w = aws_watcher(iid)
    async with running_daemon(sock_path, [w], asg_lifecycle_hook="auto") as d:
        a = await Subscription(sock_path, rank=0).open()
        b = await Subscription(sock_path, rank=1).open()
        await w.push(asg_notice("aws-asg-1"))
        await a.next_notice(timeout=5)
        await b.next_notice(timeout=5)
        await eventually(lambda: any(c["action"] == "RecordLifecycleActionHeartbeat" for c in moto.calls()),
                         timeout=15, what="a heartbeat")
        await a.checkpoint_done("aws-asg-1", step=7)
        await a.status()
        await asyncio.sleep(0.3)
        assert not any(c["action"] == "CompleteLifecycleAction" for c in moto.calls()), "completed too early"
        await b.checkpoint_done("aws-asg-1", step=7)
        await eventually(lambda: any(c["action"] == "CompleteLifecycleAction" for c in moto.calls()),
                         timeout=15, what="CompleteLifecycleAction")
        await a.close()
        await b.close()
    done = [{k: v for k, v in c.items() if k != "t"} for c in moto.calls() if c["action"] == "CompleteLifecycleAction"]
    assert done == [{"action": "CompleteLifecycleAction", "group": "train-asg", "hook": "spotguard-drain", "instance": iid,
                     "result": "CONTINUE"}]
    assert moto.state(iid) == "Terminating:Proceed"
    assert d.metrics.actions.labels("asg", "outcome", "ok")._value.get() == 1


async def test_failed_checkpoint_leaves_the_hook_to_its_timeout(sock_path: str, moto: Moto) -> None:
    iid = moto.group("fail-asg")
    w = aws_watcher(iid)
    with structlog.testing.capture_logs() as logs:
        async with running_daemon(sock_path, [w], asg_lifecycle_hook="spotguard-drain"):
            a = await Subscription(sock_path).open()
            await w.push(asg_notice("aws-asg-2"))
            await a.next_notice(timeout=5)
            await eventually(lambda: len(moto.calls()) >= 1, timeout=15, what="a heartbeat")
            await a.checkpoint_failed("aws-asg-2", "s3 said no")
            await eventually(lambda: any(r["event"] == "asg.not_completing" for r in logs), timeout=10,
                             what="the decision")
            await a.close()
    assert {c["action"] for c in moto.calls()} == {"RecordLifecycleActionHeartbeat"}
    assert moto.state(iid) == "InService"


async def test_unknown_hook_or_instance_is_one_clear_line(sock_path: str, moto: Moto) -> None:
    iid = moto.group("other-asg")
    with structlog.testing.capture_logs() as logs:
        async with running_daemon(sock_path, [aws_watcher(iid), aws_watcher("i-00000000000000000")],
                                  asg_lifecycle_hook="no-such-hook") as d:
            w1, w2 = d.watchers[0], d.watchers[1]
            await w1.push(asg_notice("aws-asg-3"))  # type: ignore[attr-defined]
            await w2.push(asg_notice("aws-asg-4"))  # type: ignore[attr-defined]
            await eventually(lambda: d.metrics.actions.labels("asg", "notice", "failed")._value.get() == 2,
                             timeout=15, what="both failed")
    assert any(r["event"] == "asg.no_hook" and "put-lifecycle-hook" in r["fix"] for r in logs)
    assert any(r["event"] == "asg.not_in_group" for r in logs)
    assert moto.calls() == []


async def test_only_asg_notices(sock_path: str, moto: Moto) -> None:
    iid = moto.group("spot-asg")
    w = aws_watcher(iid)
    async with running_daemon(sock_path, [w], asg_lifecycle_hook="auto") as d:
        a = await Subscription(sock_path).open()
        await w.push(make_notice("aws-spot-x"))  # a spot interruption, not the lifecycle state
        await a.next_notice(timeout=5)
        await a.checkpoint_done("aws-spot-x", step=1)
        await a.status()
        await asyncio.sleep(0.5)
        await a.close()
    assert moto.calls() == [] and d.metrics.actions.labels("asg", "outcome", "ok")._value.get() == 0


async def test_real_watcher_and_emulator_end_to_end(sock_path: str, moto: Moto) -> None:
    """IMDS target-lifecycle-state=Terminated (emulator) -> AWS watcher -> notice -> heartbeat ->
    checkpoint_done -> CompleteLifecycleAction CONTINUE on the instance named by the identity document."""
    iid = moto.group("e2e-asg")
    assert iid == EMULATOR_INSTANCE
    async with running_emulator(port=0, asg=True) as emu:
        w = FAST["aws"](emu.url)
        async with running_daemon(sock_path, [w], cloud="aws", asg_lifecycle_hook="auto"):
            a = await Subscription(sock_path).open()
            await eventually(lambda: w.node == EMULATOR_INSTANCE, timeout=10, what="identity document")
            emu.notice("aws", "termination")
            n = await a.next_notice(timeout=10)
            assert n.kind == "termination" and n.detail == "target-lifecycle-state=Terminated"
            await eventually(lambda: len(moto.calls()) >= 1, timeout=15, what="a heartbeat")
            await a.checkpoint_done(n.id, step=11)
            await eventually(lambda: any(c["action"] == "CompleteLifecycleAction" for c in moto.calls()),
                             timeout=15, what="CompleteLifecycleAction")
            await a.close()
    assert moto.state(iid) == "Terminating:Proceed"


@pytest.mark.serial
async def test_hanging_autoscaling_endpoint_never_delays_notices(sock_path: str, moto: Moto,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    from .loopback import LoopbackServer, assert_notices_prompt

    async with LoopbackServer(hang=True) as dead:
        monkeypatch.setenv("AWS_ENDPOINT_URL", dead.url)
        w = aws_watcher("i-0abc")
        async with running_daemon(sock_path, [w], asg_lifecycle_hook="auto"):
            a = await Subscription(sock_path).open()
            await w.push(asg_notice("aws-asg-h0"))
            await a.next_notice(timeout=5)
            await dead.wait_requests(1)  # DescribeAutoScalingInstances, now hanging
            await assert_notices_prompt(w.push, a, asg_notice, "aws-asg-hx")
            await a.close()
            t0 = time.monotonic()
        assert time.monotonic() - t0 < 9, "shutdown waited for a hung AWS call"


# --- issue 24: whose hook, and how long it holds ------------------------------------------------


async def test_auto_leaves_hooks_of_other_tools_alone(sock_path: str, moto: Moto) -> None:
    """`auto` heartbeats and completes only hooks named spotguard*; a log shipper's hook on the same group is
    never touched (before: every terminating hook of the group was heartbeated and completed)."""
    iid = moto.group("shared-asg", others=("someone-elses-log-shipper",))
    w = aws_watcher(iid)
    with structlog.testing.capture_logs() as logs:
        async with running_daemon(sock_path, [w], asg_lifecycle_hook="auto"):
            a = await Subscription(sock_path).open()
            await w.push(asg_notice("aws-asg-shared"))
            await a.next_notice(timeout=5)
            await eventually(lambda: any(c["action"] == "RecordLifecycleActionHeartbeat" for c in moto.calls()),
                             timeout=15, what="a heartbeat")
            await a.checkpoint_done("aws-asg-shared", step=3)
            await eventually(lambda: any(c["action"] == "CompleteLifecycleAction" for c in moto.calls()),
                             timeout=15, what="CompleteLifecycleAction")
            await a.close()
    assert {c["hook"] for c in moto.calls()} == {"spotguard-drain"}, moto.calls()
    assert any(r["event"] == "asg.hooks_left_alone" and r["hooks"] == ["someone-elses-log-shipper"] for r in logs)


async def test_auto_without_a_spotguard_hook_is_one_clear_line(sock_path: str, moto: Moto) -> None:
    iid = moto.group("foreign-asg", hook="someone-elses-log-shipper")
    w = aws_watcher(iid)
    with structlog.testing.capture_logs() as logs:
        async with running_daemon(sock_path, [w], asg_lifecycle_hook="auto") as d:
            await w.push(asg_notice("aws-asg-foreign"))
            await eventually(lambda: d.metrics.actions.labels("asg", "notice", "failed")._value.get() == 1,
                             timeout=15, what="the refusal")
    assert moto.calls() == []
    assert any(r["event"] == "asg.no_hook" and "--asg-lifecycle-hook NAME" in r["fix"] for r in logs)


def test_global_timeout_follows_aws_rule(moto: Moto) -> None:
    from spotguard.daemon.actions.asg import global_timeout

    moto.group("rule-asg", hook_timeout=30)
    (hook,) = moto.asg.describe_lifecycle_hooks(AutoScalingGroupName="rule-asg")["LifecycleHooks"]
    assert hook["GlobalTimeout"] == 3000  # the fake follows AWS's documented min(100 x 30, 172800)
    assert global_timeout(hook) == 3000
    assert global_timeout({"HeartbeatTimeout": 7200}) == 172800
    assert global_timeout({"HeartbeatTimeout": 30, "GlobalTimeout": 172800}) == 3000


async def test_checkpoint_longer_than_the_notice_keeps_heartbeating(sock_path: str, moto: Moto,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """The watcher's ASG notice says 120 s (here 2 s); the hook holds the instance HeartbeatTimeout past each
    heartbeat. A checkpoint that outlasts the notice keeps heartbeating and still completes with CONTINUE
    (before: 'incomplete' at the notice's deadline, heartbeats stopped, the instance idled until the timeout)."""
    from spotguard.daemon.actions import asg as asg_mod

    monkeypatch.setattr(asg_mod, "HEARTBEAT_CAP", 0.5, raising=False)  # a heartbeat every 0.5 s instead of HeartbeatTimeout/3
    iid = moto.group("long-asg", hook_timeout=30)
    w = aws_watcher(iid)
    with structlog.testing.capture_logs() as logs:
        async with running_daemon(sock_path, [w], asg_lifecycle_hook="auto"):
            a = await Subscription(sock_path).open()
            await w.push(asg_notice("aws-asg-long", in_seconds=2))
            n = await a.next_notice(timeout=5)
            await a.checkpoint_started(n.id, step=9)
            beats = lambda: sum(c["action"] == "RecordLifecycleActionHeartbeat" for c in moto.calls())  # noqa: E731
            await eventually(lambda: n.seconds_left() < -1.0, timeout=10, what="past the notice's deadline")
            seen = beats()
            await eventually(lambda: beats() >= seen + 2, timeout=10, what="heartbeats past the deadline")
            assert not [r for r in logs if r["event"] == "action.outcome"], "decided at the notice's deadline"
            await a.checkpoint_done(n.id, step=9)
            await eventually(lambda: any(c["action"] == "CompleteLifecycleAction" for c in moto.calls()),
                             timeout=15, what="CompleteLifecycleAction")
            await a.close()
    (outcome,) = [r for r in logs if r["event"] == "action.outcome"]
    assert outcome["status"] == "committed"
    assert moto.state(iid) == "Terminating:Proceed"
