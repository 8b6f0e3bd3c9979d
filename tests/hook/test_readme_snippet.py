"""The README's training script, extracted from README.md and run as written (issue 18 item 3).

Under real ``torchrun`` (2 ranks, gloo, CPU) with a plain ``torch.utils.data``
dataset: an uninterrupted run, then a run preempted by SIGTERM to one rank
(committed, exit 143 on both ranks) and resumed in the same folder; the resumed
run's losses equal the uninterrupted run's bitwise, and it starts where the
checkpoint stands.
"""

from __future__ import annotations

import re
import signal
from pathlib import Path

import pytest

from spotguard.storage import open_storage
from spotguard.storage.commit import scan

from ._torchrun import REPO, TorchRun

SLOW = Path(__file__).resolve().parent / "_slow_script.py"

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def readme_script() -> str:
    text = (REPO / "README.md").read_text()
    section = text[text.index("## Use it in training code"):]
    found = re.search(r"```python\n(.*?)```", section, re.S)
    assert found, "no python block in the README's 'Use it in training code' section"
    return found.group(1)


def losses(run: TorchRun) -> dict[int, str]:
    """``print(step, loss.item())`` lines of rank 0: step -> the printed float, exactly as printed."""
    out = {}
    for line in run.log.read_text(errors="replace").splitlines():
        m = re.fullmatch(r"(\d+) (-?\d+\.\d+(?:e-?\d+)?)", line.strip())
        if m:
            out[int(m.group(1))] = m.group(2)
    return out


WITH_DROPOUT = "torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.Dropout(0.1), torch.nn.Linear(32, 1))"


@pytest.mark.parametrize("model", [
    "as-written",
    pytest.param("with-dropout", marks=pytest.mark.long(
        reason="sibling in make test: [as-written] (the README's script itself, preempted and resumed bitwise) "
               "and tests/exactness/test_oracle.py[readme-script-dropout-global-rng-loader] and "
               "[readme-script-loader-generator] (the README's loop with dropout drawing from the global RNG, "
               "without and with the loader's generator=, each notice ending exact)")),
])
def test_readme_script_runs_is_preempted_and_resumes_bitwise(tmp_path: Path, model: str) -> None:
    """``with-dropout``: the README's script with the user's own model drawing from the global RNG every
    step (issue 22: the resumed run's DataLoader iterator, built after the RNG was restored, drew from it
    and shifted every mask; the README's loader now has its own ``generator=``)."""
    script = readme_script()
    if model == "with-dropout":
        assert "torch.nn.Linear(32, 1)" in script
        script = script.replace("torch.nn.Linear(32, 1)", WITH_DROPOUT, 1)
    total = int(re.search(r"hook\.range\((\d+)\)", script).group(1))  # type: ignore[union-attr]
    ref_dir, job_dir = tmp_path / "ref", tmp_path / "job"
    for d in (ref_dir, job_dir):
        d.mkdir()
        (d / "train.py").write_text(script)

    # the uninterrupted run and the preempted one are independent (own folders): both at once
    ref = TorchRun(ref_dir / "run.log", [], script=ref_dir / "train.py")
    try:
        pre = TorchRun(job_dir / "pre.log", [str(job_dir / "train.py")], script=SLOW)
        try:
            pre.wait_for(lambda: len(losses(pre)) >= 20, 120, "step 20")
            pre.signal_rank(1, signal.SIGTERM)
            assert pre.wait(120) != 0
        finally:
            pre.kill()
        assert ref.wait(180) == 0, ref.tail()
    finally:
        ref.kill()
    expected = losses(ref)
    assert sorted(expected) == list(range(total)), ref.tail()
    assert [c.step for c in scan(open_storage(str(ref_dir / "checkpoints"))) if c.committed] == []  # no notice, no checkpoint
    exits = {e["rank"]: e for e in pre.events("exit")}
    assert set(exits) == {0, 1} and all(e["code"] == 143 and e["committed"] for e in exits.values()), pre.tail()
    [stop] = [c.step for c in scan(open_storage(str(job_dir / "checkpoints"))) if c.committed]
    assert 20 <= stop < total

    res = TorchRun(job_dir / "resumed.log", [], script=job_dir / "train.py")
    assert res.wait(180) == 0, res.tail()
    assert {e["rank"]: e["step"] for e in res.events("resumed")} == {0: stop, 1: stop}, res.tail()
    got = losses(res)
    assert sorted(got) == list(range(stop, total)), res.tail()
    diff = [(k, expected[k], got[k]) for k in got if expected[k] != got[k]]
    assert not diff, f"resumed losses differ from the uninterrupted run (step, ref, resumed): {diff[:5]}"
