"""Minimal systemd ``sd_notify`` (READY, WATCHDOG, STOPPING, STATUS) with no dependency.

``Type=notify`` lets the trainer's unit start only once the socket is listening;
``WatchdogSec=`` restarts a daemon whose event loop is stuck. Outside systemd
(``NOTIFY_SOCKET`` unset) every call is a cheap no-op.
"""

from __future__ import annotations

import os
import socket
from typing import Mapping, Optional

from ..logs import get_logger

__all__ = ["SdNotifier"]

log = get_logger("spotguard.daemon.sdnotify")


class SdNotifier:
    """Sends ``KEY=VALUE`` datagrams to ``$NOTIFY_SOCKET`` (path or ``@abstract``)."""

    def __init__(self, env: Optional[Mapping[str, str]] = None) -> None:
        env = os.environ if env is None else env
        raw = env.get("NOTIFY_SOCKET", "")
        self.address: Optional[str] = None
        if raw.startswith("@"):
            self.address = "\0" + raw[1:]
        elif raw.startswith("/"):
            self.address = raw
        self._sock: Optional[socket.socket] = None
        self._warned = False
        self.watchdog_interval: Optional[float] = self._watchdog_interval(env)

    @staticmethod
    def _watchdog_interval(env: Mapping[str, str]) -> Optional[float]:
        """Half of ``WATCHDOG_USEC`` (systemd's advice), if the watchdog is meant for us."""
        usec = env.get("WATCHDOG_USEC", "")
        pid = env.get("WATCHDOG_PID", "")
        if not usec.isdigit() or int(usec) <= 0:
            return None
        if pid and pid.isdigit() and int(pid) != os.getpid():
            return None
        return int(usec) / 1e6 / 2

    @property
    def enabled(self) -> bool:
        return self.address is not None

    def notify(self, *lines: str) -> bool:
        """Send one datagram; never raises (systemd being away must not hurt the daemon)."""
        if self.address is None:
            return False
        payload = "\n".join(lines).encode()
        try:
            if self._sock is None:
                self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
                self._sock.setblocking(False)
            self._sock.sendto(payload, self.address)
            return True
        except OSError as exc:
            if not self._warned:
                self._warned = True
                log.warning("sdnotify.failed", socket=os.environ.get("NOTIFY_SOCKET"), error=str(exc))
            return False

    def ready(self, status: str = "") -> bool:
        return self.notify("READY=1", f"MAINPID={os.getpid()}", *([f"STATUS={status}"] if status else []))

    def status(self, text: str) -> bool:
        return self.notify(f"STATUS={text}")

    def watchdog(self) -> bool:
        return self.notify("WATCHDOG=1")

    def stopping(self, status: str = "") -> bool:
        return self.notify("STOPPING=1", *([f"STATUS={status}"] if status else []))

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None
