"""Stable names of the hook's timeline events (structlog ``event`` field).

Why constants: ``make demo`` and the tests parse the workers' JSON log lines to
draw the per-notice timeline; renaming one of these is a breaking change.

Every timeline line carries ``component="hook"``, ``rank`` and, once a notice
is known, ``notice_id``. Fields per event:

- ``hook_installed``: world_size, storage, objects (key -> role), socket, pid
- ``resumed``: step, uri, from_notice_id (the notice the checkpoint was written for, or null)
- ``notice_seen``: notice_id, kind, source, via ("daemon" | "signal"), deadline, seconds_left
- ``notice_ignored``: notice_id, reason
- ``notice_deferred``: notice_id, kind, lead, acts_in (an emergency notice further off than
  ``SPOTGUARD_EMERGENCY_LEAD``: training goes on; the emergency checkpoint starts ``lead`` s before
  the deadline)
- ``notice_cancelled``: notice_id
- ``agreed``: notice_id, step (completed iterations the checkpoint stands for), flag (0-3), kind,
  action ("emergency" | "checkpoint" | "exit" | "none"), seconds_since_notice, seconds_left
- ``checkpoint_started``: notice_id, step, uri, reason
- ``checkpoint_committed``: notice_id, step, uri, bytes, seconds, seconds_left
- ``checkpoint_failed``: notice_id, step, error, seconds
- ``teardown``: notice_id, method ("destroy" | "abort" | "none" | "timeout"), seconds
- ``exit``: notice_id, code, step, committed (bool), seconds_since_notice, seconds_left
- ``notice_after_last_step``: notice_id, step (the job finished its work; exit code unchanged)
"""

from __future__ import annotations

HOOK_INSTALLED = "hook_installed"
RESUMED = "resumed"
NOTICE_SEEN = "notice_seen"
NOTICE_IGNORED = "notice_ignored"
NOTICE_DEFERRED = "notice_deferred"
NOTICE_CANCELLED = "notice_cancelled"
AGREED = "agreed"
CHECKPOINT_STARTED = "checkpoint_started"
CHECKPOINT_COMMITTED = "checkpoint_committed"
CHECKPOINT_FAILED = "checkpoint_failed"
TEARDOWN = "teardown"
EXIT = "exit"
NOTICE_AFTER_LAST_STEP = "notice_after_last_step"

TIMELINE: tuple[str, ...] = (
    NOTICE_SEEN,
    AGREED,
    CHECKPOINT_STARTED,
    CHECKPOINT_COMMITTED,
    CHECKPOINT_FAILED,
    TEARDOWN,
    EXIT,
    RESUMED,
)
