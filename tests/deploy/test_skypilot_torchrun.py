"""deploy/skypilot/train.yaml and deploy/torchrun/*.sh: structure, shellcheck, and the
scripts actually run here, with a stub `torchrun` that records its arguments and
asks the daemon for its status (so the daemon must be up when training starts).
The daemon runs with SPOTGUARD_CLOUD=none: no metadata server is contacted.
"""

from __future__ import annotations

import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from .conftest import REPO, load_yaml_docs, require_tool, run

SKY = REPO / "deploy" / "skypilot" / "train.yaml"
LAUNCH = REPO / "deploy" / "torchrun" / "launch.sh"
STORE = REPO / "deploy" / "torchrun" / "rendezvous-store.sh"
SKY_TOP_KEYS = {"name", "workdir", "num_nodes", "resources", "envs", "secrets", "file_mounts", "setup", "run",
                "config", "volumes", "event_callback", "service"}

STUB_TORCHRUN = """#!/usr/bin/env bash
printf '%s\\n' "$@" > "${TORCHRUN_LOG}"
if spotguard status --socket "${SPOTGUARD_SOCKET}" --timeout 5 > /dev/null 2>&1; then
  echo daemon=up >> "${TORCHRUN_LOG}.env"
else
  echo daemon=down >> "${TORCHRUN_LOG}.env"
fi
echo "SPOTGUARD_SOCKET=${SPOTGUARD_SOCKET}" >> "${TORCHRUN_LOG}.env"
echo "SPOTGUARD_STORAGE=${SPOTGUARD_STORAGE}" >> "${TORCHRUN_LOG}.env"
"""


def sky() -> dict[str, Any]:
    (doc,) = load_yaml_docs(SKY.read_text())
    return doc


def stub_env(tmp: Path) -> dict[str, str]:
    bindir = tmp / "bin"
    bindir.mkdir(exist_ok=True)
    stub = bindir / "torchrun"
    stub.write_text(STUB_TORCHRUN)
    stub.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SPOTGUARD_", "SKYPILOT_"))}
    env.update(PATH=f"{bindir}:{Path(sys.executable).parent}:/usr/local/bin:/usr/bin:/bin", HOME=str(tmp),
               TORCHRUN_LOG=str(tmp / "torchrun.args"), SPOTGUARD_CLOUD="none")
    env.pop("XDG_RUNTIME_DIR", None)
    return env


def flags(argv: list[str]) -> dict[str, str]:
    return dict(a[2:].split("=", 1) for a in argv if a.startswith("--") and "=" in a)


