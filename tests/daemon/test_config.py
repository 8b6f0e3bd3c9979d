"""Flags > SPOTGUARD_<NAME> env > defaults; any bad value is one line and exit 2."""

from __future__ import annotations

import argparse
import os
import subprocess

import pytest

from spotguard.daemon.config import ConfigError, DaemonConfig, add_arguments
from spotguard.protocol import DEFAULT_SOCKET

from .conftest import REPO, daemon_cmd


def parse(argv: list[str], env: dict[str, str] | None = None, create: bool = False) -> DaemonConfig:
    p = argparse.ArgumentParser()
    add_arguments(p)
    return DaemonConfig.from_args(p.parse_args(argv), env or {}, create_socket_dir=create)


def test_defaults() -> None:
    c = parse([])
    assert (c.cloud, c.socket, c.poll_interval, c.metrics_port, c.log_format) == ("auto", DEFAULT_SOCKET, None, 0,
                                                                                   "json")
    assert c.sigterm_grace == 25.0 and c.azure_ack_after_checkpoint is False
    assert c.dmi_root == "/sys/class/dmi/id" and c.max_subscribers == 256 and c.socket_group is None


def test_env_then_flags_win() -> None:
    env = {"SPOTGUARD_CLOUD": "gcp", "SPOTGUARD_SOCKET": "/tmp/x/e.sock", "SPOTGUARD_POLL_INTERVAL": "2",
           "SPOTGUARD_METRICS_PORT": "9100", "SPOTGUARD_AZURE_ACK_AFTER_CHECKPOINT": "true",
           "SPOTGUARD_SIGTERM_GRACE": "10", "SPOTGUARD_METADATA_URL": "http://127.0.0.1:8999/",
           "SPOTGUARD_LOG_FORMAT": "console"}
    c = parse([], env)
    assert (c.cloud, c.socket, c.poll_interval, c.metrics_port) == ("gcp", "/tmp/x/e.sock", 2.0, 9100)
    assert c.azure_ack_after_checkpoint and c.sigterm_grace == 10 and c.log_format == "console"
    assert c.metadata_url == "http://127.0.0.1:8999"
    c = parse(["--cloud", "aws", "--socket", "/tmp/x/f.sock", "--poll-interval", "0.25", "--metrics-port", "0"], env)
    assert (c.cloud, c.socket, c.poll_interval, c.metrics_port) == ("aws", "/tmp/x/f.sock", 0.25, 0)


def test_empty_env_is_unset() -> None:
    assert parse([], {"SPOTGUARD_METRICS_PORT": "", "SPOTGUARD_SOCKET": " "}).metrics_port == 0


def test_bool_env_false() -> None:
    assert parse([], {"SPOTGUARD_AZURE_ACK_AFTER_CHECKPOINT": "0"}).azure_ack_after_checkpoint is False


@pytest.mark.parametrize("argv, env, needle", [
    (["--cloud", "oracle"], {}, "--cloud: must be one of auto, aws, gcp, azure, none"),
    (["--poll-interval", "-1"], {}, "--poll-interval: must be greater than 0"),
    (["--poll-interval", "abc"], {}, "--poll-interval: expected a number of seconds"),
    ([], {"SPOTGUARD_POLL_INTERVAL": "fast"}, "SPOTGUARD_POLL_INTERVAL='fast' (env): expected a number"),
    (["--metrics-port", "70000"], {}, "--metrics-port: must be at most 65535"),
    (["--metrics-port", "-5"], {}, "--metrics-port: must be at least 0"),
    ([], {"SPOTGUARD_METRICS_PORT": "80.5"}, "expected an integer"),
    (["--sigterm-grace", "nan"], {}, "finite"),
    (["--log-format", "xml"], {}, "--log-format: must be one of json, console"),
    (["--metadata-url", "169.254.169.254"], {}, "expected a base URL"),
    ([], {"SPOTGUARD_AZURE_ACK_AFTER_CHECKPOINT": "maybe"}, "expected a boolean"),
    (["--socket-group", "no-such-group-xyz"], {}, "no such group"),
    (["--socket", "/tmp/" + "x" * 120], {}, "AF_UNIX"),
    (["--max-subscribers", "0"], {}, "at least 1"),
])
def test_invalid(argv: list[str], env: dict[str, str], needle: str) -> None:
    with pytest.raises(ConfigError) as exc:
        parse(argv, env)
    assert needle in str(exc.value)
    assert "\n" not in str(exc.value)


def test_socket_dir_created_or_clear_error(sockdir: str) -> None:
    c = parse(["--socket", os.path.join(sockdir, "run", "spotguard", "s.sock")], create=True)
    assert os.path.isdir(os.path.dirname(c.socket))
    blocker = os.path.join(sockdir, "file")
    open(blocker, "w").close()
    with pytest.raises(ConfigError, match="cannot create socket directory"):
        parse(["--socket", os.path.join(blocker, "sub", "s.sock")], create=True)


@pytest.mark.parametrize("argv, env", [
    (["--cloud", "nope"], {}),
    ([], {"SPOTGUARD_POLL_INTERVAL": "-3"}),
    (["--metrics-port", "99999"], {}),
    (["--socket", "/proc/1/nope/s.sock"], {}),
])
def test_daemon_exits_2_with_one_line(argv: list[str], env: dict[str, str]) -> None:
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("SPOTGUARD_")}
    full_env.update(env)
    proc = subprocess.run(daemon_cmd(*argv), env=full_env, capture_output=True, text=True, timeout=30, cwd=REPO)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("spotguard daemon: error: ")
    assert proc.stdout == ""


