"""The hook's lifecycle owner (``spotguard/hook/lifecycle.py``, issue 28 part 2): one file writes its fields,
and the questions the other parts ask answer as the conditions they replaced did."""

from __future__ import annotations

import ast
import itertools
from pathlib import Path

import pytest

from spotguard.hook.lifecycle import Lifecycle, exit_code_of

PKG = Path(__file__).resolve().parents[2] / "spotguard"
OWNED = {"_closed", "_torn_down", "_exiting", "_exit_request", "_exit_code", "_late", "_exit_callbacks",
         "_prev_handlers"}


def _classes() -> dict[str, list[str]]:
    """Every class of the package -> its base names (``Name`` or the last part of an ``Attribute``)."""
    out: dict[str, list[str]] = {}
    for path in PKG.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                out[node.name] = [b.id if isinstance(b, ast.Name) else b.attr for b in node.bases
                                  if isinstance(b, (ast.Name, ast.Attribute))]
    return out


def hook_family() -> set[str]:
    """``Hook``, its mixins and every class built on it (the adapters and theirs): the classes whose
    ``self`` is a hook."""
    classes = _classes()
    family, grew = {"Hook"}, True
    while grew:
        before = len(family)
        for name, bases in classes.items():
            if name in family:
                family.update(b for b in bases if b in classes)
            elif family.intersection(bases):
                family.add(name)
        grew = len(family) > before
    return family


def _targets(node: ast.AST) -> list[ast.expr]:
    if isinstance(node, ast.Assign):
        out: list[ast.expr] = []
        for t in node.targets:
            out.extend(t.elts if isinstance(t, (ast.Tuple, ast.List)) else [t])
        return out
    if isinstance(node, (ast.AugAssign, ast.AnnAssign)):
        return [node.target]
    return []


def writes_outside_owner() -> list[str]:
    """``file:line name`` for each write of an owned field outside lifecycle.py: ``self._x = ...`` in a hook
    class, ``hook._x = ...`` anywhere, ``setattr(.., "_x", ..)`` and ``__dict__`` writes of those names."""
    family = hook_family()
    found = []
    for path in sorted(PKG.rglob("*.py")):
        if path.name == "lifecycle.py":
            continue
        rel = path.relative_to(PKG.parent)

        def visit(node: ast.AST, cls: str | None) -> None:
            for t in _targets(node):
                if isinstance(t, ast.Attribute) and t.attr in OWNED:
                    is_self = isinstance(t.value, ast.Name) and t.value.id == "self"
                    if not is_self or cls in family:
                        found.append(f"{rel}:{node.lineno} {t.attr}")
            if isinstance(node, ast.Call):
                args = [a.value for a in node.args if isinstance(a, ast.Constant)]
                fn = node.func
                named = (isinstance(fn, ast.Name) and fn.id == "setattr") or (
                    isinstance(fn, ast.Attribute) and isinstance(fn.value, ast.Attribute)
                    and fn.value.attr == "__dict__")
                if named and OWNED.intersection(a for a in args if isinstance(a, str)):
                    found.append(f"{rel}:{node.lineno} {args}")
            inner = node.name if isinstance(node, ast.ClassDef) else cls
            for child in ast.iter_child_nodes(node):
                visit(child, inner)

        visit(ast.parse(path.read_text()), None)
    return found


def test_hook_family_holds_the_mixins_and_adapters() -> None:
    family = hook_family()
    assert {"Hook", "ExitMixin", "NoticesMixin", "FrameworkHook"} <= family
    assert not {"BackgroundAgreement", "NoticeIntake", "StepClock"} & family  # their own ``_closed`` is theirs


def test_only_lifecycle_writes_the_life_and_exit_fields() -> None:
    """On main before the owner this listed core.py's ``_closed``/``_exiting``/... and exit.py's writes."""
    assert writes_outside_owner() == []


STATES = list(itertools.product([False, True], repeat=4))  # closed, torn_down, exiting, exit requested


def _life(closed: bool, torn: bool, exiting: bool, requested: bool) -> Lifecycle:
    life = Lifecycle(7)
    if closed:
        assert life.close()
    if torn:
        assert life.mark_torn_down()
    if exiting:
        life.begin_exit()
    if requested:
        life.request_exit("notice", "result", 3)
    return life


@pytest.mark.parametrize("closed,torn,exiting,requested", STATES)
def test_questions_truth_table(closed: bool, torn: bool, exiting: bool, requested: bool) -> None:
    """Each question is the condition it replaced at its call sites (read off main's code)."""
    life = _life(closed, torn, exiting, requested)
    assert (life.closed, life.torn_down, life.exiting, life.exit_requested) == (closed, torn, exiting, requested)
    assert life.exit_request == (("notice", "result", 3) if requested else None)
    assert life.detached() == (closed or torn)  # stephooks' pre/post hooks, staged's periodic flags
    assert life.closing() == (closed or exiting)  # _on_signal, _at_exit, the adapters' boundaries, torchft
    assert life.over() == (closed or torn or exiting)  # the adapters' reduction reads and periodic saves
    assert life.leaving() == (exiting or requested)  # _quiesce, the round-deadline timer, rounds.py's loop
    assert life.exit_pending() == (requested and not exiting)  # _exit_if_requested, _at_exit, _quiesce
    assert life.stopping() == (closed or torn or exiting or requested)  # agreement's round, _at_exit


def test_moves_answer_once_and_fields_are_read_only() -> None:
    life = Lifecycle(7)
    assert life.exit_code == 7 and exit_code_of(object()) == 143
    assert life.close() and not life.close()
    assert life.mark_torn_down() and not life.mark_torn_down()
    for name in ("closed", "torn_down", "exiting", "exit_request", "exit_code", "last_reduction"):
        with pytest.raises(AttributeError):
            setattr(life, name, None)
    life.note_last_reduction((2, 0))
    assert life.last_reduction == (2, 0)


def test_handlers_and_callbacks() -> None:
    """Handlers restored at close are a copy (the exit forgets them first); callbacks run once; a framework
    hook's callbacks registered before arming carry over to the armed hook's owner."""
    life = Lifecycle()
    life.keep_handler(15, "prev")
    kept = life.signal_handlers()
    life.forget_handlers()
    assert kept == {15: "prev"} and life.signal_handlers() == {} and life.prev_handler(15) is None
    early = Lifecycle()
    early.add_exit_callback(print)
    armed = Lifecycle(143, early)
    assert armed.take_exit_callbacks() == [print] and armed.take_exit_callbacks() == []
    assert early.take_exit_callbacks() == []