def run_script(argv: list[str], env: dict[str, str], cwd: Path, timeout: float = 90) -> subprocess.CompletedProcess[str]:
    """Run in its own process group so that a timeout also ends the daemon the script started."""
    proc = subprocess.Popen(argv, env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        raise AssertionError(f"{argv[0]} timed out\n{out}\n{err}") from None
    return subprocess.CompletedProcess(argv, proc.returncode, out, err)


def shellcheck(path: Path) -> None:
    sc = require_tool("shellcheck")
    proc = run([sc, "--severity=style", "--shell=bash", str(path)], check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def daemon_gone(sock: Path, timeout: float = 10) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        with socket.socket(socket.AF_UNIX) as s:
            try:
                s.connect(str(sock))
            except OSError:
                return True
        time.sleep(0.2)
    return False


# ---------------------------------------------------------------- SkyPilot


def test_skypilot_structure() -> None:
    task = sky()
    assert set(task) <= SKY_TOP_KEYS, f"unknown SkyPilot keys: {set(task) - SKY_TOP_KEYS}"
    res = task["resources"]
    assert res["use_spot"] is True
    jr = res["job_recovery"]
    assert isinstance(jr, dict) and jr["strategy"].upper() in ("FAILOVER", "EAGER_NEXT_REGION")
    assert isinstance(jr.get("max_restarts_on_errors", 0), int) and jr["max_restarts_on_errors"] >= 1
    assert isinstance(task["num_nodes"], int) and task["num_nodes"] >= 1
    envs = task["envs"]
    storage = envs.get("SPOTGUARD_STORAGE", "")
    mounts = task.get("file_mounts") or {}
    if storage.startswith(("s3://", "gs://", "az://")):
        pass
    else:  # a mounted bucket
        path = storage.removeprefix("file://")
        assert any(path.startswith(m) and isinstance(v, dict) and v.get("mode") in ("MOUNT", "MOUNT_CACHED")
                   for m, v in mounts.items()), "SPOTGUARD_STORAGE must be a bucket URI or under a mounted bucket"
    assert "pip install" in task["setup"] and "spotguard" in task["setup"]
    runs = task["run"]
    assert runs.index("spotguard daemon") < runs.index("spotguard status") < runs.index("torchrun")
    assert "--max-restarts" in runs and "--rdzv-backend=c10d" in runs


@pytest.mark.parametrize("block", ["setup", "run"])
def test_skypilot_scripts_shellcheck(block: str, tmp_path: Path) -> None:
    script = tmp_path / f"{block}.sh"
    exported = "".join(f"export {k}={shlex.quote(str(v))}\n" for k, v in sky()["envs"].items())
    script.write_text("#!/usr/bin/env bash\n" + exported + sky()[block])
    shellcheck(script)


def test_skypilot_run_starts_daemon_then_torchrun(short_tmp: Path) -> None:
    task = sky()
    env = stub_env(short_tmp)
    env.update({k: str(v) for k, v in task["envs"].items()})
    env.update(SPOTGUARD_CLOUD="none", SKYPILOT_NODE_IPS="10.1.2.3\n10.1.2.4", SKYPILOT_NUM_NODES="2",
               SKYPILOT_NUM_GPUS_PER_NODE="8", SKYPILOT_NODE_RANK="0", SKYPILOT_TASK_ID="sky-managed-1")
    proc = run_script(["bash", "-c", task["run"]], env, short_tmp)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    argv = (short_tmp / "torchrun.args").read_text().splitlines()
    f = flags(argv)
    assert f["nnodes"] == "2" and f["nproc-per-node"] == "8" and f["rdzv-backend"] == "c10d"
    assert f["rdzv-endpoint"] == "10.1.2.3:29400" and f["rdzv-id"] == "sky-managed-1"
    assert int(f["max-restarts"]) >= 1
    assert argv[-1] == task["envs"]["TRAIN_SCRIPT"]
    seen = (short_tmp / "torchrun.args.env").read_text()
    assert "daemon=up" in seen, "torchrun started before the daemon answered"
    assert f"SPOTGUARD_STORAGE={task['envs']['SPOTGUARD_STORAGE']}" in seen
    assert daemon_gone(short_tmp / ".spotguard" / "spotguard.sock"), "daemon left running after the job"


# ---------------------------------------------------------------- torchrun recipe


@pytest.mark.parametrize("script", [LAUNCH, STORE], ids=lambda p: p.name)
def test_torchrun_scripts_shellcheck(script: Path) -> None:
    assert os.access(script, os.X_OK), f"{script.name} must be executable"
    assert script.read_text().startswith("#!/usr/bin/env bash\n")
    run(["bash", "-n", str(script)])
    shellcheck(script)


def test_launch_runs_elastic_torchrun_with_a_daemon(short_tmp: Path) -> None:
    env = stub_env(short_tmp)
    env.update(SPOTGUARD_STORAGE="s3://bucket/run-1", RDZV_HOST="rdzv.internal",
               SPOTGUARD_SOCKET=str(short_tmp / "absent" / "spotguard.sock"), XDG_RUNTIME_DIR=str(short_tmp / "xdg"))
    proc = run_script([str(LAUNCH), "train.py", "--steps", "10"], env, short_tmp)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    argv = (short_tmp / "torchrun.args").read_text().splitlines()
    f = flags(argv)
    assert re.fullmatch(r"\d+:\d+", f["nnodes"]) and f["nnodes"] == "1:4"
    lo, hi = map(int, f["nnodes"].split(":"))
    assert lo < hi
    assert int(f["max-restarts"]) >= 1
    assert f["rdzv-backend"] == "c10d" and f["rdzv-endpoint"] == "rdzv.internal:29400"
    assert f["rdzv-conf"] == "is_host=false", "the store lives on the stable node, never on a spot node"
    assert argv[-3:] == ["train.py", "--steps", "10"]
    seen = (short_tmp / "torchrun.args.env").read_text()
    assert "daemon=up" in seen and f"SPOTGUARD_SOCKET={short_tmp}/xdg/spotguard.sock" in seen
    assert daemon_gone(short_tmp / "xdg" / "spotguard.sock")


def test_launch_refuses_without_storage(short_tmp: Path) -> None:
    env = stub_env(short_tmp)
    env.update(RDZV_HOST="rdzv.internal")
    proc = subprocess.run([str(LAUNCH), "train.py"], env=env, capture_output=True, text=True, timeout=30)
    assert proc.returncode != 0 and "SPOTGUARD_STORAGE" in proc.stderr
    assert not (short_tmp / "torchrun.args").exists()


def test_rendezvous_store_serves(short_tmp: Path) -> None:
    torch_dist = pytest.importorskip("torch.distributed", reason="torch needed for the rendezvous store")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, RDZV_PORT=str(port), PYTHON=sys.executable)
    proc = subprocess.Popen([str(STORE)], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline() if proc.stdout else ""
        assert f":{port}" in line, line + (proc.stderr.read() if proc.poll() is not None and proc.stderr else "")
        from datetime import timedelta
        client = torch_dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=10))
        client.set("spotguard", "ok")
        assert client.get("spotguard") == b"ok"
    finally:
        proc.send_signal(signal.SIGTERM)
        assert _stopped(proc) in (0, -signal.SIGTERM)


