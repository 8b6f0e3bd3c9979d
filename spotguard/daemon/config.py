"""Daemon configuration: flags, then ``SPOTGUARD_<NAME>`` env vars, then defaults.

Every value is parsed here, once, so that a bad setting is one clear line naming
the flag, the env var and the fix (exit 2) instead of a traceback later on.
Flags are declared as strings on purpose: argparse's own type errors print a
usage block, and a systemd journal wants one line.
"""

from __future__ import annotations

import argparse
import grp
import os
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional
from urllib.parse import urlparse

from ..protocol import DEFAULT_SOCKET

__all__ = ["DaemonConfig", "ConfigError", "add_arguments", "CLOUDS", "DEFAULTS", "ENV_PREFIX"]

ENV_PREFIX = "SPOTGUARD_"
CLOUDS = ("auto", "aws", "gcp", "azure", "none")
LOG_FORMATS = ("json", "console")
LOG_LEVELS = ("debug", "info", "warning", "error")


class ConfigError(ValueError):
    """An invalid setting; ``str()`` is the one line shown to the operator."""


@dataclass
class DaemonConfig:
    cloud: str = "auto"
    metadata_url: Optional[str] = None
    socket: str = DEFAULT_SOCKET
    # None: each watcher's own default (AWS 0.5 s, Azure 1 s, GCP hanging GET).
    poll_interval: Optional[float] = None
    metrics_port: int = 0
    log_format: str = "json"
    log_level: str = "info"
    azure_ack_after_checkpoint: bool = False
    # Off: a SIGTERM to the daemon (rollout, upgrade, restart) is a clean stop, never a notice.
    sigterm_notice: bool = False
    # Kubernetes' default terminationGracePeriodSeconds is 30: leave 5 s to exit.
    sigterm_grace: float = 25.0
    dmi_root: str = "/sys/class/dmi/id"
    socket_group: Optional[str] = None
    max_subscribers: int = 256
    # "" = a watcher's node name (e.g. the instance id) if it has one, else the hostname.
    node: str = ""
    # Azure: the VM name Scheduled Events' ``Resources`` are matched against ("" = read it from
    # IMDS ``instance/compute``). Not ``node``: a Kubernetes node name (``...-vmss000000``) is not
    # the name Scheduled Events list for a scale-set instance (``..._0``).
    azure_vm_name: str = ""
    # Seconds without a good metadata answer after which /healthz and ``status --check`` fail.
    health_stale_after: float = 120.0
    ping_interval: float = 10.0
    send_queue: int = 256
    # Cluster actions (spotguard/daemon/actions), all off by default.
    webhook_url: Optional[str] = None
    webhook_headers_file: Optional[str] = None
    webhook_template: Optional[str] = None
    slack_webhook_url: Optional[str] = None
    kubernetes_node_actions: bool = False
    asg_lifecycle_hook: Optional[str] = None  # a hook name, or "auto": the group's hooks named spotguard*
    # Seconds a notice restored after a daemon restart waits for the subscribers it reached in an
    # earlier life to reconnect before any outcome counts them as gone (intakes retry within 2 s).
    reconnect_grace: float = 10.0

    # Resolved by ``validate``: numeric gid for ``socket_group``.
    socket_gid: Optional[int] = None

    def validate(self, *, create_socket_dir: bool = True) -> "DaemonConfig":
        """Check cross-field rules and make the socket directory; raise ``ConfigError``."""
        if self.socket_group:
            self.socket_gid = _resolve_group(self.socket_group)
        path = self.socket
        if len(os.fsencode(path)) > 107:
            raise ConfigError(
                f"--socket {path!r} is {len(os.fsencode(path))} bytes; AF_UNIX paths are limited to 107: "
                "choose a shorter path"
            )
        if create_socket_dir:
            directory = os.path.dirname(os.path.abspath(path))
            try:
                os.makedirs(directory, mode=0o755, exist_ok=True)
            except OSError as exc:
                raise ConfigError(
                    f"cannot create socket directory {directory!r} ({exc.strerror}): create it, "
                    "run with RuntimeDirectory=spotguard under systemd, or set --socket / SPOTGUARD_SOCKET "
                    "to a writable path"
                ) from None
            if not os.path.isdir(directory):
                raise ConfigError(f"socket directory {directory!r} is not a directory: fix --socket")
        return self

    @classmethod
    def from_args(cls, args: argparse.Namespace, env: Optional[Mapping[str, str]] = None,
                  *, create_socket_dir: bool = True) -> "DaemonConfig":
        """Merge parsed flags (``None`` = not given) over env vars over defaults."""
        env = os.environ if env is None else env
        values: dict[str, Any] = {}
        for opt in _OPTIONS:
            raw = getattr(args, opt.dest, None)
            origin = f"--{opt.flag}"
            if raw is None:
                env_raw = env.get(opt.env)
                if env_raw is None or not env_raw.strip():
                    continue  # an empty env var (systemd Environment=X=) counts as unset
                # A secret (a webhook URL) is never echoed in the error line.
                raw, origin = env_raw, opt.env if opt.secret else f"{opt.env}={env_raw!r}"
            values[opt.dest] = opt.parse(raw, origin)
        return cls(**values).validate(create_socket_dir=create_socket_dir)


