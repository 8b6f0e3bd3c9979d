"""The per-VM daemon: notice watchers, Unix-socket fan-out, metrics, sd_notify."""
