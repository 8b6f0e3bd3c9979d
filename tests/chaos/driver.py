"""The chaos run: a 2-rank torchrun job preempted again and again, with faults at random stages.

``make chaos`` runs the full version (``python -m tests.chaos.driver --preemptions 24``);
``tests/chaos/test_chaos.py`` runs a shortened one inside ``make test``.

Why here and not in ``spotguard/``: it drives test infrastructure that is not part of
the installed package (moto's S3 server behind ``tests/storage/_faultproxy.py``, the
example script, the torchrun log parsing of ``tests/hook/_torchrun.py``).

One *cycle* is one life of a spot VM: fresh daemon(s) (new socket directory, no state),
the emulator reset, the job started with torchrun and resumed from the newest committed
checkpoint, then at a random step a notice arrives — AWS / GCP / Azure through the
emulator and the daemon, SIGTERM to the launcher with no daemon, or a notice that
reaches one rank only (two daemons, "two nodes") — with faults injected at random
stages:

- ``metadata_error`` / ``metadata_hang``: the emulator answers 5xx/429/garbage/resets,
  or never answers, from before the notice until a random moment after it;
- ``daemon_kill``: ``kill -9`` of the daemon (before the notice, right after it, or
  during the save), restarted on the same socket (stale socket file, persisted notice
  state); the job then restarts *on the same VM* and must exit at once (replay) —
  ``replays`` in the table;
- ``storage_5xx`` / ``storage_throttle`` / ``storage_slow``: S3 (moto) behind the fault
  proxy answers 500 InternalError, 503 SlowDown, or answers late;
- ``rank_kill_mid_save``: one rank is SIGKILLed once its shards are written, before the
  commit (``SPOTGUARD_TEST_SAVE_DELAY`` widens that window);
- ``short_deadline``: the notice's deadline is shorter than the save (a widened save),
  and the VM "disappears" (the job is SIGKILLed) at the deadline;
- ``notice_during_periodic``: ``every=`` background checkpoints with a slow store and the
  notice posted while one is uploading (only if ``every=`` is implemented; else reported
  as not exercised).

Damage to committed checkpoints, applied between cycles (one a cycle, from the second on):
the newest committed checkpoint D is copied, record and all, to step D+1 (as if a newer
commit existed) and that copy is damaged, so the job must skip it and resume from D:

- ``flip_shard``: one byte flipped in the middle of a shard (size unchanged);
- ``truncate_shard``: a shard shortened under an intact record;
- ``planted_pickle``: ``.metadata`` replaced by a pickle that would create a marker file,
  with the record's checksum rewritten to match (an attacker with write access);
- ``traversal_key``: an empty object whose key is ``step-D/`` + ``../`` x 12 + an absolute
  path to a victim file, planted in D itself (D stays loadable: the object is not named by
  its record and never read).

The damaged copy is deleted once both ranks resumed. After the run no marker file may exist
(no code ran) and the victim file must be unchanged (nothing outside the cache was written).
S3 (moto) is required: if its server cannot start, the run fails.

Every wait has a timeout: a rank still alive ``HANG_GRACE`` seconds after the notice
deadline is counted as hung and killed. After the last preemption the job runs to the
end and its model + optimizer state are compared bitwise with an uninterrupted run.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from spotguard.launch import DaemonProc, Emulator, query_status, start_daemon, start_emulator

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:  # absolute imports: pytest (importlib mode) and `python -m tests.chaos.driver` alike
    sys.path.insert(0, str(REPO))

from tests.hook._torchrun import TORCHRUN, TorchRun, first_difference, load_out  # noqa: E402
from tests.storage._faultproxy import S3_SLOWDOWN, FaultProxy  # noqa: E402

TRAIN = Path(__file__).resolve().parent / "_train.py"
EXAMPLE = REPO / "examples" / "torchrun_train.py"

MODES = ("aws", "gcp", "azure", "sigterm", "one-rank")
FAULTS = ("metadata_error", "metadata_hang", "daemon_kill", "storage_5xx", "storage_throttle", "storage_slow",
          "rank_kill_mid_save", "short_deadline", "notice_during_periodic")
KILL_STAGES = ("after_notice", "during_save", "before_notice")
DAMAGES = ("flip_shard", "truncate_shard", "planted_pickle", "traversal_key")
ALLOWED_ABANDON = ("rank_kill_mid_save", "short_deadline")  # faults that leave no time or no rank to commit
HANG_GRACE = 20.0  # seconds after the deadline a rank may still be alive before it counts as hung
S3_INTERNAL = (b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>InternalError</Code>'
               b"<Message>We encountered an internal error. Please try again.</Message></Error>")


class ChaosError(AssertionError):
    pass


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _log(msg: str) -> None:
    print(f"[chaos {time.strftime('%H:%M:%S')}] {msg}", flush=True)


# --- storage ---------------------------------------------------------------------------


class S3Store:
    """moto's S3 server behind the fault proxy; ``uri``/``env`` for the workers."""

    def __init__(self, workdir: Path) -> None:
        import boto3  # noqa: F401 - fail early with a clear error if absent

        port = _free_port()
        self.log = open(workdir / "moto.log", "wb")  # noqa: SIM115
        self.proc = subprocess.Popen(
            [sys.executable, "-c", "from moto.server import main; main()", "-H", "127.0.0.1", "-p", str(port)],
            stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)
        end = time.monotonic() + 30
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
                break
            except OSError:
                if time.monotonic() > end or self.proc.poll() is not None:
                    raise ChaosError("moto server did not start") from None
                time.sleep(0.1)
        self.proxy = FaultProxy("127.0.0.1", port).__enter__()
        self.bucket = f"chaos-{uuid.uuid4().hex[:8]}"
        self.uri = f"s3://{self.bucket}/run"
        self.env = {"AWS_ENDPOINT_URL": self.proxy.url, "AWS_ACCESS_KEY_ID": "test", "AWS_SECRET_ACCESS_KEY": "test",
                    "AWS_DEFAULT_REGION": "us-east-1", "SPOTGUARD_PART_SIZE": "5MiB", "SPOTGUARD_MAX_ATTEMPTS": "8"}
        self.client = self._client(f"http://127.0.0.1:{port}")  # the driver's own view: no faults
        self.client.create_bucket(Bucket=self.bucket)

    @staticmethod
    def _client(url: str) -> Any:
        import boto3

        return boto3.client("s3", endpoint_url=url, aws_access_key_id="test", aws_secret_access_key="test",
                            region_name="us-east-1")

    def listing(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for page in self.client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix="run/"):
            for o in page.get("Contents", []):
                out[o["Key"][len("run/"):]] = int(o["Size"])
        return out

    def read(self, key: str) -> bytes:
        return bytes(self.client.get_object(Bucket=self.bucket, Key=f"run/{key}")["Body"].read())

    def put(self, key: str, data: bytes) -> None:
        self.client.put_object(Bucket=self.bucket, Key=f"run/{key}", Body=data)

    def delete_folder(self, folder: str) -> None:
        keys = [f"run/{k}" for k in self.listing() if k.startswith(folder + "/")]
        for i in range(0, len(keys), 1000):
            self.client.delete_objects(Bucket=self.bucket, Delete={"Objects": [{"Key": k} for k in keys[i:i + 1000]]})

    def fault(self, kind: str, rng: random.Random) -> str:
        if kind == "storage_5xx":
            n = rng.randint(2, 5)
            self.proxy.add(method="PUT", status=500, body=S3_INTERNAL, headers={"Content-Type": "application/xml"},
                           count=n)
            return f"{n} x 500 InternalError on PUT"
        if kind == "storage_throttle":
            n = rng.randint(2, 6)
            self.proxy.add(method=None, status=503, body=S3_SLOWDOWN, headers={"Content-Type": "application/xml"},
                           count=n)
            return f"{n} x 503 SlowDown"
        delay = round(rng.uniform(0.2, 0.8), 2)
        n = rng.randint(3, 8)
        self.proxy.add(method="PUT", delay_after=delay, count=n)
        return f"{n} PUTs answered {delay}s late"

    def slow_all(self, delay: float) -> None:
        self.proxy.add(method="PUT", delay_after=delay, count=-1)

    def clear(self) -> None:
        self.proxy.clear()

    def close(self) -> None:
        self.proxy.__exit__(None, None, None)
        self.proc.terminate()
        try:
            self.proc.wait(5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()


class LocalStore:
    """``--storage local``: a local folder (storage faults are then not exercised)."""

    def __init__(self, workdir: Path) -> None:
        self.root = workdir / "ckpt"
        self.root.mkdir()
        self.uri = str(self.root)
        self.env: dict[str, str] = {}

    def listing(self) -> dict[str, int]:
        return {str(p.relative_to(self.root)): p.stat().st_size for p in self.root.rglob("*") if p.is_file()}

    def read(self, key: str) -> bytes:
        return (self.root / key).read_bytes()

    def put(self, key: str, data: bytes) -> None:
        path = self.root / key
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)

    def delete_folder(self, folder: str) -> None:
        shutil.rmtree(self.root / folder, ignore_errors=True)

    def clear(self) -> None:
        pass

    def close(self) -> None:
        pass


