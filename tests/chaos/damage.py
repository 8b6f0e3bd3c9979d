"""Damaged, forged and truncated checkpoints mixed into a preemption chain with ``keep`` = 1, 2, 3 (issue 24).

``make chaos`` runs the long version (``python -m tests.chaos.damage --trials 36``);
``tests/chaos/test_damage_chain.py`` runs a few trials inside ``make test``.

One *trial* is one training run (the exact loop of ``tests/hook/test_boundary.py``:
model, BatchNorm, dropout, SGD with momentum, a scheduler, an EMA, a data position,
Python/NumPy/torch RNG) preempted again and again: each *life* is a fresh ``Hook``
with the trial's ``keep`` that resumes and is preempted at a random step, which
commits the next one. Why in-process and on the file backend: the storage side of
quarantine is backend-neutral (``tests/storage/_contract.py`` checks the mark on
S3, GCS and Azure), and in-process lives make 30+ trials fit in a minute.

Between lives the driver damages storage, as bit rot, a bad disk, a buggy copy tool
or a writer without the job key would (``$SPOTGUARD_COMMIT_KEY`` is set for the run):

- ``flip``: one byte flipped in the middle of a shard (size and record intact: only a
  full read finds it, so resume must quarantine it);
- ``truncate``: a shard shortened under its record;
- ``forge_sizes``: the record rewritten to list other sizes (unsigned: no key);
- ``forge_lineage``: the record rewritten to claim another run's lineage, its old
  signature kept (stale).

Each hits either the newest committed checkpoint D in place, or a copy of D planted at
a newer step D+k (record step rewritten and, for ``flip``, re-signed with the key: a
real newer commit that rotted). The driver keeps its own oracle (which folders hold a
record and which of those it damaged, by the record's SHA-256), never spotguard's
listing. Per life the verdict checks: resume loaded exactly the newest good checkpoint
(none of committed work lost, never a damaged one) or, when no good one is left,
refused with the clear error (the operator then deletes the damaged folders and the
run starts from 0); a checkpoint is read in full at most once per record (DCP readers
opened, counted through a storage wrapper); the life's own commit is present and good
afterwards (retention kept it; a save at a quarantined step really committed). At the
end the run goes to the last step and its state must equal an uninterrupted run's,
bitwise.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import shutil
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any, Optional

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:  # absolute imports: pytest (importlib mode) and `python -m` alike
    sys.path.insert(0, str(REPO))

from spotguard.hook import Hook, Preempted  # noqa: E402
from spotguard.storage.commit import KEY_ENV, CommitRecord, delete_quarantined, step_dir  # noqa: E402
from spotguard.storage.integrity import digest_of  # noqa: E402
from tests.hook.test_boundary import boundary_path, make, notice, one_iteration, reference, snapshot  # noqa: E402
from tests.hook.test_quarantine import CountingStorage  # noqa: E402

KINDS = ("flip", "truncate", "forge_sizes", "forge_lineage")
TARGETS = ("newest", "copy")
TOTAL = 24  # steps of one run
LIVES = 6  # preemptions per trial (fewer if the run reaches TOTAL first)
KEY = "chaos-job-secret"
COMMIT = "COMMIT.json"


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _shard(folder: Path) -> Path:
    return sorted(p for p in folder.iterdir() if p.suffix == ".distcp")[0]


class Oracle:
    """What the driver knows independently: folders with a record, and the records it damaged (by SHA-256)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.bad: dict[str, str] = {}  # dir -> sha of the damaged record

    def recorded(self) -> dict[str, int]:
        return {p.name: int(p.name[5:]) for p in self.root.glob("step-*") if (p / COMMIT).is_file()}

    def good(self) -> list[int]:
        return sorted(step for d, step in self.recorded().items()
                      if d not in self.bad or self.bad[d] != _sha(self.root / d / COMMIT))

    def damaged(self) -> list[str]:
        """Damaged folders still there under the record the driver damaged (a later save replaces them)."""
        return sorted(d for d in self.recorded() if d in self.bad and self.bad[d] == _sha(self.root / d / COMMIT))


