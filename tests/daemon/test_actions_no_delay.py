"""Every cluster action on at once, every action's server hanging: a real `spotguard daemon` process
(real AWS watcher on the emulator process) still delivers each notice to the trainers at once, and
still stops promptly. The actions only ever run beside the fan-out, never in front of it."""

from __future__ import annotations

import asyncio
import json
import os
import select
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Callable, Iterator

import pytest

pytest.importorskip("kubernetes_asyncio", reason="kubernetes_asyncio missing: `make setup`")
pytest.importorskip("boto3", reason="boto3 missing: `make storage-tools`")

from spotguard.daemon.client import Subscription, request  # noqa: E402
from spotguard.protocol import Drill, DrillOk  # noqa: E402
from spotguard.timefmt import utcnow  # noqa: E402

from .conftest import DaemonProc  # noqa: E402
from .loopback import LoopbackServer  # noqa: E402

#: The usual time: fan-out is sub-millisecond; this bound leaves room for a loaded 2-core box.
PROMPT = 1.0


@pytest.fixture
def emulator() -> Iterator[str]:
    proc = subprocess.Popen([sys.executable, "-m", "spotguard", "emulate", "--port", "0", "--asg"],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    try:
        assert proc.stdout is not None
        ready, _, _ = select.select([proc.stdout], [], [], 30)
        assert ready, "the emulator printed no listening line"
        yield json.loads(proc.stdout.readline())["url"]
    finally:
        proc.terminate()
        proc.wait(10)


def schedule(url: str, cloud: str, kind: str) -> None:
    req = urllib.request.Request(f"{url}/_emulator/notice", data=json.dumps({"cloud": cloud, "kind": kind}).encode(),
                                 headers={"Content-Type": "application/json"}, method="POST")
    with urllib.request.urlopen(req, timeout=10) as r:
        assert r.status == 200


@pytest.mark.serial
async def test_all_actions_hanging_never_delay_notices(spawn_daemon: Callable[..., DaemonProc], emulator: str,
                                                       tmp_path: Path) -> None:
    async with LoopbackServer(hang=True) as hooks, LoopbackServer(hang=True) as kube, \
            LoopbackServer(hang=True) as aws:
        kubeconfig = tmp_path / "kubeconfig"
        kubeconfig.write_text(json.dumps({
            "apiVersion": "v1", "kind": "Config", "current-context": "c",
            "clusters": [{"name": "c", "cluster": {"server": kube.url}}], "users": [{"name": "u", "user": {"token": "t"}}],
            "contexts": [{"name": "c", "context": {"cluster": "c", "user": "u"}}]}))
        env = {"KUBECONFIG": str(kubeconfig), "AWS_ENDPOINT_URL": aws.url, "AWS_ACCESS_KEY_ID": "x",
               "AWS_SECRET_ACCESS_KEY": "y", "AWS_DEFAULT_REGION": "us-east-1"}
        dp = spawn_daemon("--cloud", "aws", "--metadata-url", emulator, "--node", "node-a",
                          "--webhook-url", f"{hooks.url}/generic", "--slack-webhook-url", f"{hooks.url}/slack",
                          "--kubernetes-node-actions", "--asg-lifecycle-hook", "auto", env=env, wait_ready=False)
        await asyncio.to_thread(dp.wait_notify, "READY=1", 30)
        sub = await Subscription(dp.sock, pod="trainer-0", namespace="ml").open()
        assert (await sub.status())["actions"] == ["webhook", "slack", "kubernetes", "asg"]
        for _ in range(200):  # the identity document read: the ASG action has its instance id
            state = await sub.status()
            if state["node"] == "node-a" and all(w["healthy"] for w in state["watchers"]):
                break
            await asyncio.sleep(0.05)

        schedule(emulator, "aws", "termination")  # target-lifecycle-state -> Terminated
        notice = await sub.next_notice(timeout=10)
        assert notice.detail == "target-lifecycle-state=Terminated"
        lag = (utcnow() - notice.received_at).total_seconds()  # watcher saw it -> trainer has it
        assert lag < PROMPT, lag
        await kube.wait_requests(1, timeout=30)  # GET node, hanging (the action imports its client first)
        await aws.wait_requests(1, timeout=30)   # DescribeAutoScalingInstances, hanging (boto3 import + client)
        await sub.checkpoint_done(notice.id, step=5)
        await hooks.wait_requests(2)  # webhook + Slack, both hanging

        lags = []
        for _ in range(3):
            t0 = time.monotonic()
            reply = await request(dp.sock, Drill(kind="preemption", deadline_in=60))
            assert isinstance(reply, DrillOk)
            assert (await sub.next_notice(timeout=5)).id == reply.id
            lags.append(time.monotonic() - t0)
        assert max(lags) < PROMPT, lags
        await sub.close()
        t0 = time.monotonic()
        await asyncio.to_thread(dp.stop)
        assert dp.proc.returncode == 0 and time.monotonic() - t0 < 5, "stop waited for hanging actions"
        log = dp.stderr_now()
        assert '"action.enabled"' in log and log.count('"action.enabled"') == 4
        assert f"{hooks.url}/generic" not in log and "/slack" not in log, "webhook URL paths are secrets"
        assert os.path.exists(dp.sock) is False
