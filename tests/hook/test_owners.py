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
from typing import Any, Iterable, Iterator, Mapping, Optional

import pytest
import torch

from spotguard.hook import Hook
from spotguard.hook.clock import StepClock
from spotguard.hook.handover import StateAtS
from spotguard.hook.loopshape import LoopShape
from spotguard.hook.stepbook import StepBook

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


#: methods that change a container in place (a dict, list or set a property hands out is still the owner's)
MUTATORS = frozenset({"append", "extend", "insert", "remove", "pop", "popitem", "clear", "update", "setdefault",
                      "add", "discard", "sort", "reverse", "__setitem__", "__delitem__"})


def _attribute_under(node: ast.expr) -> Optional[ast.Attribute]:
    """``x.f`` for ``x.f``, ``x.f[k]``, ``x.f[k][j]`` (the field an item write changes), else None."""
    while isinstance(node, ast.Subscript):
        node = node.value
    return node if isinstance(node, ast.Attribute) else None


def _aliases(tree: ast.AST, owners: Iterable[str]) -> dict[str, str]:
    """Local names bound to an owner (``book = self._book``; ``hook, book = self, self._book``) -> its attribute:
    a write through the alias is a write of the owner's field (read per file, any function)."""
    found: dict[str, str] = {}
    for node in ast.walk(tree):
        if not isinstance(node, ast.Assign):
            continue
        for t in node.targets:
            pairs = zip(t.elts, node.value.elts) if isinstance(t, ast.Tuple) and isinstance(node.value, ast.Tuple) \
                else [(t, node.value)]
            for name, value in pairs:
                if isinstance(name, ast.Name) and isinstance(value, ast.Attribute) and value.attr in owners:
                    found[name.id] = value.attr
    return found


def writes_of(root: Path, owners: Mapping[str, tuple[str, tuple[str, ...]]]) -> list[tuple[str, int, str, str]]:
    """(file, line, owner expression, field) for every write of a field of ``owners`` (owner attribute -> (its
    file, its fields)) outside the owner's own file: an assignment (plain, augmented, annotated, a tuple's
    element, a ``for``/``with``/walrus target, an item of it), a ``del``, an in-place change (``.append``,
    ``.clear``, ... on the field or an item of it), or a ``setattr(<...>._steps, "count", ...)`` with the name
    spelled out; the private field behind a property (``_steps._count``) counts as the field, and so does a write
    through a local alias of the owner."""
    found = []
    for path in sorted(root.rglob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        alias = _aliases(tree, owners)
        for node in ast.walk(tree):
            hits: list[tuple[ast.expr, str]] = [(a.value, a.attr) for a in map(_attribute_under, _targets(node))
                                                if a is not None]
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in MUTATORS:
                a = _attribute_under(node.func.value)
                if a is not None:
                    hits.append((a.value, a.attr))
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and \
                    node.func.id in ("setattr", "delattr") and len(node.args) >= 2 and \
                    isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str):
                hits.append((node.args[0], node.args[1].value))
            for owner_expr, field in hits:
                name = _last_name(owner_expr)
                owner = owners.get(alias.get(name, name) if isinstance(owner_expr, ast.Name) else name)
                if owner is not None and field.removeprefix("_") in owner[1] and path.name != owner[0]:
                    found.append((str(path.relative_to(root.parent)), owner_expr.lineno, ast.unparse(owner_expr),
                                  field))
    return found


def foreign_writes(root: Path = PACKAGE) -> list[str]:
    """``file:line: expression`` for every write of a field of StepClock/StateAtS outside clock.py/handover.py
    (``writes_of``)."""
    return [f"{path}:{line}: {expr}.{field}" for path, line, expr, field in writes_of(root, OWNERS)]


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


def test_the_source_check_sees_writes_past_the_properties(tmp_path: Path) -> None:
    """The read-only properties stop ``hook._steps.count = 1`` at run time, but not a write of the private field
    behind one (``hook._steps._count = 1``: no error, the map bypassed) nor an in-place change of a container a
    property hands out (``fwd_bufs[1][...] = ``, ``.clear()``): the source check must see those."""
    (tmp_path / "spotguard").mkdir()
    (tmp_path / "spotguard" / "x.py").write_text(
        "def f(self, hook, b):\n"
        "    self._steps._count = 1\n"
        "    hook._state_at._want_small += 1\n"
        "    self._state_at.fwd_bufs[1]['m'] = b\n"
        "    hook._state_at.fwd_bufs[1].clear()\n"
        "    del self._state_at._small\n"
        "    self._steps.cv.notify_all()\n"  # a call on a field that changes no field of the owner: left alone
        "    x = self._state_at.fwd_bufs[1]['m']\n")  # a read: left alone
    found = [f.split(": ", 1)[1] for f in foreign_writes(tmp_path / "spotguard")]
    assert sorted(found) == sorted(["self._steps._count", "hook._state_at._want_small", "self._state_at.fwd_bufs",
                                    "hook._state_at.fwd_bufs", "self._state_at._small"])


#: the two records (``loopshape.py``, ``stepbook.py``): plain fields, no property guards them, so any file may
#: assign one; their rule (each module's docstring) is that a field one file writes is assigned there and a field
#: two files move goes through a named method of the owner
RECORDS = {"_loop": ("loopshape.py", tuple(vars(LoopShape({}, print)))),
           "_book": ("stepbook.py", tuple(vars(StepBook({}, {}))))}


def shared_record_writes(root: Path = PACKAGE) -> dict[str, list[str]]:
    """A field of LoopShape/StepBook -> the files (two or more) that write it directly, outside its owner."""
    files: dict[str, set[str]] = {}
    for path, _line, _expr, field in writes_of(root, RECORDS):
        files.setdefault(field, set()).add(path)
    return {f: sorted(p) for f, p in files.items() if len(p) > 1}


def test_record_fields_are_written_by_one_file_each() -> None:
    assert shared_record_writes() == {}, "a record's field written directly from two files: give it a named move"


def test_the_record_check_sees_a_second_writer(tmp_path: Path) -> None:
    (tmp_path / "spotguard").mkdir()
    (tmp_path / "spotguard" / "a.py").write_text("def f(self):\n    self._loop.range_broken = 'x'\n"
                                                 "    self._loop.path_logged.add(('a', 'b'))\n")
    (tmp_path / "spotguard" / "b.py").write_text("def g(self):\n    hook, book = self, self._book\n"
                                                 "    book.post_seq += 1\n    self._loop.explicit = True\n")
    (tmp_path / "spotguard" / "c.py").write_text("def h(hook):\n    hook._book.post_seq = 0\n"
                                                 "    hook._loop.range_broken = None\n")
    (tmp_path / "spotguard" / "loopshape.py").write_text("def k(self):\n    self._loop.explicit = False\n")
    assert shared_record_writes(tmp_path / "spotguard") == {
        "range_broken": ["spotguard/a.py", "spotguard/c.py"], "post_seq": ["spotguard/b.py", "spotguard/c.py"]}


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