def _stopped(proc: subprocess.Popen) -> int:  # type: ignore[type-arg]
    """The store's exit code after SIGTERM: 60 s (a loaded CI box took more than 10 s to tear torch down),
    then SIGKILL so a stuck store never hangs the suite."""
    try:
        return proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        return proc.wait(timeout=10)


TWO_NODE_TRAIN = """
import os
import torch
import torch.distributed as dist
dist.init_process_group("gloo")
t = torch.ones(1) * (dist.get_rank() + 1)
dist.all_reduce(t)
print(f"rank={dist.get_rank()} world={dist.get_world_size()} sum={t.item():g} socket={os.environ['SPOTGUARD_SOCKET']}", flush=True)
dist.destroy_process_group()
"""


@pytest.mark.slow
def test_recipe_end_to_end_two_nodes(short_tmp: Path) -> None:
    """The real thing on loopback: rendezvous-store.sh + two launch.sh "nodes" running real
    elastic torchrun (1:2 nodes, gloo), each with its own daemon; they meet and all-reduce."""
    pytest.importorskip("torch.distributed", reason="torch needed for torchrun")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    script = short_tmp / "train.py"
    script.write_text(TWO_NODE_TRAIN)
    base = {k: v for k, v in os.environ.items() if not k.startswith("SPOTGUARD_")}
    base.update(PATH=f"{Path(sys.executable).parent}:/usr/local/bin:/usr/bin:/bin", PYTHON=sys.executable,
                RDZV_PORT=str(port), RDZV_HOST="127.0.0.1", NNODES_MIN="1", NNODES_MAX="2", NPROC_PER_NODE="1",
                MAX_RESTARTS="0", SPOTGUARD_CLOUD="none", SPOTGUARD_STORAGE=f"file://{short_tmp}/ckpt")
    store = subprocess.Popen([str(STORE)], env=base, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    nodes: list[subprocess.Popen[str]] = []
    try:
        assert store.stdout and f":{port}" in store.stdout.readline()
        for name in ("a", "b"):
            d = short_tmp / name
            d.mkdir()
            env = dict(base, HOME=str(d), XDG_RUNTIME_DIR=str(d), SPOTGUARD_SOCKET=str(d / "absent.sock"))
            nodes.append(subprocess.Popen([str(LAUNCH), str(script)], env=env, cwd=d, start_new_session=True,
                                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
        outs = [n.communicate(timeout=150)[0] for n in nodes]
    finally:
        for n in nodes:
            if n.poll() is None:
                os.killpg(n.pid, signal.SIGKILL)
                n.wait()
        store.send_signal(signal.SIGTERM)
        _stopped(store)
    for name, node, out in zip("ab", nodes, outs):
        assert node.returncode == 0, out[-3000:]
        assert "world=2 sum=3" in out, out[-3000:]
        assert f"socket={short_tmp}/{name}/spotguard.sock" in out, "each node's trainer talks to its own daemon"
        assert daemon_gone(short_tmp / name / "spotguard.sock")


# ---------------------------------------------------------------- SkyPilot: the real package

SKYPILOT_PY = REPO / ".tools" / "skypilot" / "bin" / "python"
LOAD_WITH_SKY = """
import json, sys
import sky
from sky.utils import schemas
task = sky.Task.from_yaml(sys.argv[1])
(res,) = list(task.resources)
jr_schema = schemas._get_single_resources_schema()["properties"]["job_recovery"]["anyOf"]
known = sorted(next(s for s in jr_schema if s.get("type") == "object")["properties"])
print(json.dumps({"version": sky.__version__, "job_recovery": res.job_recovery, "known": known,
                  "use_spot": res.use_spot, "num_nodes": task.num_nodes, "name": task.name}))
"""


def skypilot_version() -> str:
    m = re.search(r"^SKYPILOT_VERSION := (\S+)$", (REPO / "Makefile").read_text(), re.M)
    assert m, "Makefile pins SKYPILOT_VERSION"
    return m.group(1)


def test_skypilot_task_loads_with_the_real_package() -> None:
    """`sky.Task.from_yaml` (the pinned skypilot, its own venv from `make skypilot-tools`) accepts the
    task, and every job_recovery field is one the package's schema knows (its client side lets unknown
    ones through to the server, so a misspelt field would pass from_yaml alone)."""
    if not SKYPILOT_PY.exists():
        log = REPO / ".tools" / "skypilot-install.log"
        why = log.read_text()[-800:] if log.exists() else "`make skypilot-tools` has not run"
        pytest.skip(f"skypilot=={skypilot_version()} is not installed in .tools/skypilot: {why}")
    proc = run([str(SKYPILOT_PY), "-c", LOAD_WITH_SKY, str(SKY)], timeout=120)
    got = __import__("json").loads(proc.stdout.strip().splitlines()[-1])
    assert got["version"] == skypilot_version()
    jr = got["job_recovery"]
    assert set(jr) <= set(got["known"]), f"fields SkyPilot does not know: {set(jr) - set(got['known'])}"
    assert jr["recover_on_exit_codes"] == [143] and jr["max_restarts_on_errors"] >= 1
    assert got["use_spot"] is True and got["num_nodes"] == sky()["num_nodes"]


STUB_PREEMPTED_TORCHRUN = """#!/usr/bin/env bash
# The trainers got a spot notice, committed their checkpoint and exited: torchrun reports 1.
spotguard drill --socket "${SPOTGUARD_SOCKET}" --kind "${NOTICE_KIND}" --deadline-in 60 > /dev/null
exit 1
"""


@pytest.mark.parametrize("kind, code", [("preemption", 143), ("termination", 143), ("rebalance", 1), ("", 1)])
def test_skypilot_run_exits_143_only_after_a_spot_notice(short_tmp: Path, kind: str, code: int) -> None:
    """143 is in job_recovery.recover_on_exit_codes: a recovery, not one of max_restarts_on_errors."""
    task = sky()
    env = stub_env(short_tmp)
    stub = short_tmp / "bin" / "torchrun"
    stub.write_text(STUB_PREEMPTED_TORCHRUN if kind else "#!/usr/bin/env bash\nexit 1\n")
    env.update({k: str(v) for k, v in task["envs"].items()})
    env.update(SPOTGUARD_CLOUD="none", SKYPILOT_NODE_IPS="10.1.2.3", SKYPILOT_NUM_NODES="1",
               SKYPILOT_NUM_GPUS_PER_NODE="1", NOTICE_KIND=kind)
    proc = run_script(["bash", "-c", task["run"]], env, short_tmp)
    assert proc.returncode == code, proc.stdout + proc.stderr
    assert code in task["resources"]["job_recovery"]["recover_on_exit_codes"] or code == 1
    assert daemon_gone(short_tmp / ".spotguard" / "spotguard.sock")
