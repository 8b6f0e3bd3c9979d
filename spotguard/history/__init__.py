"""The job's history beside its checkpoints (``history/``): written by the hook, read by ``spotguard report``.

``record.py`` is the one event type and its key names; ``writer.py`` the hook's background
writer and log tap; ``read.py`` the reader that skips damaged or foreign entries by name.
"""

from .read import History, read_history
from .record import KINDS, VERSION, BadEntry, Event
from .writer import HistoryWriter, LogTap, for_hook, tap

__all__ = ["Event", "BadEntry", "KINDS", "VERSION", "HistoryWriter", "LogTap", "tap", "for_hook",
           "History", "read_history"]
