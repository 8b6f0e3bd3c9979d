"""The hook's life and exit: closed, torn down, leaving, the exit decision, and what the exit restores and runs.

Why an object of its own (issue 28, part 2, as ``clock.py`` did for the step count): "is this hook still
acting?" was asked in some forty places in thirteen files, each one combining plain names of Hook's one
namespace (``_closed``, ``_torn_down``, ``_exiting``, ``_exit_request``) its own way, and the exit's
bookkeeping (``_exit_code``, ``_late``, ``_exit_callbacks``, ``_prev_handlers``) was written from three files.
Here they have one owner, reached as ``hook._life``: its fields are written only by the named moves below and
read through read-only properties, and each combination the parts ask recurs under one name.

Who does what (the map, read from the code; the locks are as they were before the move):

- ``close()`` (``core.py``: ``Hook.close``, any thread, no lock) marks ``closed`` once;
  ``mark_torn_down()`` (``exit.py``: ``_quiesce``, the thread in ``destroy_process_group()``, no lock) marks
  ``torn_down`` once and ``note_last_reduction`` keeps the flag reduction it settled there (read at process
  exit, ``_at_exit``);
- ``request_exit(notice, result, step)`` (``exit.py``: ``_exit_from_background``, the agreement thread, a
  deadline timer, the torchft watchdog or group-fallback listener) records the exit decision (under ``cv``,
  the clock's: every wait on the clock stops on it);
- ``begin_exit()`` (``exit.py``: ``_exit``, the training thread; ``_hard_exit``, whichever thread leaves; no
  lock) marks ``exiting``: from here the process is leaving;
- ``keep_handler`` (``notices.py``: ``_install_signals``, the main thread at install) remembers the signal
  handlers spotguard replaced; ``Hook.close`` restores them and ``forget_handlers`` drops them (``_exit``
  drops them first, so a late SIGTERM keeps being swallowed); ``_on_signal`` chains to ``prev_handler``;
- ``add_exit_callback`` (``hook.on_exit``) and ``take_exit_callbacks`` (``exit.py``, whichever thread leaves).

The questions, each used where several parts ask the same thing: ``detached()`` (closed or torn down: no step
to count, no collective), ``closing()`` (closed or exiting), ``over()`` (any of closed, torn down, exiting:
no boundary work any more), ``leaving()`` (exiting or an exit requested), ``exit_pending()`` (an exit
requested that no thread has begun yet) and ``stopping()`` (any of the four: no new round).
"""

from __future__ import annotations

from typing import Any, Callable, Optional

__all__ = ["Lifecycle", "exit_code_of"]

ExitRequest = tuple[Any, Any, Optional[int]]  # (notice, the save's result, the step it stands for)


class Lifecycle:
    """Whether the hook is closed, torn down or leaving, and the exit's code, decision and bookkeeping."""

    def __init__(self, exit_code: int = 143, early: Optional["Lifecycle"] = None) -> None:
        """``early``: the owner a framework hook made before it was armed (``hook.on_exit`` before
        ``Hook.__init__``); its callbacks carry over."""
        self._exit_code = exit_code
        self._closed = False  # hook.close() ran (also the last step of every exit)
        self._torn_down = False  # the user destroyed the process group (or the hook quiesced for exit)
        self._exiting = False  # a thread has begun leaving the process
        self._exit_request: Optional[ExitRequest] = None  # the agreement thread's decision to leave
        self._late: Optional[tuple[int, int]] = None  # the last flag reduction, settled at teardown
        self._exit_callbacks: list[Callable[[int, bool], Any]] = early.take_exit_callbacks() if early else []
        self._prev_handlers: dict[int, Any] = {}  # signal -> the handler spotguard's replaced

    # ------------------------------------------------------------ what the parts read

    @property
    def exit_code(self) -> int:
        """The code of a committed (or nothing-to-save) exit (``exit_code=``, 143 by default)."""
        return self._exit_code

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def torn_down(self) -> bool:
        return self._torn_down

    @property
    def exiting(self) -> bool:
        return self._exiting

    @property
    def exit_request(self) -> Optional[ExitRequest]:
        """(notice, result, step) once the agreement thread decided the process leaves, else None."""
        return self._exit_request

    @property
    def exit_requested(self) -> bool:
        return self._exit_request is not None

    @property
    def last_reduction(self) -> Optional[tuple[int, int]]:
        """The flag reduction settled at teardown (None when none was in flight)."""
        return self._late

    def detached(self) -> bool:
        """Closed or torn down: no step to count, no collective to launch."""
        return self._closed or self._torn_down

    def closing(self) -> bool:
        """Closed, or exiting (which ends in a close): no notice to act on."""
        return self._closed or self._exiting

    def over(self) -> bool:
        """Closed, torn down or exiting: no boundary work (a reduction read, a periodic save) any more."""
        return self._closed or self._torn_down or self._exiting

    def leaving(self) -> bool:
        """Exiting, or an exit requested: the process goes, whoever takes it out."""
        return self._exiting or self._exit_request is not None

    def exit_pending(self) -> bool:
        """An exit was requested and no thread has begun it yet (the next hook point leaves)."""
        return self._exit_request is not None and not self._exiting

    def stopping(self) -> bool:
        """Closed, torn down, exiting or an exit requested: no new round, no new save."""
        return self._closed or self._torn_down or self._exiting or self._exit_request is not None

    # ------------------------------------------------------------ the moves

    def close(self) -> bool:
        """Mark the hook closed; False when it already was (``Hook.close`` is idempotent)."""
        if self._closed:
            return False
        self._closed = True
        return True

    def mark_torn_down(self) -> bool:
        """The process group is being destroyed; False when the hook was already torn down."""
        if self._torn_down:
            return False
        self._torn_down = True
        return True

    def note_last_reduction(self, flags: Optional[tuple[int, int]]) -> None:
        """Keep the flag reduction teardown settled (``_at_exit`` reports a notice it carried)."""
        self._late = flags

    def request_exit(self, notice: Any, result: Any, step: Optional[int]) -> None:
        """(under ``cv``) The agreement thread decided: the process leaves with ``result`` for ``step``. The
        caller notifies."""
        self._exit_request = (notice, result, step)

    def begin_exit(self) -> None:
        """A thread has begun leaving the process (the training thread's ``_exit``, or ``_hard_exit``)."""
        self._exiting = True

    def keep_handler(self, sig: int, prev: Any) -> None:
        """Remember the handler spotguard's own replaced for ``sig`` (restored at close)."""
        self._prev_handlers[sig] = prev

    def prev_handler(self, sig: int) -> Any:
        """The handler spotguard's replaced for ``sig`` (None when none is kept)."""
        return self._prev_handlers.get(sig)

    def signal_handlers(self) -> dict[int, Any]:
        """A copy of the kept handlers (signal -> previous handler)."""
        return dict(self._prev_handlers)

    def forget_handlers(self) -> None:
        """Drop the kept handlers: nothing is restored or chained to from here."""
        self._prev_handlers.clear()

    def add_exit_callback(self, callback: Callable[[int, bool], Any]) -> None:
        self._exit_callbacks.append(callback)

    def take_exit_callbacks(self) -> list[Callable[[int, bool], Any]]:
        """The callbacks to run now; each runs once (a second exit path finds none)."""
        callbacks, self._exit_callbacks = self._exit_callbacks, []
        return callbacks


def exit_code_of(hook: Any) -> int:
    """The exit code of ``hook``, 143 before it has its owner (read defensively, like ``clock.step_of``: the
    lost-peers exit may run on a hook half built)."""
    return int(getattr(getattr(hook, "_life", None), "exit_code", 143))
