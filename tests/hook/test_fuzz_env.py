"""Fuzzing the hook's configuration inputs: ``every=`` durations and ``SPOTGUARD_*`` env read at import."""

from __future__ import annotations

import math
import os
import subprocess
import sys

from hypothesis import given, settings
from hypothesis import strategies as st

from spotguard.hook import parse_every

COUNT = {"every": 0}


@settings(max_examples=1000, deadline=None)
@given(every=st.one_of(st.text(max_size=20), st.floats(), st.integers(min_value=-(2**70), max_value=2**70),
                       st.sampled_from(["15m", "1h30m", "0s", "-5m", "1e400s", "nan", "inf", "5x", "m", " 2h ",
                                        "1.5.5m", "9" * 400])))
def test_every_is_positive_finite_seconds_or_value_error(every: object) -> None:
    COUNT["every"] += 1
    try:
        v = parse_every(every)  # type: ignore[arg-type]
    except ValueError:
        return
    assert v is not None and v > 0 and math.isfinite(v), (every, v)


def test_bad_periodic_drain_env_does_not_break_import() -> None:
    env = {**os.environ, "SPOTGUARD_PERIODIC_DRAIN": "sixty"}
    r = subprocess.run([sys.executable, "-c", "import spotguard.hook"], capture_output=True, text=True, env=env,
                       timeout=120)
    assert r.returncode == 0, r.stderr[-500:]
    assert "SPOTGUARD_PERIODIC_DRAIN='sixty' ignored" in r.stderr


def test_report_inputs_tried(capsys: object) -> None:
    with capsys.disabled():  # type: ignore[attr-defined]
        print(f"\n[fuzz] every= values tried: {COUNT['every']}")