# flag -> (env text, value from env, flag argv, value from flag); every option listed.
SAMPLES: dict[str, tuple[str, object, list[str], object]] = {
    "cloud": ("gcp", "gcp", ["--cloud", "aws"], "aws"),
    "metadata-url": ("http://127.0.0.1:8999/", "http://127.0.0.1:8999", ["--metadata-url", "http://127.0.0.1:1"],
                     "http://127.0.0.1:1"),
    "socket": ("/tmp/sg-env.sock", "/tmp/sg-env.sock", ["--socket", "/tmp/sg-flag.sock"], "/tmp/sg-flag.sock"),
    "poll-interval": ("2", 2.0, ["--poll-interval", "0.25"], 0.25),
    "metrics-port": ("9100", 9100, ["--metrics-port", "0"], 0),
    "log-format": ("console", "console", ["--log-format", "json"], "json"),
    "log-level": ("debug", "debug", ["--log-level", "error"], "error"),
    "azure-ack-after-checkpoint": ("true", True, ["--no-azure-ack-after-checkpoint"], False),
    "sigterm-grace": ("10", 10.0, ["--sigterm-grace", "3"], 3.0),
    "dmi-root": ("/tmp/dmi-env", "/tmp/dmi-env", ["--dmi-root", "/tmp/dmi-flag"], "/tmp/dmi-flag"),
    "socket-group": ("0", "0", ["--socket-group", "1"], "1"),
    "max-subscribers": ("7", 7, ["--max-subscribers", "9"], 9),
    "node": ("env-node", "env-node", ["--node", "flag-node"], "flag-node"),
    "ping-interval": ("3", 3.0, ["--ping-interval", "4"], 4.0),
    "send-queue": ("32", 32, ["--send-queue", "64"], 64),
    "webhook-url": ("https://hooks.example/a?token=x", "https://hooks.example/a?token=x",
                    ["--webhook-url", "http://127.0.0.1:1/"], "http://127.0.0.1:1/"),
    "webhook-headers-file": ("/etc/h-env", "/etc/h-env", ["--webhook-headers-file", "/etc/h"], "/etc/h"),
    "webhook-template": ("/etc/t-env", "/etc/t-env", ["--webhook-template", "/etc/t"], "/etc/t"),
    "slack-webhook-url": ("https://hooks.slack.example/services/T/B/x", "https://hooks.slack.example/services/T/B/x",
                          ["--slack-webhook-url", "http://127.0.0.1:2"], "http://127.0.0.1:2"),
    "kubernetes-node-actions": ("yes", True, ["--no-kubernetes-node-actions"], False),
    "asg-lifecycle-hook": ("auto", "auto", ["--asg-lifecycle-hook", "drain-hook"], "drain-hook"),
    "reconnect-grace": ("3", 3.0, ["--reconnect-grace", "0.5"], 0.5),
    "sigterm-notice": ("1", True, ["--no-sigterm-notice"], False),
    "azure-vm-name": ("vm-env", "vm-env", ["--azure-vm-name", "vm-flag"], "vm-flag"),
    "health-stale-after": ("30", 30.0, ["--health-stale-after", "45"], 45.0),
}


def test_a_bad_secret_url_from_env_is_not_echoed() -> None:
    secret = "ftp://hooks.example/services/T0/B0/s3cr3t-t0ken"
    with pytest.raises(ConfigError) as err:
        parse([], {"SPOTGUARD_SLACK_WEBHOOK_URL": secret})
    assert "SPOTGUARD_SLACK_WEBHOOK_URL" in str(err.value) and "s3cr3t" not in str(err.value)


def test_sigterm_is_not_a_notice_by_default() -> None:
    import argparse

    from spotguard.daemon.config import DaemonConfig, add_arguments

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    cfg = DaemonConfig.from_args(parser.parse_args([]), env={}, create_socket_dir=False)
    assert cfg.sigterm_notice is False and cfg.azure_vm_name == "" and cfg.health_stale_after == 120.0
    on = DaemonConfig.from_args(parser.parse_args([]), env={"SPOTGUARD_SIGTERM_NOTICE": "yes"},
                                create_socket_dir=False)
    assert on.sigterm_notice is True


def test_samples_cover_every_option() -> None:
    from spotguard.daemon.config import _OPTIONS

    assert set(SAMPLES) == {o.flag for o in _OPTIONS}


@pytest.mark.parametrize("flag", sorted(SAMPLES))
def test_every_option_works_as_env_and_the_flag_wins(flag: str) -> None:
    env_text, env_value, argv, flag_value = SAMPLES[flag]
    dest = flag.replace("-", "_")
    env = {"SPOTGUARD_" + dest.upper(): env_text}
    assert getattr(DaemonConfig(), dest) != env_value, "the sample must differ from the default"
    assert getattr(parse([], env), dest) == env_value
    assert getattr(parse(argv, env), dest) == flag_value


def test_boolean_flag_wins_over_env_both_ways() -> None:
    assert parse(["--azure-ack-after-checkpoint"], {"SPOTGUARD_AZURE_ACK_AFTER_CHECKPOINT": "0"}) \
        .azure_ack_after_checkpoint is True
    assert parse(["--no-azure-ack-after-checkpoint"], {"SPOTGUARD_AZURE_ACK_AFTER_CHECKPOINT": "1"}) \
        .azure_ack_after_checkpoint is False