# --- parsing -----------------------------------------------------------------


def _resolve_group(name: str) -> int:
    if name.isdigit():
        return int(name)
    try:
        return grp.getgrnam(name).gr_gid
    except KeyError:
        raise ConfigError(
            f"--socket-group {name!r}: no such group; create it (groupadd {name}) or pass an existing group name or gid"
        ) from None


@dataclass(frozen=True)
class _Opt:
    flag: str
    kind: str  # str|float|int|flag|choice|url|endpoint
    help: str
    choices: tuple[str, ...] = ()
    minimum: Optional[float] = None
    maximum: Optional[float] = None
    strictly_positive: bool = False
    secret: bool = False

    @property
    def dest(self) -> str:
        return self.flag.replace("-", "_")

    @property
    def env(self) -> str:
        return ENV_PREFIX + self.dest.upper()

    def _where(self, origin: str) -> str:
        return origin if origin.startswith("--") else f"{origin} (env)"

    def parse(self, raw: Any, origin: str) -> Any:
        where = self._where(origin)
        if self.kind == "flag":
            if raw is True:
                return True
            text = str(raw).strip().lower()
            if text in ("1", "true", "yes", "on"):
                return True
            if text in ("0", "false", "no", "off"):
                return False
            raise ConfigError(f"{where}: expected a boolean (1/0, true/false, yes/no, on/off)")
        text = str(raw).strip()
        if self.kind == "choice":
            if text.lower() not in self.choices:
                raise ConfigError(f"{where}: must be one of {', '.join(self.choices)}")
            return text.lower()
        if self.kind == "url":
            parsed = urlparse(text)
            if parsed.scheme not in ("http", "https") or not parsed.netloc:
                raise ConfigError(f"{where}: expected a base URL like http://127.0.0.1:8999")
            return text.rstrip("/")
        if self.kind == "endpoint":
            parsed = urlparse(text)
            if parsed.scheme not in ("http", "https") or not parsed.hostname:
                raise ConfigError(f"{where}: expected an http(s):// URL")
            return text
        if self.kind == "str":
            if not text:
                raise ConfigError(f"{where}: must not be empty")
            return text
        conv: Callable[[str], Any] = int if self.kind == "int" else float
        try:
            value = conv(text)
        except ValueError:
            noun = "an integer" if self.kind == "int" else "a number of seconds"
            raise ConfigError(f"{where}: expected {noun}, got {text!r}") from None
        if self.kind == "float" and (value != value or value in (float("inf"), float("-inf"))):
            raise ConfigError(f"{where}: must be a finite number")
        if self.strictly_positive and value <= 0:
            raise ConfigError(f"{where}: must be greater than 0, got {text}")
        if self.minimum is not None and value < self.minimum:
            raise ConfigError(f"{where}: must be at least {self.minimum:g}, got {text}")
        if self.maximum is not None and value > self.maximum:
            raise ConfigError(f"{where}: must be at most {self.maximum:g}, got {text}")
        return value