def _resign(rec: dict[str, Any]) -> dict[str, Any]:
    """What a real commit by this job writes: the record signed with the job key."""
    r = CommitRecord.from_dict(rec)
    r.signature = None
    r.sign(KEY.encode())
    return r.to_dict()


def damage(root: Path, oracle: Oracle, rng: random.Random, kind: str, target: str) -> Optional[str]:
    """Apply ``kind`` to the newest good checkpoint or to a copy of it at a newer step; ``kind@target`` done.

    The newest itself is hit mostly when an older good one remains (a fallback); when it is the only one,
    rarely (then nothing good is left and resume must refuse).
    """
    good = oracle.good()
    if not good:
        return None
    if target == "newest" and len(good) == 1 and rng.random() < 0.75:
        target = "copy"
    d = good[-1]
    src = root / step_dir(d)
    if target == "copy":
        step = d + rng.randint(1, 3)
        folder = root / step_dir(step)
        if folder.exists():
            return None
        shutil.copytree(src, folder)
        rec = json.loads((folder / COMMIT).read_text())
        rec["step"] = step
        (folder / COMMIT).write_text(json.dumps(_resign(rec)))
    else:
        folder = src
    shard = _shard(folder)
    rec = json.loads((folder / COMMIT).read_text())
    if kind == "flip":
        b = bytearray(shard.read_bytes())
        b[len(b) // 2] ^= 0x10
        shard.write_bytes(bytes(b))
    elif kind == "truncate":
        shard.write_bytes(shard.read_bytes()[: max(1, shard.stat().st_size // 3)])
    elif kind == "forge_sizes":
        data = shard.read_bytes() + b"\0" * 64
        shard.write_bytes(data)
        rec["files"][shard.name] = len(data)
        rec["bytes"] = sum(rec["files"].values())
        rec["checksums"][shard.name] = digest_of(data).blocks
        rec.pop("hmac", None)  # the forger has no key
        (folder / COMMIT).write_text(json.dumps(rec))
    elif kind == "forge_lineage":
        rec["extra"]["lineage"] = "another-run-" + os.urandom(4).hex()
        (folder / COMMIT).write_text(json.dumps(rec))  # its signature no longer matches
    else:
        raise ValueError(kind)
    oracle.bad[folder.name] = _sha(folder / COMMIT)
    return f"{kind}@{target}"


def trial(root: Path, seed: int, keep: int, ref: dict[str, Any]) -> dict[str, Any]:
    """One preemption chain with damage between lives; returns its record with ``problems`` (empty: passed)."""
    rng = random.Random(seed)
    oracle = Oracle(root)
    problems: list[str] = []
    lives: list[str] = []
    full_reads: Counter[str] = Counter()  # damaged dir -> lives that opened its DCP reader under the damaged record
    injected: list[str] = []
    start = 0
    refusals = fallbacks = replaced = 0
    for life in range(LIVES + 1):
        final = life == LIVES
        if life > 0 and rng.random() < 0.8:
            hit = damage(root, oracle, rng, rng.choice(KINDS), rng.choice(TARGETS))
            if hit:
                injected.append(hit)
        good, bad = oracle.good(), oracle.damaged()
        expect = good[-1] if good else (None if bad else 0)
        fallbacks += bool(good and any(int(d[5:]) > good[-1] for d in bad))
        shas = {d: _sha(root / d / COMMIT) for d in bad}
        storage = CountingStorage(str(root))
        s = make()
        with boundary_path():
            h = Hook(s, storage, keep=keep, signals=False, intake=False)
        try:
            try:
                got: Optional[int] = h.resume()
            except RuntimeError as exc:
                if "passed verification" not in str(exc):
                    raise
                got = None
            for d in storage.readers:
                if d in shas:
                    full_reads[f"{d}@{shas[d][:8]}"] += 1
            if got != expect:
                problems.append(f"life {life}: resumed {got}, the newest good checkpoint is {expect} "
                                f"(good {good}, damaged {bad})")
                break
            if got is None:  # nothing good left: the operator deletes the damaged folders, the run starts over
                refusals += 1
                lives.append(f"refused (damaged {bad})")
                delete_quarantined(storage)
                for d in oracle.damaged():
                    shutil.rmtree(root / d, ignore_errors=True)
                continue
            start = got
            if final or start >= TOTAL - 1:
                for _ in range(start, TOTAL):
                    one_iteration(s)
                if not _same(ref, snapshot(s)):
                    problems.append(f"final state differs from the uninterrupted run (resumed at {start})")
                lives.append(f"{start}->end")
                break
            at = rng.randint(start, TOTAL - 2)
            for i in range(start, TOTAL):
                if i == at:
                    h.notify(notice())
                try:
                    one_iteration(s)
                except Preempted as exc:
                    replaced += step_dir(exc.step) in bad
                    if not exc.committed:
                        problems.append(f"life {life}: the preemption at step {exc.step} did not commit")
                    elif step_dir(exc.step) not in [step_dir(g) for g in oracle.good()]:
                        problems.append(f"life {life}: step {exc.step} reported committed but is not there "
                                        f"(good {oracle.good()})")
                    elif len(oracle.good()) > keep:
                        problems.append(f"life {life}: {len(oracle.good())} good checkpoints kept, keep={keep}")
                    lives.append(f"{start}->{exc.step}")
                    break
            else:
                problems.append(f"life {life}: never preempted")
                break
        finally:
            h.close()
    reread = {d: n for d, n in full_reads.items() if n > 1}
    if reread:
        problems.append(f"checkpoints read in full more than once under one record: {reread}")
    return {"seed": seed, "keep": keep, "lives": lives, "injected": injected, "refusals": refusals,
            "fallbacks": fallbacks, "replaced": replaced, "problems": problems}


def _same(a: Any, b: Any) -> bool:
    from tests.hook.test_boundary import assert_same  # noqa: PLC0415

    try:
        assert_same(a, b)
    except AssertionError:
        return False
    return True


def run(workdir: Path, trials: int, seed: int) -> dict[str, Any]:
    """``trials`` chains, keep cycling 1, 2, 3; the summary the verdict reads."""
    import structlog  # noqa: PLC0415

    os.environ[KEY_ENV] = KEY
    ref = reference(TOTAL)
    results = []
    t0 = time.monotonic()
    for n in range(trials):
        root = workdir / f"trial-{n:03d}"
        shutil.rmtree(root, ignore_errors=True)
        root.mkdir(parents=True)
        with structlog.testing.capture_logs():  # quiet lives (hundreds of lines a trial)
            results.append(trial(root, seed * 1000 + n, 1 + n % 3, ref))
        if not results[-1]["problems"]:
            shutil.rmtree(root, ignore_errors=True)
    kinds = Counter(k for r in results for k in r["injected"])
    return {"trials": len(results), "seconds": round(time.monotonic() - t0, 1), "injected": dict(kinds),
            "refusals": sum(r["refusals"] for r in results), "fallbacks": sum(r["fallbacks"] for r in results),
            "replaced": sum(r["replaced"] for r in results), "failed": [r for r in results if r["problems"]],
            "results": results}


def render(summary: dict[str, Any]) -> str:
    lines = [f"{'seed':>6} keep  lives / damage", "-" * 60]
    for r in summary["results"]:
        lines.append(f"{r['seed']:>6} {r['keep']:>4}  {' '.join(r['lives'])}  [{', '.join(r['injected'])}]"
                     + ("  FAIL: " + "; ".join(r["problems"]) if r["problems"] else ""))
    lines.append(f"{summary['trials']} trials in {summary['seconds']} s; damage injected {summary['injected']}; "
                 f"{summary['fallbacks']} resumes past damage to an older good one, {summary['replaced']} saves at a "
                 f"damaged step, {summary['refusals']} refusals (nothing good left); {len(summary['failed'])} failed")
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tests.chaos.damage", description=__doc__.splitlines()[0])
    p.add_argument("--trials", type=int, default=36)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--workdir", type=Path, default=None)
    a = p.parse_args(argv)
    workdir = a.workdir or Path(tempfile.mkdtemp(prefix="spotguard-damage-"))
    summary = run(workdir, a.trials, a.seed)
    print(render(summary))
    if summary["failed"]:
        print(f"logs and stores of failed trials: {workdir}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
