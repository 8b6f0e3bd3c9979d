"""Environment settings of the hook: a bad value is reported naming the variable, and the default is used."""

from __future__ import annotations

import pytest

from spotguard.hook.settings import env_seconds


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