_OPTIONS: tuple[_Opt, ...] = (
    _Opt("cloud", "choice", "where to watch: auto (DMI, then probe), aws, gcp, azure, none (signal + drill only)",
         choices=CLOUDS),
    _Opt("metadata-url", "url", "base URL replacing the link-local metadata endpoint (emulators)"),
    _Opt("socket", "str", f"Unix socket path (default {DEFAULT_SOCKET})"),
    _Opt("poll-interval", "float", "seconds between metadata polls (default: per cloud)", strictly_positive=True,
         maximum=3600),
    _Opt("metrics-port", "int", "serve /metrics and /healthz on 127.0.0.1:PORT (0 = off)", minimum=0,
         maximum=65535),
    _Opt("log-format", "choice", "json (default) or console", choices=LOG_FORMATS),
    _Opt("log-level", "choice", "debug, info (default), warning, error", choices=LOG_LEVELS),
    _Opt("azure-ack-after-checkpoint", "flag",
         "approve the Azure event (StartRequests) once every subscriber reported checkpoint_done"),
    _Opt("sigterm-notice", "flag",
         "turn the daemon's own SIGTERM into a termination notice (off: SIGTERM is a clean stop in <= 2 s and "
         "trainers keep training; on only where the trainer gets no signal of its own, see docs/deploy.md)"),
    _Opt("sigterm-grace", "float", "deadline in seconds of the notice made from the daemon's own SIGTERM with "
         "--sigterm-notice (default 25)", minimum=0, maximum=86400),
    _Opt("dmi-root", "str", "directory of the DMI files used by --cloud auto (default /sys/class/dmi/id)"),
    _Opt("socket-group", "str", "group (name or gid) given the socket, so non-root trainers can connect"),
    _Opt("max-subscribers", "int", "most subscribers at once (default 256)", minimum=1, maximum=100000),
    _Opt("node", "str", "node name sent in hello (default: the hostname)"),
    _Opt("azure-vm-name", "str", "Azure VM name to match Scheduled Events against (default: read from IMDS "
         "instance/compute, needed once before any event is delivered); set it where that endpoint is "
         "unavailable"),
    _Opt("health-stale-after", "float", "seconds without a good metadata answer before /healthz and "
         "`spotguard status --check` fail (default 120)", strictly_positive=True, maximum=86400),
    _Opt("ping-interval", "float", "seconds between pings to clients (default 10)", strictly_positive=True,
         maximum=3600),
    _Opt("send-queue", "int", "messages queued per client before a slow client is dropped (default 256)",
         minimum=1, maximum=1000000),
    # Cluster actions (docs/deploy.md "Cluster actions"): each off unless given.
    _Opt("webhook-url", "endpoint", "POST a JSON document to this URL once a notice's checkpoint outcome is "
         "known (its path and query are never logged)", secret=True),
    _Opt("webhook-headers-file", "str", "file of 'Name: value' lines added to --webhook-url requests "
         "(e.g. Authorization; values never logged)"),
    _Opt("webhook-template", "str", "JSON file with $id, $kind, $step, $status, $summary ... placeholders: "
         "the --webhook-url body instead of the default document"),
    _Opt("slack-webhook-url", "endpoint", "Slack-compatible incoming webhook ({\"text\": ...}) sent with the "
         "checkpoint outcome", secret=True),
    _Opt("kubernetes-node-actions", "flag", "on a cloud preemption/termination notice taint and cordon --node, "
         "and put an Event on each subscriber's pod after its checkpoint (in-cluster service account)"),
    _Opt("asg-lifecycle-hook", "str", "on an Auto Scaling Terminated notice, heartbeat this terminating "
         "lifecycle hook ('auto': the group's terminating hooks whose name starts with 'spotguard') and complete "
         "it with CONTINUE once every subscriber committed"),
    _Opt("reconnect-grace", "float", "seconds a notice restored after a daemon restart waits for the trainers "
         "it reached before to reconnect before deciding its outcome (default 10; trainers retry within 2 s)",
         minimum=0, maximum=600),
)

DEFAULTS = DaemonConfig()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Declare the daemon's flags; every flag is also ``SPOTGUARD_<NAME>``."""
    for opt in _OPTIONS:
        if opt.kind == "flag":
            # --X / --no-X: a flag must be able to win over the env var either way.
            parser.add_argument(f"--{opt.flag}", dest=opt.dest, action=argparse.BooleanOptionalAction,
                                default=None, help=f"{opt.help} [env {opt.env}]")
        else:
            metavar = {"choice": "{" + ",".join(opt.choices) + "}", "url": "URL", "endpoint": "URL",
                       "float": "SECONDS",
                       "int": "N"}.get(opt.kind, {"socket": "PATH", "dmi-root": "DIR"}.get(opt.flag,
                                                                                       opt.flag.split("-")[-1].upper()))
            if opt.flag == "metrics-port":
                metavar = "PORT"
            parser.add_argument(f"--{opt.flag}", dest=opt.dest, default=None, metavar=metavar,
                                help=f"{opt.help} [env {opt.env}]")