def committed_steps(store: Any, damaged: Optional[set[int]] = None) -> dict[int, str]:
    """Independent of spotguard's own scan: step -> reason for every folder whose COMMIT.json parses and
    whose listed files are all there with their sizes (less the steps the driver damaged)."""
    listing = store.listing()
    out: dict[int, str] = {}
    for key in listing:
        head, _, rest = key.partition("/")
        if rest != "COMMIT.json" or not head.startswith("step-"):
            continue
        try:
            rec = json.loads(store.read(key))
            files = rec["files"]
            if int(head[5:]) != rec["step"] or not files:
                continue
            if all(listing.get(f"{head}/{name}") == size for name, size in files.items()) and \
                    int(rec["step"]) not in (damaged or set()):
                out[int(rec["step"])] = str(rec.get("reason"))
        except Exception:  # noqa: BLE001 - unreadable = not committed
            continue
    return out


# --- one cycle -------------------------------------------------------------------------


@dataclass
class Cycle:
    index: int
    mode: str
    faults: dict[str, str] = field(default_factory=dict)
    resumed: Optional[int] = None
    expected_resume: Optional[int] = None
    resumed_committed: bool = True
    notice_step: Optional[int] = None
    last_step: Optional[int] = None
    notice_id: Optional[str] = None
    outcome: str = ""
    committed_step: Optional[int] = None
    abandoned: Optional[str] = None
    hung: int = 0
    exit_seconds: Optional[float] = None
    replay: Optional[str] = None
    periodic_commits: int = 0
    damage: Optional[str] = None
    damage_logged: bool = False
    notes: list[str] = field(default_factory=list)

    def row(self) -> str:
        f = ",".join(self.faults) or "-"
        return (f"{self.index:>3} {self.mode:<9} resume={self.resumed!s:<4} notice@{self.notice_step!s:<4} "
                f"last={self.last_step!s:<4} -> {self.outcome:<10} {('step ' + str(self.committed_step)) if self.committed_step is not None else (self.abandoned or '')}"
                f"  faults={f}" + (f" replay={self.replay}" if self.replay else "")
                + (f" hung={self.hung}" if self.hung else "") + (f" damage={self.damage}" if self.damage else ""))


