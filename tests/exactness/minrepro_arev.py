"""Review of issue 23 (arev): a second notice in the resumed run's first accumulation cycle (the resumed run's own
checkpoint of the step it resumed at, and of the next one), on the oracle's pattern ``accelerate_accum_loader``.
Run from the repository root: ``PYTHONPATH=$PWD python -m tests.exactness.minrepro_arev [FIRST SECOND]``
(default ``phase:micro@4 phase:micro@4``: both notices in the same cycle, so the resumed run re-commits step 4;
``phase:micro@4 phase:micro@5``: the second one cycle later). Prints each run's verdict; exit 1 if any differs."""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

from . import oracle


def main(first: str = "phase:micro@4", second: str = "phase:micro@4") -> int:
    p = oracle.PATTERNS["accelerate_accum_loader"]
    work = Path(tempfile.mkdtemp(prefix="arev-chain-"))
    ref = oracle.reference(p, work / "ref")
    store = work / "ckpt"
    bad = 0
    for tag, notice in (("trial", first), ("resume1", second), ("resume2", "")):
        env = {"EXO_NOTICE": notice, "EXO_NOTICE_RANK": "1", "EXO_NOTICE_SOURCE": "drill"} if notice else {}
        run = oracle.launch(p, work, tag, store, env, 180)
        steps = [int(c["step"]) for c in oracle.committed(store)]
        for r in range(p.nproc):
            got = run.of(r, "resumed")
            if got and got[0]["completed"] > 0:
                d = oracle.differing(ref.by_rank[r][got[0]["completed"]], got[0])
                bad += bool(d)
                print(f"{tag} rank {r}: resumed at {got[0]['completed']}: {d or 'same'}")
            fin = run.of(r, "final")
            if fin:
                d = oracle.differing(ref.final[r], fin[0])
                bad += bool(d)
                print(f"{tag} rank {r}: final {d or 'same'}")
        print(f"{tag}: rc {run.returncode}, committed steps {steps}")
    print("runs in", work)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:3]))
