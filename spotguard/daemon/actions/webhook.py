"""Webhooks: a generic JSON POST and a Slack-compatible message, sent once the checkpoint outcome is known.

* generic (``--webhook-url``): the JSON body is the notice, the node and the outcome
  (``default_payload``), or the operator's template (``--webhook-template``: a JSON file
  whose strings may hold ``$id``, ``$kind``, ``$step``, ``$status``, ``$summary`` …, see
  ``Outcome.fields``; a string that is exactly ``$step`` keeps the value's JSON type).
  Extra headers (``Authorization: Bearer …``) come from ``--webhook-headers-file``.
* Slack (``--slack-webhook-url``): ``{"text": summary}``, which Slack, Mattermost and
  Rocket.Chat incoming webhooks accept.

Substitution is ``string.Template``: data in, text out, no attribute access or code.
Retries (connection errors, timeouts, 408, 429, 5xx) back off until the notice's
deadline (at least ``MIN_BUDGET`` seconds). The URL's path and query (Slack's secret,
``?token=``) and header values never reach a log line: only ``scheme://host`` does.
"""

from __future__ import annotations

import asyncio
import json
import random
import re
import string
from typing import Any, Optional
from urllib.parse import urlsplit

import aiohttp

from ...logs import get_logger
from . import Action, ActionError, Deadline, Outcome

__all__ = ["WebhookAction", "load_headers", "load_template", "render", "default_payload", "redact_url"]

log = get_logger("spotguard.actions.webhook")

#: A webhook gets at least this long even when the outcome came at the deadline.
MIN_BUDGET = 10.0
REQUEST_TIMEOUT = 10.0
RETRY_STATUSES = frozenset({408, 425, 429}) | frozenset(range(500, 600))
_HEADER_NAME = re.compile(r"^[!#$%&'*+.^_`|~0-9A-Za-z-]+$")
MAX_FILE = 64 * 1024


def redact_url(url: str) -> str:
    """``scheme://host[:port]``: the path (Slack's secret) and the query (tokens) are never logged."""
    parts = urlsplit(url)
    host = parts.hostname or "?"
    return f"{parts.scheme}://{host}" + (f":{parts.port}" if parts.port else "")


def _read(path: str, flag: str) -> str:
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_FILE + 1)
    except OSError as exc:
        raise ActionError(f"{flag} {path!r}: cannot read it ({exc.strerror}); mount the file or fix the path") from None
    if len(data) > MAX_FILE:
        raise ActionError(f"{flag} {path!r}: larger than {MAX_FILE} bytes")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        raise ActionError(f"{flag} {path!r}: not UTF-8 text") from None


