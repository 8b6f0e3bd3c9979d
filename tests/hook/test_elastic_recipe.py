"""The elastic recipe end to end on loopback: ``deploy/torchrun/rendezvous-store.sh`` + two "nodes" running
``deploy/torchrun/launch.sh`` (real elastic torchrun, ``--nnodes=1:2``, c10d rendezvous, one daemon each).

Two ranks per node. Node B is preempted (its torchrun agent gets SIGTERM, as when its VM goes): every rank
agrees, commits, exits 143; node A's agent restarts its workers, which resume alone (4 -> 2 ranks). Then B
comes back: A's agent sees a node waiting, SIGTERMs its workers for the new round (spotguard commits on that
SIGTERM too), and all resume (2 -> 4). The state rules of test_elastic.py hold at each resume, and the final
weights are within 20x the float noise between uninterrupted 2- and 4-rank runs.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from ._torchrun import REPO, TorchRun
from .test_elastic import GLOBAL_BATCH, SAMPLES, SCRIPT, STEPS, check_epochs, make_references, rel_diff

LAUNCH = REPO / "deploy" / "torchrun" / "launch.sh"
STORE = REPO / "deploy" / "torchrun" / "rendezvous-store.sh"
# STEPS (36) is test_elastic's: the uninterrupted 2- and 4-rank runs are shared with it (make_references)
PER_NODE = 2  # ranks per "node": the job runs on 4, then 2, then 4 ranks
PER_EPOCH = SAMPLES // GLOBAL_BATCH

pytestmark = [pytest.mark.slow, pytest.mark.timeout(420)]


class Node:
    """One ``launch.sh`` "node" in its own folder and process group; its output is read as JSON lines."""

    def __init__(self, tmp: Path, name: str, env: dict[str, str], args: list[str]) -> None:
        self.dir = tmp / name
        self.dir.mkdir()
        self.log = self.dir / "node.log"
        env = dict(env, HOME=str(self.dir), XDG_RUNTIME_DIR=str(self.dir),
                   SPOTGUARD_SOCKET=str(self.dir / "absent.sock"))
        with open(self.log, "wb") as f:
            self.proc = subprocess.Popen([str(LAUNCH), str(SCRIPT), *args], env=env, cwd=self.dir,
                                         stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
        self.reader = TorchRun.__new__(TorchRun)
        self.reader.log, self.reader.proc = self.log, self.proc

    def lines(self) -> list[dict[str, Any]]:
        return self.reader.lines()

    def agent_pid(self) -> int:
        """The torchrun agent: the child of launch.sh that is not the daemon."""
        for child in Path(f"/proc/{self.proc.pid}/task/{self.proc.pid}/children").read_text().split():
            cmd = Path(f"/proc/{child}/cmdline").read_bytes().split(b"\0")
            if any(part.endswith(b"torchrun") for part in cmd[:2]):
                return int(child)
        raise AssertionError(f"no torchrun agent under launch.sh:\n{self.reader.tail()}")

    def wait(self, timeout: float) -> int:
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"node {self.dir.name} still running:\n{self.reader.tail(60)}") from None

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


def wait_until(pred: Any, timeout: float, what: str, nodes: list[Node]) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if pred():
            return
        time.sleep(0.05)  # polling child logs: nothing to await
    raise AssertionError(f"timed out waiting for {what}:\n" + "\n".join(n.reader.tail(30) for n in nodes))


@pytest.fixture(scope="module")
def references(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return make_references(tmp_path_factory.mktemp("recipe-ref"), STEPS, (PER_NODE, 2 * PER_NODE))


def test_elastic_recipe_two_nodes_one_preempted_then_back(references: dict[str, Any], short_tmp: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    records = short_tmp / "ids"
    records.mkdir()
    out = short_tmp / "final.pt"
    base = {k: v for k, v in os.environ.items() if not k.startswith("SPOTGUARD_")}
    base.update(PATH=f"{Path(sys.executable).parent}:/usr/local/bin:/usr/bin:/bin", PYTHON=sys.executable,
                OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", RDZV_PORT=str(port), RDZV_HOST="127.0.0.1",
                NNODES_MIN="1", NNODES_MAX="2", NPROC_PER_NODE=str(PER_NODE), MAX_RESTARTS="3",
                RDZV_CONF="last_call_timeout=3", RDZV_ID="elastic-test", SPOTGUARD_CLOUD="none",
                SPOTGUARD_STORAGE=f"file://{short_tmp}/ckpt")
    args = ["--steps", str(STEPS), "--records", str(records), "--step-time", "0.5", "--out", str(out)]
    store = subprocess.Popen([str(STORE)], env=base, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    nodes: list[Node] = []
    try:
        assert store.stdout and f":{port}" in store.stdout.readline()
        a, b = Node(short_tmp, "a", base, args), Node(short_tmp, "b", base, args)
        nodes += [a, b]
        # leg 1: two nodes, world 2
        wait_until(lambda: any(e.get("step", -1) >= 3 and "loss" in e for n in nodes for e in n.lines()), 120,
                   "two-node training", nodes)
        os.kill(b.agent_pid(), signal.SIGTERM)  # node B is going away
        assert b.wait(90) != 0
        # leg 2: A alone (its agent restarted the worker after the agreed exit)
        wait_until(lambda: any(e.get("resume", 0) > 0 and e.get("world") == PER_NODE for e in a.lines()), 120,
                   "node A resuming alone", nodes)
        wait_until(lambda: any("loss" in e for e in a.lines()[-3:]), 60, "node A training alone", nodes)
        b2 = Node(short_tmp, "b2", base, args)  # node B (a new VM) comes back
        nodes.append(b2)
        codes = (a.wait(240), b2.wait(60))
        assert codes == (0, 0), (codes, a.reader.tail(60), b2.reader.tail(60))
    finally:
        for n in nodes:
            n.kill()
        store.send_signal(signal.SIGTERM)
        try:
            store.wait(timeout=60)  # a loaded machine took over 10 s to stop it
        except subprocess.TimeoutExpired:
            store.kill()
            store.wait(timeout=30)

    resumes = [e for n in nodes for e in n.lines() if "resume" in e]
    legs = sorted({(e["resume"], e["world"]) for e in resumes})
    n = PER_NODE
    assert [w for _, w in legs] == [2 * n, n, 2 * n], legs  # two nodes, then one, then two again
    for e in resumes:
        if e["resume"]:
            ref = references["steps"][e["resume"] - 1]
            assert (e["last_epoch"], e["lr"]) == (ref["last_epoch"], ref["lr"]), (e, ref)
            assert e["sampler"]["consumed"] == ((e["resume"] - 1) % PER_EPOCH + 1) * GLOBAL_BATCH
    elastic = [e for n in nodes for e in n.lines() if e.get("event") == "elastic_resume"]
    assert {(e["old_world_size"], e["world_size"]) for e in elastic} == {(2 * n, n), (n, 2 * n)}, elastic
    assert {e["rank"]: e["rng"] for e in elastic if e["world_size"] == 2 * n} == \
        {r: "own" if r < n else "derived" for r in range(2 * n)}
    check_epochs(records, references, STEPS)
    final = torch.load(out, weights_only=True)
    diff, noise = rel_diff(references["out"][2 * n]["model"], final["model"]), references["noise"]
    print(f"elastic recipe 2->1->2 nodes ({PER_NODE} ranks each): relative weight difference {diff:.3g}, noise {noise:.3g}")
    assert diff <= 20 * noise, (diff, noise)
