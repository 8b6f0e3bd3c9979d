"""The hook's two state owners are owners (issue 28, part 2): ``StepClock`` (``clock.py``) and ``StateAtS``
(``handover.py``) write their own fields, and every other file moves them through their named methods.

Why a test: the point of an owner is that one file says every way its state can change (and which of those
moves hold ``cv``); a direct ``hook._steps.count = ...`` elsewhere makes that file's map false again. Read
from the package source with ``ast`` (nothing imported), so the check covers code no test runs; and at run
time the fields are read-only properties, so a write that the source check cannot see (a ``getattr``-built
target, a test) raises instead of slipping through.
"""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Any, Iterator

import pytest
import torch

from spotguard.hook import Hook
from spotguard.hook.clock import StepClock
from spotguard.hook.handover import StateAtS

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "spotguard"

#: the clock's fields (``clock.py`` writes them, nothing else)
CLOCK_FIELDS = ("count", "in_step", "freeze", "target", "hold_until")
#: the state at S's fields (``handover.py`` writes them, nothing else)
STATE_AT_FIELDS = ("snap", "snap_count", "fwd_count", "fwd_seq", "fwd_bufs", "fwd_rng", "range_small",
                   "want_small", "want_state", "want_copy", "staged_step", "small", "handoff")
#: owner attribute (the last name of the expression the field is reached through) -> (its file, its fields)
OWNERS = {"_steps": ("clock.py", CLOCK_FIELDS), "_state_at": ("handover.py", STATE_AT_FIELDS)}


def _last_name(node: ast.expr) -> str:
    """``self._steps`` / ``hook._steps`` / ``self.hook._steps`` -> ``_steps``; anything else -> ``""``."""
    if isinstance(node, ast.Attribute):
        return node.attr
    if isinstance(node, ast.Name):
        return node.id
    return ""


def _targets(node: ast.AST) -> Iterator[ast.expr]:
    """The expressions ``node`` assigns to (or deletes), tuple and starred targets unpacked."""
    if isinstance(node, ast.Assign):
        todo = list(node.targets)
    elif isinstance(node, (ast.AugAssign, ast.AnnAssign, ast.For, ast.AsyncFor, ast.NamedExpr)):
        todo = [node.target]
    elif isinstance(node, ast.withitem):
        todo = [node.optional_vars] if node.optional_vars is not None else []
    elif isinstance(node, ast.Delete):
        todo = list(node.targets)
    else:
        return
    while todo:
        t = todo.pop()
        if isinstance(t, (ast.Tuple, ast.List)):
            todo.extend(t.elts)
        elif isinstance(t, ast.Starred):
            todo.append(t.value)
        else:
            yield t


def foreign_writes(root: Path = PACKAGE) -> list[str]:
    """``file:line: expression`` for every write of an owner's field outside the owner's own file: an assignment
    (plain, augmented, annotated, a tuple's element, a ``for``/``with``/walrus target), a ``del``, or a
    ``setattr(<...>._steps, "count", ...)`` with the name spelled out."""
    found = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            hits: list[tuple[ast.expr, str]] = [(t.value, t.attr) for t in _targets(node)
                                                if isinstance(t, ast.Attribute)]
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and \
                    node.func.id in ("setattr", "delattr") and len(node.args) >= 2 and \
                    isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str):
                hits.append((node.args[0], node.args[1].value))
            for owner_expr, field in hits:
                owner = OWNERS.get(_last_name(owner_expr))
                if owner is not None and field in owner[1] and path.name != owner[0]:
                    found.append(f"{path.relative_to(root.parent)}:{owner_expr.lineno}: "
                                 f"{ast.unparse(owner_expr)}.{field}")
    return found


def test_only_the_owners_write_their_fields() -> None:
    found = foreign_writes()
    assert not found, ("fields of StepClock/StateAtS written outside clock.py/handover.py (use their named "
                       f"methods): {found}")


def test_the_source_check_sees_each_kind_of_write(tmp_path: Path) -> None:
    """The check is not vacuous: each shape of write it claims to catch is caught, in any file but the owner's."""
    (tmp_path / "spotguard").mkdir()
    (tmp_path / "spotguard" / "x.py").write_text(
        "def f(self, hook, s):\n"
        "    self._steps.count = 1\n"
        "    hook._steps.in_step += 1\n"
        "    self.hook._steps.freeze, self._state_at.snap = None, s\n"
        "    (a, *self._state_at.small) = s\n"
        "    setattr(self._steps, 'hold_until', 0.0)\n"
        "    del self._state_at.handoff\n"
        "    self._log_steps.count = 1\n"  # not an owner: left alone
        "    self._steps.cv.notify_all()\n")  # a read: left alone
    (tmp_path / "spotguard" / "clock.py").write_text("def g(self):\n    self._steps.count = 2\n")  # the owner
    found = [f.split(": ", 1)[1] for f in foreign_writes(tmp_path / "spotguard")]
    assert sorted(found) == sorted(["self._steps.count", "hook._steps.in_step", "self.hook._steps.freeze",
                                    "self._state_at.snap", "self._state_at.small", "self._steps.hold_until",
                                    "self._state_at.handoff"])


@pytest.mark.parametrize("owner,fields", [(StepClock(), CLOCK_FIELDS),
                                          (StateAtS(StepClock().cv), STATE_AT_FIELDS)],
                         ids=["StepClock", "StateAtS"])
def test_owner_fields_are_read_only_properties(owner: Any, fields: tuple[str, ...]) -> None:
    """Every field is a property with no setter, and the instance keeps no public attribute (a field added
    later as a plain ``self.x`` would be writable from anywhere)."""
    cls = type(owner)
    for name in fields:
        prop = getattr(cls, name, None)
        assert isinstance(prop, property) and prop.fset is None, f"{cls.__name__}.{name} is not read-only"
    assert [k for k in vars(owner) if not k.startswith("_")] == []


@pytest.fixture
def hook(tmp_path: Path) -> Iterator[Hook]:
    m = torch.nn.Linear(4, 1)
    h = Hook({"model": m, "opt": torch.optim.SGD(m.parameters(), lr=0.1)}, str(tmp_path / "ck"),
             signals=False, intake=False)
    yield h
    h.close()


def test_a_direct_write_raises_and_the_named_moves_work(hook: Hook) -> None:
    with pytest.raises(AttributeError):
        hook._steps.count = 3  # type: ignore[misc]
    with pytest.raises(AttributeError):
        hook._state_at.snap = None  # type: ignore[misc]
    assert hook._steps.count == 0 and hook.iteration == 0
    hook._steps.set_count(3)
    assert hook._steps.count == 3 and hook.iteration == 3
    assert hook._steps.advance() == 4 and hook.iteration == 4
    with hook._steps.cv:
        hook._steps.enter_step()
        assert hook._steps.in_step
        assert hook._steps.end_step() == 5 and not hook._steps.in_step
        hook._steps.reach(7, inside=True)
        assert (hook._steps.count, hook._steps.in_step) == (7, True)
        hook._steps.leave_step()
        assert hook._steps.ended(7)