def load_headers(path: str) -> dict[str, str]:
    """``Name: value`` lines (``#`` comments, blank lines skipped), e.g. a mounted Secret."""
    headers: dict[str, str] = {}
    for n, line in enumerate(_read(path, "--webhook-headers-file").splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        name, sep, value = line.partition(":")
        name, value = name.strip(), value.strip()
        if not sep or not _HEADER_NAME.match(name):
            # The line itself may be a secret: name the line number only.
            raise ActionError(f"--webhook-headers-file {path!r} line {n}: expected 'Name: value' "
                              "with a valid header name")
        if name.lower() in ("content-type", "content-length", "host"):
            raise ActionError(f"--webhook-headers-file {path!r} line {n}: {name} is set by spotguard")
        headers[name] = value
    return headers


def load_template(path: str) -> Any:
    """A JSON document; its strings may contain ``$field`` placeholders."""
    text = _read(path, "--webhook-template")
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ActionError(f"--webhook-template {path!r}: not JSON ({exc.msg} at line {exc.lineno})") from None
    _check_placeholders(doc, path)
    return doc


def _check_placeholders(doc: Any, path: str) -> None:
    known = set(_SAMPLE_FIELDS)
    for s in _strings(doc):
        for m in string.Template.pattern.finditer(s):
            name = m.group("named") or m.group("braced")
            if name and name not in known:
                raise ActionError(f"--webhook-template {path!r}: unknown placeholder ${name} "
                                  f"(known: {', '.join(sorted(known))})")


def _strings(doc: Any) -> list[str]:
    if isinstance(doc, str):
        return [doc]
    if isinstance(doc, dict):
        return [s for k, v in doc.items() for s in [*_strings(k), *_strings(v)]]
    if isinstance(doc, list):
        return [s for v in doc for s in _strings(v)]
    return []


_SAMPLE_FIELDS = ("id", "source", "kind", "deadline", "received_at", "detail", "node", "status", "reason", "step",
                  "uri", "subscribers", "done", "failed", "summary", "outcome_key")


def render(template: Any, fields: dict[str, Any]) -> Any:
    """Fill ``$name`` placeholders; a string that is one placeholder keeps the field's JSON type."""
    if isinstance(template, str):
        m = re.fullmatch(r"\$(?:(\w+)|\{(\w+)\})", template)
        if m:
            return fields.get(m.group(1) or m.group(2))
        text_fields = {k: "" if v is None else str(v) for k, v in fields.items()}
        return string.Template(template).safe_substitute(text_fields)
    if isinstance(template, dict):
        return {render(k, fields) if isinstance(k, str) else k: render(v, fields) for k, v in template.items()}
    if isinstance(template, list):
        return [render(v, fields) for v in template]
    return template


def default_payload(outcome: Outcome) -> dict[str, Any]:
    return {
        "notice": outcome.notice.to_wire(),
        "node": outcome.node,
        "outcome": {
            "status": outcome.status, "reason": outcome.reason, "step": outcome.step, "uri": outcome.uri,
            "late_seconds": outcome.late_seconds,
            "subscribers": [{"rank": s.rank, "job": s.job, "pod": s.pod, "namespace": s.namespace,
                             "state": s.state, "step": s.step, "error": (s.error or "")[:500] or None,
                             "seconds_past": s.seconds_past}
                            for s in outcome.subscribers],
        },
        "summary": outcome.summary(),
    }


def slack_payload(outcome: Outcome) -> dict[str, Any]:
    ok = outcome.status in ("committed", "no_subscribers") and outcome.late_seconds is None
    icon = ":white_check_mark:" if ok else ":warning:"
    return {"text": f"{icon} spotguard: {outcome.summary()} (notice {outcome.notice.id})"}


class WebhookAction(Action):
    """POST one JSON document per emergency notice, after its checkpoint outcome."""

    def __init__(self, url: str, *, name: str = "webhook", headers: Optional[dict[str, str]] = None,
                 template: Any = None, slack: bool = False, min_budget: float = MIN_BUDGET) -> None:
        self.name = name
        self.url = url
        self.headers = dict(headers or {})
        self.template = template
        self.slack = slack
        self.min_budget = min_budget
        self._session: Optional[aiohttp.ClientSession] = None
        parts = urlsplit(url)
        # Everything that may be secret, to scrub from any error text before it is logged.
        self._secrets = [s for s in (url, parts.path, parts.query, *self.headers.values()) if len(s) > 3]

    async def start(self) -> None:
        # trust_env: an outbound webhook may need HTTPS_PROXY (NO_PROXY honoured); the metadata
        # watchers keep their own proxy-free sessions.
        self._session = aiohttp.ClientSession(trust_env=True)

    def payload(self, outcome: Outcome) -> Any:
        if self.slack:
            return slack_payload(outcome)
        if self.template is not None:
            return render(self.template, outcome.fields())
        return default_payload(outcome)

    def _scrub(self, text: str) -> str:
        for s in sorted(self._secrets, key=len, reverse=True):
            text = text.replace(s, "***")
        return text[:300]

    async def on_outcome(self, outcome: Outcome) -> Optional[bool]:
        assert self._session is not None, "start() first"
        body = json.dumps(self.payload(outcome), separators=(",", ":"), default=str).encode()
        # Idempotency-Key names the notice *and* its outcome: a receiver that de-duplicates on it drops a
        # repeat of the same outcome (a re-send after a daemon restart), never a different one.
        headers = {**self.headers, "Content-Type": "application/json", "User-Agent": "spotguard",
                   "Idempotency-Key": f"spotguard-{outcome.key}"}
        budget = Deadline(outcome.notice.seconds_left(), minimum=self.min_budget)
        target = redact_url(self.url)
        attempt, delay = 0, 0.25
        while True:
            attempt += 1
            error: str
            try:
                async with self._session.post(self.url, data=body, headers=headers, allow_redirects=False,
                                              timeout=aiohttp.ClientTimeout(total=budget.timeout(REQUEST_TIMEOUT))) as resp:
                    await resp.read()
                    if 200 <= resp.status < 300:
                        log.info("webhook.sent", action=self.name, notice_id=outcome.notice.id, target=target,
                                 status=resp.status, attempts=attempt, outcome=outcome.status)
                        return True
                    error = f"HTTP {resp.status}"
                    if resp.status not in RETRY_STATUSES:
                        log.error("webhook.rejected", action=self.name, notice_id=outcome.notice.id, target=target,
                                  status=resp.status, attempts=attempt,
                                  fix="check the URL and the headers file (not retried: a 4xx will not heal)")
                        return False
            except asyncio.TimeoutError:
                error = "timed out"
            except aiohttp.ClientError as exc:
                error = f"{type(exc).__name__}: {self._scrub(str(exc))}"
            delay = min(delay * 2, 5.0) * random.uniform(0.8, 1.2)
            if budget.left() <= delay + 0.1:
                log.error("webhook.failed", action=self.name, notice_id=outcome.notice.id, target=target,
                          attempts=attempt, error=error, detail="gave up: the notice's deadline passed")
                return False
            log.warning("webhook.retrying", action=self.name, notice_id=outcome.notice.id, target=target,
                        attempt=attempt, error=error, in_seconds=round(delay, 3))
            await asyncio.sleep(delay)

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None
