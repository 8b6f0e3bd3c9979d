"""The active notices, kept in a small file next to the socket so a restarted daemon keeps their ids.

Why: watcher ids are per occurrence (an AWS spot notice's id includes when it was
first seen, a GCP one its first-seen time and a counter), so after ``kill -9`` and
a restart the daemon would give the *same* provider notice a *new* id. A trainer
restarted on the doomed VM would then not recognise the notice its checkpoint was
written for (the hook compares ids), and would train and checkpoint again.

So every active notice that carries a content ``key`` (set by its watcher, never
sent on the wire) is written here, atomically, whenever the set changes; a
restarted daemon loads the file and a watcher notice whose ``(source, key)``
matches keeps the persisted id, deadline and ``received_at``.

The file lives next to the socket (``RuntimeDirectory=spotguard`` under systemd:
it survives a daemon restart — with ``RuntimeDirectoryPreserve=restart`` — but
not a reboot, which is a new VM anyway).

Each notice also carries its cluster-action state (``actions``: which subscribers it
reached and what they reported in every daemon life, the outcome once decided, which
actions sent it; ``actions.ActionState``), so a restarted daemon neither decides an
outcome before those subscribers could reconnect nor sends a decided one twice. Older
daemons ignore the extra field.

Writing is split so the daemon can keep it off the delivery path: ``encode`` (cheap,
on the event loop, after the fan-out was queued) and ``write`` (write + fsync + rename,
in a worker thread; ``save`` does both inline). Reading is defensive: the file must be
a regular file owned by the daemon's uid (``O_NOFOLLOW``: a planted symlink is
refused), at most ``MAX_BYTES``, and every entry is validated; anything wrong is
one logged line and the entry (or the file) is ignored — never a crash.
"""

from __future__ import annotations

import json
import os
import secrets
import stat
from datetime import timedelta
from typing import Any, Iterable, Optional

from ..logs import get_logger
from ..notice import Notice
from ..timefmt import utcnow

__all__ = ["NoticeState", "MAX_BYTES", "MAX_ENTRIES", "state_path_for"]

log = get_logger("spotguard.daemon.persist")

FORMAT = 1
MAX_BYTES = 1 << 20
MAX_ENTRIES = 1024
MAX_KEY = 1024

Key = tuple[str, str]


def state_path_for(socket_path: str) -> str:
    """``/run/spotguard/spotguard.sock`` -> ``/run/spotguard/spotguard.sock.notices.json``."""
    return socket_path + ".notices.json"


def parse_state(raw: bytes, *, expire_margin: float = 60.0,
                actions: Optional[dict[str, Any]] = None) -> tuple[dict[Key, Notice], list[str]]:
    """Entries of a state file by ``(source, key)``, and why any were skipped. Never raises.

    ``actions``, if given, receives each kept notice's raw ``actions`` object by notice id
    (validated later by ``ActionState.from_dict``)."""
    problems: list[str] = []
    try:
        doc = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        return {}, [f"not JSON: {type(exc).__name__}: {str(exc)[:200]}"]
    if not isinstance(doc, dict) or doc.get("format") != FORMAT or not isinstance(doc.get("notices"), list):
        return {}, [f"not a format-{FORMAT} notice state document"]
    limit = utcnow() - timedelta(seconds=expire_margin)
    out: dict[Key, Notice] = {}
    for i, item in enumerate(doc["notices"][:MAX_ENTRIES]):
        try:
            if not isinstance(item, dict):
                raise ValueError("entry is not an object")
            key = item.get("key")
            if not isinstance(key, str) or not key or len(key) > MAX_KEY:
                raise ValueError("missing or bad key")
            notice = Notice.from_wire(item)
            if not isinstance(notice.id, str) or len(notice.id) > MAX_KEY:
                raise ValueError("bad id")
        except Exception as exc:  # noqa: BLE001 - any bad entry is skipped, never a crash
            problems.append(f"entry {i}: {str(exc)[:200]}")
            continue
        if notice.deadline < limit:
            continue  # expired while the daemon was down
        if actions is not None and isinstance(item.get("actions"), dict):
            actions[notice.id] = item["actions"]
        out[(notice.source, key)] = Notice(id=notice.id, source=notice.source, kind=notice.kind,
                                           deadline=notice.deadline, received_at=notice.received_at,
                                           detail=notice.detail, key=key)
    if len(doc["notices"]) > MAX_ENTRIES:
        problems.append(f"{len(doc['notices']) - MAX_ENTRIES} entries beyond {MAX_ENTRIES} ignored")
    return out, problems


