"""The hook's lifecycle owner (``spotguard/hook/lifecycle.py``, issue 28 part 2): one file writes its fields,
and the questions the other parts ask answer as the conditions they replaced did."""

from __future__ import annotations

import ast
import itertools
from pathlib import Path

import pytest

from spotguard.hook.lifecycle import Lifecycle, exit_code_of

# the one reading of what a statement writes (its targets, tuples and starred unpacked, for/with/walrus, del) and
# of an in-place change (an item write or an .append/.clear changes the field too)
from .test_owners import MUTATORS, _attribute_under, _targets

PKG = Path(__file__).resolve().parents[2] / "spotguard"
OWNED = {"_closed", "_torn_down", "_exiting", "_exit_request", "_exit_code", "_late", "_exit_callbacks",
         "_prev_handlers"}


def _classes(root: Path = PKG) -> dict[str, list[str]]:
    """Every class of the package -> its base names (``Name`` or the last part of an ``Attribute``)."""
    out: dict[str, list[str]] = {}
    for path in root.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                out[node.name] = [b.id if isinstance(b, ast.Name) else b.attr for b in node.bases
                                  if isinstance(b, (ast.Name, ast.Attribute))]
    return out


def hook_family(root: Path = PKG) -> set[str]:
    """``Hook``, its mixins and every class built on it (the adapters and theirs): the classes whose
    ``self`` is a hook."""
    classes = _classes(root)
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


def writes_outside_owner(root: Path = PKG) -> list[str]:
    """``file:line name`` for each write of an owned field outside lifecycle.py: ``self._x = ...`` in a hook
    class, ``hook._x = ...`` anywhere, ``setattr(.., "_x", ..)`` and ``__dict__`` writes of those names."""
    family = hook_family(root)
    found = []
    for path in sorted(root.rglob("*.py")):
        if path.name == "lifecycle.py":
            continue
        rel = path.relative_to(root.parent)

        def visit(node: ast.AST, cls: str | None) -> None:
            changed = [_attribute_under(t) for t in _targets(node)]
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in MUTATORS:
                changed.append(_attribute_under(node.func.value))  # the dict/list changed in place
            for t in changed:
                if t is not None and t.attr in OWNED:
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
    """On main before the owner this listed core.py's ``_closed``/``_exiting``/... and exit.py's writes, and
    notices.py's ``self._prev_handlers[sig] = ...`` (19 in all)."""
    assert writes_outside_owner() == []


def test_the_source_check_sees_in_place_writes(tmp_path: Path) -> None:
    """The owned dict and list change in place too: a ``[k] = `` or an ``.append``/``.clear`` on them outside
    lifecycle.py is a write (on main before the owner, ``notices.py`` kept handlers by ``self._prev_handlers[sig]
    = ...`` and ``core.py``/``exit.py`` cleared them: a check blind to that passed them by)."""
    (tmp_path / "spotguard").mkdir()
    (tmp_path / "spotguard" / "x.py").write_text(
        "class Hook:\n"
        "    def f(self, sig, prev, cb):\n"
        "        self._prev_handlers[sig] = prev\n"
        "        self._prev_handlers.clear()\n"
        "        self._life._exit_callbacks.append(cb)\n"
        "        got = self._life._prev_handlers.get(sig)\n")  # a read: left alone
    (tmp_path / "spotguard" / "lifecycle.py").write_text("def g(self):\n    self._prev_handlers[1] = 2\n")
    found = sorted(f.split(" ", 1)[1] for f in writes_outside_owner(tmp_path / "spotguard"))
    assert found == ["_exit_callbacks", "_prev_handlers", "_prev_handlers"]


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
    assert life.exit_pending() == (requested and not exiting)  # _quiesce (_exit_if_requested, _at_exit: inline)
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


def test_a_framework_hook_armed_late_keeps_its_callbacks_code_and_closes_once(tmp_path: Path) -> None:
    """The half-built shapes: ``hook.on_exit`` before the core is armed (the early owner carries its callbacks
    over), the armed hook's own exit code (not the early owner's 143), ``close()`` before arming, twice after."""
    from spotguard.hook.adapters._base import FrameworkHook  # noqa: PLC0415 - torch import only here
    from spotguard.hook.core import periodic_notice  # noqa: PLC0415

    hook = FrameworkHook(str(tmp_path / "ck"), exit_code=7, arm=False)
    got: list[tuple[int, bool]] = []
    hook.on_exit(lambda code, committed: got.append((code, committed)))
    hook.close()  # not armed: nothing to undo, and no AttributeError on the early owner
    assert not hook.armed and not hook._life.closed
    hook._arm()
    try:
        assert hook.armed and exit_code_of(hook) == 7 and not hook._life.stopping()
        hook._run_exit_callbacks(periodic_notice(3), 7, True)
        assert got == [(7, True)]
        hook._run_exit_callbacks(periodic_notice(3), 7, True)  # taken once: a second exit path runs none
        assert got == [(7, True)]
    finally:
        hook.close()
    hook.close()  # idempotent
    assert hook._life.closed and hook._life.detached() and not hook._life.exiting
