"""``spotguard report``: goodput, preemptions, downtime and money of one job, from its history (docs/report.md)."""