class Chaos:
    def __init__(self, workdir: Path, *, preemptions: int, seed: int, step_time: float = 0.15,
                 storage: str = "s3", fault_rate: float = 0.6) -> None:
        self.workdir = workdir
        self.preemptions = preemptions
        self.rng = random.Random(seed)
        self.seed = seed
        self.step_time = step_time
        self.fault_rate = fault_rate
        self.total_steps = 20 * preemptions + 20
        self.storage_kind = storage
        self.store: Any = None
        self.emu: Optional[Emulator] = None
        self.cycles: list[Cycle] = []
        self.periodic_supported = False
        self.not_exercised: dict[str, str] = {}
        self.final_identical: Optional[bool] = None
        self.final_diff: Optional[str] = None
        self._planned: set[str] = set()
        self._kills = 0
        self.damaged: set[int] = set()
        self.victim = workdir / "victim.txt"  # a traversal key points here: it must never change
        self.marker = workdir / "planted-pickle-ran"  # a planted pickle would create this

    # --- set-up -------------------------------------------------------------------

    def setup(self) -> None:
        self.emu = start_emulator(stderr=open(self.workdir / "emulator.log", "wb"))  # noqa: SIM115
        self.victim.write_bytes(b"outside the cache: never touched\n")
        if self.storage_kind == "s3":  # a test dependency: no silent fallback
            try:
                self.store = S3Store(self.workdir)
            except ImportError as exc:
                raise ChaosError(f"S3 (moto[server], boto3) is required for the chaos run: {exc}; "
                                 f"pip install -r requirements-storage.txt") from None
        if self.storage_kind == "local":
            self.store = LocalStore(self.workdir)
            for k in ("storage_5xx", "storage_throttle", "storage_slow"):
                self.not_exercised[k] = "local storage (moto not installed): no object-store faults"
        self.periodic_supported = self._probe_every()
        if not self.periodic_supported:
            self.not_exercised["notice_during_periodic"] = ("install_preemption_hook(every=...) is not "
                                                            "implemented in this spotguard version")

    @staticmethod
    def _probe_every() -> bool:
        """Whether this spotguard's ``install_preemption_hook`` takes ``every=`` (read from its signature here,
        not by a hook in a child python: a torch import's seconds; a broken ``every=`` then fails its cycle)."""
        import inspect

        from spotguard import install_preemption_hook

        return "every" in inspect.signature(install_preemption_hook).parameters

    def close(self) -> None:
        if self.emu is not None:
            self.emu.stop()
        if self.store is not None:
            self.store.close()

    # --- reference -------------------------------------------------------------------

    def start_reference(self) -> TorchRun:
        """The uninterrupted run, started before the cycles (independent of them: it only has to be done for
        the final comparison); ``reference`` waits for it."""
        return TorchRun(self.workdir / "reference.log", ["--steps", str(self.total_steps), "--no-hook", "--out",
                                                          str(self.workdir / "reference.pt")])

    def reference(self, run: Optional[TorchRun] = None) -> Path:
        run = run or self.start_reference()
        try:
            if run.wait(300) != 0:
                raise ChaosError(f"reference run failed:\n{run.tail()}")
        finally:
            run.kill()
        return self.workdir / "reference.pt"

    # --- the plan -------------------------------------------------------------------

    def plan(self, i: int) -> tuple[str, list[str]]:
        """The mode rotates; faults not exercised yet come first (two a cycle), then one more at random."""
        mode = MODES[i % len(MODES)]
        usable = [f for f in FAULTS if f not in self.not_exercised]

        def fits(f: str, chosen: list[str]) -> bool:
            if mode == "sigterm" and f in ("metadata_error", "metadata_hang", "daemon_kill", "short_deadline"):
                return False  # no daemon, and torchrun's SIGTERM path has its fixed 30 s
            if mode == "gcp" and f == "short_deadline":
                return False  # GCP's notice length is fixed (30 s) by the watcher
            exclusive = {"rank_kill_mid_save", "short_deadline", "notice_during_periodic"}
            return f not in chosen and not (f in exclusive and exclusive & set(chosen))

        faults: list[str] = []
        for f in [f for f in usable if f not in self._planned]:
            if len(faults) < 2 and fits(f, faults):
                faults.append(f)
        if self.rng.random() < self.fault_rate:
            extra = [f for f in usable if fits(f, faults)]
            if extra:
                faults.append(self.rng.choice(extra))
        self._planned.update(faults)
        return mode, faults

    # --- a cycle ---------------------------------------------------------------------

    def run_cycle(self, i: int, *, final: bool = False) -> Cycle:
        assert self.emu is not None
        mode, faults = ("final", []) if final else self.plan(i)
        c = Cycle(i, mode)
        cdir = self.workdir / f"cycle-{i:02d}"
        cdir.mkdir()
        sockdir = Path(tempfile.mkdtemp(prefix="sgc", dir="/tmp"))  # a new VM: no socket, no state
        self.emu.reset()
        self.emu.control("config", {"azure_rate_limit": 0})
        self.store.clear()
        damaged_step = self._damage(i, c)
        known = committed_steps(self.store, self.damaged)
        c.expected_resume = max(known) if known else 0
        daemons: list[DaemonProc] = []
        env: dict[str, str] = {**self.store.env, "SPOTGUARD_SOCKET": str(sockdir / "none.sock")}
        cloud = mode if mode in ("aws", "gcp", "azure") else None
        if mode == "one-rank":
            cloud = self.rng.choice(("aws", "azure") if "short_deadline" in faults else ("aws", "gcp", "azure"))
            c.notes.append(f"rank 1's node gets a {cloud} notice; rank 0's daemon hears nothing")
        target_sock: Optional[str] = None
        if cloud is not None and not final:
            if mode == "one-rank":
                a = start_daemon(str(sockdir / "a.sock"), cloud="none", log_path=cdir / "daemon-a.log")
                b = self._daemon(sockdir / "b.sock", cloud, cdir / "daemon-b.log")
                daemons += [a, b]
                env.update(SG_TEST_SOCKET_RANK0=a.socket, SG_TEST_SOCKET_RANK1=b.socket)
                target_sock = b.socket
            else:
                d = self._daemon(sockdir / "d.sock", cloud, cdir / "daemon.log")
                daemons.append(d)
                env["SPOTGUARD_SOCKET"] = d.socket
                target_sock = d.socket
        notice_in = self.rng.choice((20, 25, 30))
        if "short_deadline" in faults:
            notice_in = 3
            env.update(SPOTGUARD_TEST_SAVE_DELAY="6")
            c.faults["short_deadline"] = "deadline 3 s, the save takes > 6 s; the VM vanishes at the deadline"
        kill_rank: Optional[int] = None
        if "rank_kill_mid_save" in faults:
            kill_rank = self.rng.randint(0, 1)
            env.update(SPOTGUARD_TEST_SAVE_DELAY="20", SPOTGUARD_TEST_SAVE_DELAY_RANK=str(kill_rank))
        if "notice_during_periodic" in faults:
            env["SG_CHAOS_EVERY"] = "1s"
            if self.storage_kind == "s3":
                self.store.slow_all(0.4)
        # the final run has no notice to time: its steps need no simulated work (the sleep is all --step-time does)
        step_time = 0.0 if final else self.step_time
        args = ["--steps", str(self.total_steps), "--step-time", str(step_time), "--storage", self.store.uri]
        out = self.workdir / "final.pt"
        if final:
            args += ["--out", str(out)]
        run = _Run(cdir / "job.log", args, env=env)
        try:
            self._wait_resumed(run, c)
            if damaged_step is not None:  # resumed past it: remove the damaged copy
                c.damage_logged = bool(run.events("skipping damaged checkpoint"))
                self.store.delete_folder(f"step-{damaged_step:08d}")
            if final:
                rc = run.wait(self.total_steps * self.step_time * 4 + 120)
                c.outcome = "finished" if rc == 0 else f"rc={rc}"
                c.last_step = max(run.steps(), default=None)
                return c
            target = min(c.expected_resume + self.rng.randint(2, 6), self.total_steps - 4)
            if target <= (c.resumed or 0):
                target = (c.resumed or 0) + 1
            if target >= self.total_steps - 2:
                raise ChaosError(f"ran out of steps at cycle {i}: raise total_steps")
            if target_sock is not None:
                subs_ranks = {1} if mode == "one-rank" else {0, 1}
                _wait(lambda: {s.get("rank") for s in query_status(target_sock)["subscribers"]} >= subs_ranks,
                      60, "subscribed", run)
            if "notice_during_periodic" in faults and self.periodic_supported:
                _wait(lambda: bool(run.events("periodic_started")), 60, "a periodic checkpoint to start", run)
                c.faults["notice_during_periodic"] = "notice posted while a periodic checkpoint uploads (slow S3)"
            else:
                run.wait_step(target, timeout=90)
            time.sleep(self.rng.uniform(0, self.step_time))  # a random moment inside the step
            c.notice_step = max(run.steps(), default=None)
            pre = [f for f in faults if f in ("metadata_error", "metadata_hang", "storage_5xx", "storage_throttle",
                                              "storage_slow")]
            for f in pre:
                self._inject(f, cloud, c)
            kill_when = None
            if "daemon_kill" in faults and daemons:
                kill_when = KILL_STAGES[self._kills % len(KILL_STAGES)]  # rotate: every stage is hit
                self._kills += 1
                c.faults["daemon_kill"] = f"kill -9 {kill_when}, restarted on the same socket"
                if kill_when == "before_notice":
                    daemons[-1] = self._restart(daemons[-1], cloud or "none", cdir, c)
            posted = time.monotonic()
            deadline_mono = posted + (30.0 if mode == "sigterm" else notice_in)
            if mode == "sigterm":
                run.proc.send_signal(signal.SIGTERM)
            else:
                rec = self.emu.notice(cloud, "preemption", in_seconds=notice_in)
                c.notes.append(f"emulator notice {rec.get('id')}")
            for f in ("metadata_error", "metadata_hang"):
                if f in faults and cloud:
                    time.sleep(self.rng.uniform(0.3, 1.5))
                    self.emu.control("fault/clear")
            if kill_when == "after_notice":
                _wait(lambda: bool(run.events("notice_seen")), 60, "notice seen", run)
                daemons[-1] = self._restart(daemons[-1], cloud or "none", cdir, c)
            elif kill_when == "during_save":
                _wait(lambda: bool(run.events("checkpoint_started")) or run.proc.poll() is not None, 60,
                      "checkpoint started", run)
                daemons[-1] = self._restart(daemons[-1], cloud or "none", cdir, c)
            if kill_rank is not None:
                _wait(lambda: bool(run.events("checkpoint_started", kill_rank)), 60,
                      f"rank {kill_rank} checkpoint_started", run)
                time.sleep(0.5)  # its shards are written; it now sits in the widened save
                os.kill(run.pid(kill_rank), signal.SIGKILL)
                c.faults["rank_kill_mid_save"] = f"rank {kill_rank} SIGKILLed after writing its shards"
            # Wait for the job to leave: the VM disappears at the deadline (short_deadline), and
            # a rank alive HANG_GRACE s after the deadline is hung.
            hard_off = deadline_mono if "short_deadline" in faults else deadline_mono + HANG_GRACE
            while run.proc.poll() is None and time.monotonic() < hard_off:
                time.sleep(0.05)
            if run.proc.poll() is None:
                alive = run.alive_workers()
                if "short_deadline" in faults:
                    c.notes.append(f"VM gone at the deadline with {len(alive)} worker(s) still saving")
                else:
                    c.hung = len(alive)
                run.kill()
            c.exit_seconds = round(time.monotonic() - posted, 2)
            c.last_step = max(run.steps(), default=None)
            ids = {e.get("notice_id") for e in run.events("checkpoint_committed")} | {
                e.get("notice_id") for e in run.events("agreed")}
            ids.discard(None)
            c.notice_id = ",".join(sorted(ids)) or None
            c.periodic_commits = len([e for e in run.events("periodic_committed") if e.get("rank") == 0])
            now = committed_steps(self.store, self.damaged)
            new = sorted(s for s in now if s not in known and now[s] != "periodic")
            if new:
                c.outcome, c.committed_step = "committed", new[-1]
            else:
                c.outcome = "abandoned"
                c.abandoned = self._why_abandoned(run, faults, c)
            if kill_when in ("after_notice", "during_save") and daemons and c.outcome == "committed":
                c.replay = self._replay(cdir, env, c)
        finally:
            run.kill()
            for d in daemons:
                d.stop()
            shutil.rmtree(sockdir, ignore_errors=True)
        return c

    def _damage(self, i: int, c: Cycle) -> Optional[int]:
        """From the second cycle on, one damage kind not applied yet, to the newest committed checkpoint D:
        a damaged copy at D+1 (returned, to be deleted after the resume), or a traversal key planted in D."""
        kinds = [k for k in DAMAGES if k not in self._planned]
        known = committed_steps(self.store, self.damaged)
        if i == 0 or not kinds or not known:
            return None
        kind = kinds[0]
        self._planned.add(kind)
        d = max(known)
        src = f"step-{d:08d}"
        if kind == "traversal_key":
            key = f"{src}/" + "../" * 12 + str(self.victim).lstrip("/")
            self.store.put(key, b"")
            c.damage = kind
            c.faults[kind] = f"empty object {src}/../..(x12)/{self.victim.name} planted in step {d}"
            return None
        e = d + 1
        dst = f"step-{e:08d}"
        for key in [k for k in self.store.listing() if k.startswith(src + "/")]:
            data = self.store.read(key)
            if key.endswith("/COMMIT.json"):
                rec = json.loads(data)
                rec["step"] = e
                data = json.dumps(rec).encode()
            self.store.put(dst + key[len(src):], data)
        rec = json.loads(self.store.read(f"{dst}/COMMIT.json"))
        shard = sorted(n for n in rec["files"] if n.endswith(".distcp"))[0]
        if kind == "flip_shard":
            data = bytearray(self.store.read(f"{dst}/{shard}"))
            data[len(data) // 2] ^= 0x01
            self.store.put(f"{dst}/{shard}", bytes(data))
            c.faults[kind] = f"one byte flipped in {shard} of a copy of step {d} at step {e}"
        elif kind == "truncate_shard":
            data = self.store.read(f"{dst}/{shard}")
            self.store.put(f"{dst}/{shard}", data[:-100])
            c.faults[kind] = f"{shard} of a copy of step {d} at step {e} truncated under an intact record"
        else:  # planted_pickle: the attacker rewrites the record's checksum too
            from spotguard.storage.integrity import digest_of

            evil = _planted_pickle(self.marker)
            self.store.put(f"{dst}/.metadata", evil)
            rec["files"][".metadata"] = len(evil)
            rec["bytes"] = sum(rec["files"].values())
            rec.setdefault("checksums", {})[".metadata"] = digest_of(evil).blocks
            self.store.put(f"{dst}/COMMIT.json", json.dumps(rec).encode())
            c.faults[kind] = f".metadata of a copy of step {d} at step {e} replaced by a code-running pickle"
        c.damage = kind
        self.damaged.add(e)
        return e

    def _daemon(self, sock: Path, cloud: str, log: Path) -> DaemonProc:
        assert self.emu is not None
        return start_daemon(str(sock), cloud=cloud, metadata_url=self.emu.url, extra_args=["--poll-interval", "0.5"],
                            log_path=log)

    def _restart(self, d: DaemonProc, cloud: str, cdir: Path, c: Cycle) -> DaemonProc:
        d.proc.send_signal(signal.SIGKILL)
        d.proc.wait()
        time.sleep(self.rng.uniform(0.1, 1.0))
        n = len(list(cdir.glob("daemon*.log")))
        if cloud == "none":
            return start_daemon(d.socket, cloud="none", log_path=cdir / f"daemon-restart{n}.log")
        return self._daemon(Path(d.socket), cloud, cdir / f"daemon-restart{n}.log")

    def _inject(self, kind: str, cloud: Optional[str], c: Cycle) -> None:
        assert self.emu is not None
        if kind.startswith("storage_"):
            if self.storage_kind == "s3":
                c.faults[kind] = self.store.fault(kind, self.rng)
            return
        if not cloud:
            return
        if kind == "metadata_hang":
            self.emu.control("fault", {"cloud": cloud, "mode": "hang"})
            c.faults[kind] = f"{cloud} metadata hangs until cleared"
        else:
            mode = self.rng.choice(("status", "status", "malformed", "reset", "content_type"))
            body: dict[str, Any] = {"cloud": cloud, "mode": mode}
            if mode == "status":
                body["status"] = self.rng.choice((500, 503, 429, 404 if cloud == "azure" else 503))
            self.emu.control("fault", body)
            c.faults[kind] = f"{cloud} metadata {mode}{' ' + str(body.get('status')) if mode == 'status' else ''}"

    def _why_abandoned(self, run: "_Run", faults: list[str], c: Cycle) -> str:
        if "rank_kill_mid_save" in faults:
            return "rank SIGKILLed mid-save (no commit record)"
        if "short_deadline" in faults:
            return "deadline shorter than the save (VM gone before the commit)"
        failed = run.events("checkpoint_failed")
        if failed:
            return "checkpoint_failed: " + str(failed[0].get("error"))[:120]
        if c.hung:
            return "hung ranks killed"
        return "no checkpoint (see the cycle's job.log)"

    def _wait_resumed(self, run: "_Run", c: Cycle) -> None:
        _wait(lambda: len(run.events("resumed")) >= 2, 120, "both ranks resumed", run)
        steps = {e["rank"]: e["step"] for e in run.events("resumed")}
        if len(set(steps.values())) != 1:
            raise ChaosError(f"ranks resumed from different steps: {steps}")
        c.resumed = next(iter(steps.values()))
        known = committed_steps(self.store, self.damaged)
        c.resumed_committed = c.resumed == 0 or c.resumed in known

    def _replay(self, cdir: Path, env: dict[str, str], c: Cycle) -> str:
        """The launcher restarts the job on the same (doomed) VM: the restarted daemon replays the notice,
        which must be recognised as already checkpointed for: exit at once, no training, no new checkpoint."""
        before = committed_steps(self.store, self.damaged)
        args = ["--steps", str(self.total_steps), "--step-time", str(self.step_time), "--storage", self.store.uri]
        env = {k: v for k, v in env.items() if not k.startswith("SPOTGUARD_TEST_")}
        run = _Run(cdir / "replay.log", args, env=env)
        try:
            rc = run.wait(120)
        except AssertionError:
            return "hung"
        agreed = {e.get("action") for e in run.events("agreed")}
        trained = run.steps()
        if rc != 0 and agreed == {"exit"} and not trained and committed_steps(self.store, self.damaged) == before:
            return "exit-at-once"
        return f"WRONG(rc={rc}, actions={sorted(agreed)}, trained={len(trained)} steps)"

    # --- the whole run -----------------------------------------------------------------

    def run(self) -> dict[str, Any]:
        t0 = time.monotonic()
        ref_run = self.start_reference()
        try:
            self.setup()
            _log(f"reference run started ({self.total_steps} steps); storage {self.storage_kind} {self.store.uri}; "
                 f"every= {'supported' if self.periodic_supported else 'NOT implemented'}")
            for i in range(self.preemptions):
                c = self.run_cycle(i)
                self.cycles.append(c)
                _log(c.row())
            final = self.run_cycle(self.preemptions, final=True)
            self.cycles.append(final)
            _log(final.row())
        except BaseException:
            ref_run.kill()
            raise
        ref = self.reference(ref_run)
        out = self.workdir / "final.pt"
        if final.outcome == "finished" and out.exists():
            self.final_diff = first_difference(load_out(ref), load_out(out))
            self.final_identical = self.final_diff is None
        else:
            self.final_identical = False
            self.final_diff = f"final run {final.outcome}"
        summary = self.summary()
        summary["report"] = self.report()
        summary["seconds"] = round(time.monotonic() - t0, 1)
        return summary

    def report(self) -> dict[str, Any]:
        """``spotguard report`` of the run's storage: its history was written through the same faults."""
        from spotguard.report.cli import build_figures  # noqa: PLC0415

        env = dict(getattr(self.store, "env", {}))
        before = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        try:
            self.store.clear()
            fig = build_figures(self.store.uri)
        finally:
            for k, v in before.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
        return {"attempts": len(fig.attempts), "preemptions": len(fig.preemptions),
                "preemptions_by": fig.preemptions_by, "steps_recomputed": fig.steps_recomputed,
                "goodput_percent": round(fig.goodput_percent, 1), "downtime_seconds": round(fig.downtime_seconds, 1),
                "skipped": fig.skipped}

    def summary(self) -> dict[str, Any]:
        pre = [c for c in self.cycles if c.mode != "final"]
        faults: Counter[str] = Counter()
        for c in self.cycles:  # the final run may start on a damaged checkpoint too
            faults.update(c.faults.keys())
        abandoned: Counter[str] = Counter(c.abandoned for c in pre if c.outcome == "abandoned")
        # Steps lost per preemption: iterations completed in the cycle minus where the next cycle resumed.
        lost: list[int] = []
        for c, nxt in zip(self.cycles, self.cycles[1:]):
            if c.mode == "final" or nxt.resumed is None:
                continue
            done = (c.last_step + 1) if c.last_step is not None else (c.resumed or 0)
            lost.append(max(0, done - nxt.resumed))
        lost_clean = [n for c, n in zip(pre, lost) if c.outcome == "committed"]
        wrong_resume = [c.index for c in self.cycles if c.resumed != c.expected_resume]
        incomplete = [c.index for c in self.cycles if not c.resumed_committed]
        # A preemption with enough time (no rank killed, deadline longer than the save) must commit.
        abandoned_with_time = [c.index for c in pre if c.outcome != "committed"
                               and not set(c.faults) & set(ALLOWED_ABANDON)]
        from_commit = [c.index for c in self.cycles if (c.resumed or 0) > 0 and c.resumed_committed]
        owed = [c.index for c in self.cycles if (c.expected_resume or 0) > 0]
        return {
            "seed": self.seed,
            "storage": self.storage_kind,
            "preemptions": len(pre),
            "modes": dict(Counter(c.mode for c in pre)),
            "faults": dict(sorted(faults.items())),
            "faults_not_exercised": self.not_exercised,
            "checkpoints_committed": sum(c.outcome == "committed" for c in pre),
            "preemptions_with_time_not_committed": abandoned_with_time,
            "resumes_from_committed_step": len(from_commit),
            "resumes_owed": len(owed),
            "damage_applied": [f"{c.index}:{c.damage}" for c in self.cycles if c.damage],
            "damage_logged": [f"{c.index}:{c.damage}" for c in self.cycles if c.damage and c.damage_logged],
            "planted_code_ran": self.marker.exists(),
            "outside_cache_touched": self.victim.read_bytes() != b"outside the cache: never touched\n",
            "periodic_committed": sum(c.periodic_commits for c in self.cycles),
            "checkpoints_abandoned": dict(abandoned),
            "steps_lost_max": max(lost, default=0),
            "steps_lost_mean": round(sum(lost) / len(lost), 2) if lost else 0.0,
            "steps_lost_committed_max": max(lost_clean, default=0),
            "steps_lost_committed_mean": round(sum(lost_clean) / len(lost_clean), 2) if lost_clean else 0.0,
            "resumes_from_incomplete": len(incomplete),
            "resumes_not_newest_committed": wrong_resume,
            "hung_ranks": sum(c.hung for c in self.cycles),
            "replays": dict(Counter(c.replay for c in self.cycles if c.replay)),
            "exit_seconds_max": max((c.exit_seconds or 0 for c in pre), default=0),
            "final_state_identical": self.final_identical,
            "final_difference": self.final_diff,
            "cycles": [c.row() for c in self.cycles],
        }


class _Run(TorchRun):
    """``TorchRun`` of the chaos worker script."""

    def __init__(self, log: Path, args: list[str], *, env: Optional[dict[str, str]] = None) -> None:
        self.log = log
        full_env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **(env or {})}
        with open(log, "wb") as f:
            self.proc = subprocess.Popen(
                [str(TORCHRUN), "--standalone", "--nproc-per-node", "2", str(TRAIN), *args],
                stdout=f, stderr=subprocess.STDOUT, env=full_env, cwd=str(log.parent), start_new_session=True)

    def alive_workers(self) -> list[int]:
        out = []
        for e in self.events("hook_installed"):
            try:
                os.kill(int(e["pid"]), 0)
                out.append(int(e["pid"]))
            except (ProcessLookupError, KeyError, ValueError):
                pass
        return out