class NoticeState:
    """Load once at start; ``save`` the keyed active notices whenever they change. Never raises."""

    def __init__(self, path: Optional[str], *, expire_margin: float = 60.0) -> None:
        self.path = path
        self.expire_margin = expire_margin
        self._last: Optional[bytes] = None
        self._warned = False
        self.actions: dict[str, Any] = {}  # by notice id, from ``load``: the raw per-notice action state
        self.subscribers = 0  # from ``load``: trainers subscribed when the previous daemon stopped
        # From ``load``: who was subscribed at the last write of a daemon that did not stop cleanly (raw, untrusted;
        # ``actions.ActionRunner.restore`` validates it). A clean stop writes no list.
        self.subscribed: Any = None

    def load(self) -> dict[Key, Notice]:
        if not self.path:
            return {}
        flags = os.O_RDONLY | os.O_CLOEXEC | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)
        try:
            fd = os.open(self.path, flags)
        except FileNotFoundError:
            return {}
        except OSError as exc:
            log.warning("notice_state.ignored", path=self.path, reason=f"cannot open ({exc.strerror}); a symlink?")
            return {}
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                log.warning("notice_state.ignored", path=self.path, reason="not a regular file")
                return {}
            if st.st_uid != os.geteuid():
                log.warning("notice_state.ignored", path=self.path,
                            reason=f"owned by uid {st.st_uid}, not the daemon's uid {os.geteuid()}")
                return {}
            if st.st_size > MAX_BYTES:
                log.warning("notice_state.ignored", path=self.path, reason=f"larger than {MAX_BYTES} bytes")
                return {}
            raw = os.read(fd, MAX_BYTES + 1)
        except OSError as exc:
            log.warning("notice_state.ignored", path=self.path, reason=f"cannot read ({exc.strerror})")
            return {}
        finally:
            os.close(fd)
        self.actions = {}
        entries, problems = parse_state(raw, expire_margin=self.expire_margin, actions=self.actions)
        try:
            doc = json.loads(raw.decode("utf-8"))
            subs = doc.get("subscribers", 0)
            self.subscribers = subs if isinstance(subs, int) and not isinstance(subs, bool) and subs > 0 else 0
            self.subscribed = doc.get("subscribed") if isinstance(doc.get("subscribed"), list) else None
        except (UnicodeDecodeError, ValueError, RecursionError, AttributeError):
            self.subscribers = 0
            self.subscribed = None
        for p in problems:
            log.warning("notice_state.entry_skipped", path=self.path, reason=p)
        if entries:
            log.info("notice_state.loaded", path=self.path, notices=len(entries),
                     ids=[n.id for n in entries.values()][:16])
        return entries

    def encode(self, notices: Iterable[Notice], actions: Optional[dict[str, Any]] = None,
               subscribers: int = 0, subscribed: Optional[list[Any]] = None) -> Optional[bytes]:
        """The file's bytes for these keyed notices (with each one's action state), or ``None`` if unchanged.

        ``subscribers`` (written at a stop): how many trainers were subscribed, so the next daemon knows some
        are about to reconnect and decides no outcome in its first moments. ``subscribed`` (written while running):
        who is subscribed, so that the next daemon, if this one is killed before it wrote a notice down, knows who
        that notice may have reached (``actions.ActionRunner.registry``)."""
        if not self.path:
            return None
        items = []
        for n in notices:
            if n.key:
                item: dict[str, Any] = {**n.to_wire(), "key": n.key}
                if actions and n.id in actions:
                    item["actions"] = actions[n.id]
                items.append(item)
        doc: dict[str, Any] = {"format": FORMAT, "notices": items[:MAX_ENTRIES]}
        if subscribers > 0:
            doc["subscribers"] = subscribers
        if subscribed:
            doc["subscribed"] = subscribed[:MAX_ENTRIES]
        data = (json.dumps(doc, separators=(",", ":"), default=str) + "\n").encode()
        return None if data == self._last else data

    def save(self, notices: Iterable[Notice], actions: Optional[dict[str, Any]] = None) -> bool:
        """Write the keyed notices atomically (temp file + rename); unchanged content is not rewritten."""
        data = self.encode(notices, actions)
        return True if data is None else self.write(data)

    def write(self, data: bytes) -> bool:
        """Write + fsync + rename (blocking: the daemon runs it in a worker thread). Never raises."""
        if not self.path:
            return True
        directory = os.path.dirname(os.path.abspath(self.path))
        tmp = os.path.join(directory, f".{os.path.basename(self.path)}.{secrets.token_hex(6)}.tmp")
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | getattr(os, "O_NOFOLLOW", 0),
                         0o600)
            try:
                os.write(fd, data)
                os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(tmp, self.path)  # rename never follows a symlink at the destination: it replaces it
        except OSError as exc:
            try:
                os.unlink(tmp)
            except OSError:
                pass
            if not self._warned:
                self._warned = True
                log.warning("notice_state.write_failed", path=self.path, error=exc.strerror or repr(exc),
                            detail="a restarted daemon may give an active notice a new id")
            return False
        self._last = data
        self._warned = False
        return True
