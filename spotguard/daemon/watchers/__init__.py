"""One module per notice source, each a small ``Watcher`` yielding ``Notice``/``Cancel`` records."""

from .base import Backoff, Watcher, WatcherHealth

__all__ = ["Backoff", "Watcher", "WatcherHealth"]