class _Planted:
    marker = ""

    def __reduce__(self) -> Any:
        return (os.system, (f"touch {self.marker}",))


def _planted_pickle(marker: Path) -> bytes:
    import pickle

    p = _Planted()
    p.marker = str(marker)
    return pickle.dumps(p)


def _wait(pred: Any, timeout: float, what: str, run: Optional[TorchRun] = None) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        try:
            if pred():
                return
        except OSError:
            pass
        if run is not None and run.proc.poll() is not None:
            try:
                if pred():
                    return
            except OSError:
                pass
            raise ChaosError(f"torchrun exited ({run.proc.returncode}) before {what}:\n{run.tail()}")
        time.sleep(0.05)
    raise ChaosError(f"timed out after {timeout}s waiting for {what}" + (f":\n{run.tail()}" if run else ""))


def render(summary: dict[str, Any]) -> str:
    s = summary
    rows = [
        ("preemptions", f"{s['preemptions']} ({', '.join(f'{k} {v}' for k, v in s['modes'].items())})"),
        ("faults injected", ", ".join(f"{k} {v}" for k, v in s["faults"].items()) or "none"),
        ("faults not exercised", "; ".join(f"{k}: {v}" for k, v in s["faults_not_exercised"].items()) or "none"),
        ("checkpoints committed", f"{s['checkpoints_committed']} emergency + {s['periodic_committed']} periodic"),
        ("checkpoints abandoned", ", ".join(f"{v} x {k}" for k, v in s["checkpoints_abandoned"].items()) or "0"),
        ("steps lost / preemption", f"max {s['steps_lost_max']}, mean {s['steps_lost_mean']} (committed ones: "
                                    f"max {s['steps_lost_committed_max']}, mean {s['steps_lost_committed_mean']})"),
        ("resumes from an incomplete ckpt", str(s["resumes_from_incomplete"])),
        ("resumes from a committed step", f"{s['resumes_from_committed_step']} of {s['resumes_owed']} owed"),
        ("preemptions with time, no commit", str(s["preemptions_with_time_not_committed"] or "none")),
        ("damaged checkpoints skipped", ", ".join(s["damage_applied"]) or "none"),
        ("planted code ran / outside touched", f"{s['planted_code_ran']} / {s['outside_cache_touched']}"),
        ("resumes not from newest commit", str(len(s["resumes_not_newest_committed"]))),
        ("hung ranks", str(s["hung_ranks"])),
        ("same-VM replays after daemon kill", ", ".join(f"{v} x {k}" for k, v in s["replays"].items()) or "none"),
        ("slowest exit after the notice", f"{s['exit_seconds_max']} s"),
        ("final state identical", "yes" if s["final_state_identical"] else f"NO ({s['final_difference']})"),
    ]
    w = max(len(k) for k, _ in rows)
    out = [f"| {'chaos run (seed ' + str(s['seed']) + ', ' + s['storage'] + ' storage)':<{w}} | |",
           f"|{'-' * (w + 2)}|---|"]
    out += [f"| {k:<{w}} | {v} |" for k, v in rows]
    return "\n".join(out)


