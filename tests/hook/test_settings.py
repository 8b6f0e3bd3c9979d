"""Environment settings of the hook: a bad value is reported naming the variable, and the default is used."""

from __future__ import annotations

import pytest

import os
import subprocess
import sys

from spotguard.hook.settings import env_bytes, env_seconds


@pytest.mark.parametrize("raw", ["soon", "-1", "0", "inf", "nan"])
def test_bad_seconds_warn_naming_the_variable_and_fall_back(monkeypatch: pytest.MonkeyPatch, raw: str) -> None:
    monkeypatch.setenv("SPOTGUARD_TEST_SECONDS", raw)
    with pytest.warns(UserWarning, match=r"SPOTGUARD_TEST_SECONDS=.* ignored .*using 2\.5 s"):
        assert env_seconds("SPOTGUARD_TEST_SECONDS", 2.5) == 2.5


def test_good_and_unset_seconds(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SPOTGUARD_TEST_SECONDS", raising=False)
    assert env_seconds("SPOTGUARD_TEST_SECONDS", 2.5) == 2.5
    monkeypatch.setenv("SPOTGUARD_TEST_SECONDS", " 0.25 ")
    assert env_seconds("SPOTGUARD_TEST_SECONDS", 2.5) == 0.25


def test_a_report_callback_replaces_the_warning(monkeypatch: pytest.MonkeyPatch) -> None:
    """The peer watch reads its settings at run time and logs instead of warning."""
    seen: list[str] = []
    monkeypatch.setenv("SPOTGUARD_TEST_SECONDS", "later")
    assert env_seconds("SPOTGUARD_TEST_SECONDS", 3.0, seen.append) == 3.0
    assert seen == ["SPOTGUARD_TEST_SECONDS='later' ignored (could not convert string to float: 'later'); using 3 s"]


@pytest.mark.parametrize("raw,want", [("0", 0), ("1048576", 1 << 20), ("512M", 512 << 20), (" 1 GiB ", 1 << 30),
                                      ("1.5k", 1536), ("2tb", 2 << 40)])
def test_byte_counts_with_and_without_units(monkeypatch: pytest.MonkeyPatch, raw: str, want: int) -> None:
    monkeypatch.setenv("SPOTGUARD_TEST_BYTES", raw)
    assert env_bytes("SPOTGUARD_TEST_BYTES", 7) == want


@pytest.mark.parametrize("raw", ["lots", "-1", "1Q", "inf", "nan"])
def test_bad_byte_counts_warn_naming_the_variable_and_fall_back(monkeypatch: pytest.MonkeyPatch, raw: str) -> None:
    monkeypatch.setenv("SPOTGUARD_TEST_BYTES", raw)
    with pytest.warns(UserWarning, match=r"SPOTGUARD_TEST_BYTES=.* ignored .*using 7 bytes"):
        assert env_bytes("SPOTGUARD_TEST_BYTES", 7) == 7


def test_a_byte_setting_typo_does_not_break_the_import() -> None:
    """The byte settings are read when spotguard.hook is imported (``int()`` there made a "1G" a crash)."""
    env = {**os.environ, "SPOTGUARD_STEP_COPY_MAX_BYTES": "1G", "SPOTGUARD_SNAPSHOT_BUFFER_BYTES": "a lot"}
    code = ("import spotguard.hook.stepcopy as s, spotguard.hook.watch as w; "
            "print(s.STEP_COPY_MAX_BYTES, w.SNAPSHOT_ALL_BUFFERS)")
    out = subprocess.run([sys.executable, "-W", "always", "-c", code], env=env, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == [str(1 << 30), str(16 << 20)]
    assert "SPOTGUARD_SNAPSHOT_BUFFER_BYTES='a lot' ignored" in out.stderr
