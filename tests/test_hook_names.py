"""How much of Hook's one namespace its parts share (issue 28, part 2: "the hook's state given owners").

``Hook`` is assembled from mixins in several files of ``spotguard/hook``; a ``self._name`` that two of those files
use is state no single file owns. This counts such names, read from the source with ``ast`` (nothing imported),
and holds the count to a ceiling that only goes down: moving state into an owner object (``StepClock``,
``StateAtS``, ``Lifecycle``) lowers it; a new shared name raises it and fails here. Run as a script to print the names.
"""

from __future__ import annotations

import ast
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
HOOK = ROOT / "spotguard" / "hook"

#: shared ``self._name`` count at the last measurement; lower it when a change lowers the count. 73: issue 28's
#: owners brought it 87 -> 72, and the several-optimizer step copies added one owner object (``_step_copies``,
#: ``stepcopy.StepCopies``, reached from core/boundary/stateat) — a new shared *owner* is the shape wanted;
#: a new shared plain field is not. 48: the loop's shape and the step hooks' bookkeeping (29 names, 27 of them
#: shared) went into two owners, ``_loop`` (``loopshape.LoopShape``) and ``_book`` (``stepbook.StepBook``). 41:
#: the lifecycle owner (``_life``, ``lifecycle.Lifecycle``) took eight (``_closed``, ``_torn_down``, ``_exiting``,
#: ``_exit_request``, ``_exit_code``, ``_late``, ``_exit_callbacks``, ``_prev_handlers``) and is one itself
CEILING = 41


def _classes() -> dict[str, tuple[Path, list[str]]]:
    """Class name -> (file, base names) for the classes defined at module level in spotguard/hook/*.py."""
    out: dict[str, tuple[Path, list[str]]] = {}
    for path in sorted(HOOK.glob("*.py")):
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.ClassDef):
                bases = [b.id for b in node.bases if isinstance(b, ast.Name)]
                out[node.name] = (path, bases)
    return out


def mixin_files() -> list[Path]:
    """The files that define Hook or one of its (transitive) base classes."""
    classes = _classes()
    files: set[Path] = set()
    todo = ["Hook"]
    while todo:
        name = todo.pop()
        if name not in classes:
            continue
        path, bases = classes[name]
        files.add(path)
        todo.extend(bases)
    return sorted(files)


def self_names(path: Path) -> set[str]:
    """The ``self._x`` attribute names a file reads or writes (dunders excluded)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self"
                and node.attr.startswith("_") and not node.attr.startswith("__")):
            names.add(node.attr)
    return names


def methods() -> set[str]:
    """The methods the mixin classes define (behaviour, not the per-instance state this count is about);
    properties and class-level aliases (such as the old clock names that ``ClockNames`` once held) count as
    state."""
    out: set[str] = set()
    for path in mixin_files():
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.ClassDef):
                out.update(item.name for item in node.body
                           if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef))
                           and not any(isinstance(d, ast.Name) and d.id == "property" for d in item.decorator_list))
    return out


def shared_names(state_only: bool = True) -> dict[str, list[str]]:
    """``self._x`` names used in two or more of Hook's mixin files -> those files (``state_only``: leave out
    the methods)."""
    skip = methods() if state_only else set()
    where: dict[str, list[str]] = defaultdict(list)
    for path in mixin_files():
        for name in self_names(path) - skip:
            where[name].append(path.name)
    return {n: sorted(f) for n, f in sorted(where.items()) if len(f) >= 2}


#: the loop's shape and the step hooks' bookkeeping: owned by ``loopshape.LoopShape`` (``hook._loop``) and
#: ``stepbook.StepBook`` (``hook._book``); no part of the hook reaches them as names of its own any more
OWNED_BY_LOOP = (
    "_many_opts", "_range_clock", "_range_broken", "_cycle", "_explicit", "_explicit_intent", "_implicit_counted",
    "_iter_steps", "_opt_key", "_confirmed", "_step_pattern", "_boundary_why", "_path_logged", "_fresh_checked",
    "_loop_kind", "_realign", "_cuda_params", "_post_seq", "_step_event", "_bwd_since_step", "_fwd_train_count",
    "_last_fwd_training", "_train_fwd_seq", "_handles", "_scaler", "_scaler_orig", "_unwrap", "_clock",
    "_skip_warned",
)


def _hook_parts() -> list[Path]:
    """Every file that reaches a Hook's own names: the mixins, the adapters, the agreement thread, torchft."""
    pkg = ROOT / "spotguard"
    return [*mixin_files(), HOOK / "rounds.py", *sorted((HOOK / "adapters").glob("*.py")),
            *sorted((pkg / "torchft").glob("*.py"))]


def test_loop_names_have_an_owner() -> None:
    """``x._name`` for a name ``LoopShape``/``StepBook`` own (any ``x``: ``self``, ``hook``, ``h``) is gone."""
    left = []
    for path in _hook_parts():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr in OWNED_BY_LOOP:
                left.append(f"{path.relative_to(ROOT)}:{node.lineno} .{node.attr}")
    assert not left, left


def test_mixin_files_found() -> None:
    names = {p.name for p in mixin_files()}
    assert {"core.py", "agreement.py", "save.py", "exit.py", "notices.py"} <= names


def test_shared_names_do_not_grow() -> None:
    shared = shared_names()
    assert len(shared) <= CEILING, f"{len(shared)} shared self._ names (ceiling {CEILING}): {sorted(shared)}"


if __name__ == "__main__":
    files = mixin_files()
    total = set().union(*(self_names(p) for p in files))
    shared = shared_names()
    print(f"mixin files ({len(files)}): {' '.join(p.name for p in files)}")
    print(f"self._ names: {len(total)}; used in two or more files: {len(shared_names(False))} "
          f"(methods included), {len(shared)} state names (methods left out)")
    if "-v" in sys.argv:
        for name, fs in shared.items():
            print(f"  {name}: {' '.join(fs)}")