def verdict(summary: dict[str, Any]) -> list[str]:
    """What must hold; each broken rule is one line."""
    bad = []
    if summary["resumes_from_incomplete"]:
        bad.append(f"{summary['resumes_from_incomplete']} resume(s) from an incomplete checkpoint")
    if summary["resumes_not_newest_committed"]:
        bad.append(f"cycles {summary['resumes_not_newest_committed']} did not resume from the newest commit")
    if summary["hung_ranks"]:
        bad.append(f"{summary['hung_ranks']} hung rank(s)")
    if not summary["final_state_identical"]:
        bad.append(f"final state differs: {summary['final_difference']}")
    wrong = [k for k in summary["replays"] if k != "exit-at-once"]
    if wrong:
        bad.append(f"same-VM replay misbehaved: {wrong}")
    if summary["preemptions"] and not summary["checkpoints_committed"]:
        bad.append("no checkpoint was committed in the whole run")
    if summary["preemptions_with_time_not_committed"]:
        bad.append(f"cycles {summary['preemptions_with_time_not_committed']} had time but committed nothing")
    if summary["resumes_from_committed_step"] != summary["resumes_owed"]:
        bad.append(f"{summary['resumes_from_committed_step']} resumes from a committed step, "
                   f"{summary['resumes_owed']} owed")
    if summary["planted_code_ran"]:
        bad.append("a planted pickle ran code")
    if summary["outside_cache_touched"]:
        bad.append("a planted key made spotguard write outside its folder")
    if summary["steps_lost_committed_max"] > 1:
        bad.append(f"a committed emergency checkpoint lost {summary['steps_lost_committed_max']} steps (max 1)")
    return bad


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tests.chaos.driver", description=__doc__.splitlines()[0])
    p.add_argument("--preemptions", type=int, default=24)
    p.add_argument("--seed", type=int, default=int(os.environ.get("SG_CHAOS_SEED", "0") or 0) or None)
    p.add_argument("--storage", choices=("s3", "local"), default="s3")
    p.add_argument("--workdir", default=None, help="keep logs here (default: a temp dir, kept on failure)")
    p.add_argument("--json", default=None, help="write the summary as JSON to this file")
    args = p.parse_args(argv)
    seed = args.seed if args.seed is not None else random.randrange(1, 1 << 30)
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="spotguard-chaos-"))
    workdir.mkdir(parents=True, exist_ok=True)
    _log(f"workdir {workdir}, seed {seed}, {args.preemptions} preemptions")
    chaos = Chaos(workdir, preemptions=args.preemptions, seed=seed, storage=args.storage)
    try:
        summary = chaos.run()
    finally:
        chaos.close()
    print("\n".join(summary["cycles"]))
    print(render(summary))
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=2))
    bad = verdict(summary)
    for line in bad:
        print(f"CHAOS FAILURE: {line}")
    print(f"chaos run: {'FAILED' if bad else 'ok'} in {summary['seconds']} s (logs in {workdir})")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
