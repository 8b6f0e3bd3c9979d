"""Webhook and Slack actions against real HTTP servers on loopback (ok, failing, slow, hanging)."""

from __future__ import annotations

import asyncio
import json
import os
import time
from pathlib import Path

import pytest
import structlog

from spotguard.daemon.actions import Outcome
from spotguard.daemon.actions.webhook import WebhookAction, redact_url, render
from spotguard.daemon.app import StartupError
from spotguard.daemon.client import Subscription

from .conftest import FakeWatcher, make_notice, running_daemon
from .loopback import LoopbackServer, assert_notices_prompt

SECRET_TOKEN = "tok-5ecret-q"
SECRET_HEADER = "Bearer hdr-5ecret-v"


@pytest.fixture
def headers_file(tmp_path: Path) -> str:
    p = tmp_path / "headers"
    p.write_text(f"# from a Secret\nAuthorization: {SECRET_HEADER}\nX-Team: ml\n")
    return str(p)


@pytest.fixture
def template_file(tmp_path: Path) -> str:
    p = tmp_path / "template.json"
    p.write_text(json.dumps({"title": "spot $kind on $node", "step": "$step", "status": "$status",
                             "text": "$summary", "labels": {"notice": "$id"}}))
    return str(p)


async def test_generic_webhook_after_every_checkpoint_with_template_and_headers(
        sock_path: str, headers_file: str, template_file: str) -> None:
    async with LoopbackServer() as hook:
        w = FakeWatcher("aws")
        url = f"{hook.url}/notify?token={SECRET_TOKEN}"
        async with running_daemon(sock_path, [w], webhook_url=url, webhook_headers_file=headers_file,
                                  webhook_template=template_file) as d:
            a = await Subscription(sock_path, rank=0, job="llm").open()
            b = await Subscription(sock_path, rank=1, job="llm").open()
            await w.push(make_notice("aws-spot-1"))
            await a.next_notice(timeout=5)
            await b.next_notice(timeout=5)
            await a.checkpoint_done("aws-spot-1", step=42, uri="s3://b/run/step-00000042")
            await a.status()  # round trip: the report was processed
            await asyncio.sleep(0.2)
            assert hook.requests == [], "sent before every subscriber reported"
            await b.checkpoint_done("aws-spot-1", step=42)
            (req,) = await hook.wait_requests(1)
            assert req.method == "POST" and req.path == "/notify" and req.query == f"token={SECRET_TOKEN}"
            assert req.headers["Authorization"] == SECRET_HEADER and req.headers["X-Team"] == "ml"
            assert req.headers["Content-Type"] == "application/json"
            assert req.json() == {"title": "spot preemption on test-node", "step": 42, "status": "committed",
                                  "text": "spot notice (preemption, aws) on test-node: checkpoint committed at "
                                          "step 42, exiting", "labels": {"notice": "aws-spot-1"}}
            await asyncio.sleep(0.2)
            assert len(hook.requests) == 1, "one webhook per notice"
            await a.close()
            await b.close()
        assert d.metrics.actions.labels("webhook", "outcome", "ok")._value.get() == 1


async def test_default_payload_and_slack_on_failed_checkpoint(sock_path: str) -> None:
    async with LoopbackServer() as generic, LoopbackServer() as slack:
        w = FakeWatcher("gcp")
        async with running_daemon(sock_path, [w], webhook_url=generic.url, slack_webhook_url=slack.url + "/services/T/B/x"):
            a = await Subscription(sock_path, rank=0, job="llm", pod="train-0", namespace="ml").open()
            await w.push(make_notice("gcp-1", source="gcp", kind="termination"))
            await a.next_notice(timeout=5)
            await a.checkpoint_failed("gcp-1", "bucket said 403")
            (g,) = await generic.wait_requests(1)
            (s,) = await slack.wait_requests(1)
            body = g.json()
            assert body["notice"]["id"] == "gcp-1" and body["notice"]["kind"] == "termination"
            assert body["outcome"]["status"] == "failed" and body["node"] == "test-node"
            (sub,) = body["outcome"]["subscribers"]
            assert (sub["pod"], sub["namespace"], sub["state"], sub["error"]) == \
                ("train-0", "ml", "checkpoint_failed", "bucket said 403")
            text = s.json()["text"]
            assert set(s.json()) == {"text"} and "checkpoint FAILED (bucket said 403)" in text and "gcp-1" in text
            await a.close()


async def test_late_commit_is_never_a_plain_success_in_the_outcome(sock_path: str) -> None:
    """Issue 23: a checkpoint committed after the deadline reaches the webhook and Slack as LATE, with the
    seconds past, and the daemon's status keeps it per subscriber."""
    async with LoopbackServer() as generic, LoopbackServer() as slack:
        w = FakeWatcher("gcp")
        async with running_daemon(sock_path, [w], webhook_url=generic.url, slack_webhook_url=slack.url + "/services/T/B/x"):
            a = await Subscription(sock_path, rank=0, job="llm").open()
            await w.push(make_notice("gcp-late", source="gcp"))
            await a.next_notice(timeout=5)
            await a.checkpoint_done("gcp-late", step=7, uri="s3://b/run/step-00000007", seconds_past=1.6)
            (g,) = await generic.wait_requests(1)
            (s,) = await slack.wait_requests(1)
            body = g.json()
            assert body["outcome"]["status"] == "committed" and body["outcome"]["late_seconds"] == 1.6
            (sub,) = body["outcome"]["subscribers"]
            assert sub["seconds_past"] == 1.6
            assert "LATE, 1.6 s after the deadline" in s.json()["text"]
            (entry,) = (await a.status())["active_notices"]
            (rep,) = entry["subscribers"].values()
            assert rep["late"] is True and rep["seconds_past"] == 1.6
            await a.close()


@pytest.mark.serial
async def test_failing_server_is_retried_within_the_deadline_and_secrets_stay_out_of_logs(
        sock_path: str, headers_file: str) -> None:
    async with LoopbackServer(statuses=[503, 500, 200]) as hook:
        w = FakeWatcher("aws")
        with structlog.testing.capture_logs() as logs:
            async with running_daemon(sock_path, [w], webhook_url=f"{hook.url}/h/{SECRET_TOKEN}?k={SECRET_TOKEN}",
                                      webhook_headers_file=headers_file):
                a = await Subscription(sock_path).open()
                await w.push(make_notice("aws-2"))
                await a.next_notice(timeout=5)
                await a.checkpoint_done("aws-2", step=1)
                await hook.wait_requests(3)
                await a.close()
        # A refused connection (nothing listens) is retried too, and gives up at the deadline.
        with structlog.testing.capture_logs() as logs2:
            act = WebhookAction(f"http://127.0.0.1:9/{SECRET_TOKEN}?t={SECRET_TOKEN}",
                                headers={"Authorization": SECRET_HEADER}, min_budget=1.0)
            await act.start()
            t0 = time.monotonic()
            ok = await act.on_outcome(Outcome(make_notice("aws-3", in_seconds=0.5), "n", "deadline"))
            assert ok is False and time.monotonic() - t0 < 5
            await act.close()
    sent = [r for r in logs if r["event"] == "webhook.sent"]
    assert len(sent) == 1 and sent[0]["attempts"] == 3 and sent[0]["target"] == hook.url
    assert [r["error"] for r in logs if r["event"] == "webhook.retrying"] == ["HTTP 503", "HTTP 500"]
    assert any(r["event"] == "webhook.failed" for r in logs2)
    everything = repr(logs) + repr(logs2)
    assert SECRET_TOKEN not in everything and "hdr-5ecret" not in everything


async def test_a_4xx_is_not_retried(sock_path: str) -> None:
    async with LoopbackServer(statuses=[404]) as hook:
        w = FakeWatcher("aws")
        async with running_daemon(sock_path, [w], webhook_url=hook.url) as d:
            a = await Subscription(sock_path).open()
            await w.push(make_notice("aws-4"))
            await a.next_notice(timeout=5)
            await a.checkpoint_done("aws-4", step=1)
            await hook.wait_requests(1)
            await asyncio.sleep(0.6)
            assert len(hook.requests) == 1
            assert d.metrics.actions.labels("webhook", "outcome", "failed")._value.get() == 1
            await a.close()


async def test_slow_server_still_gets_it(sock_path: str) -> None:
    async with LoopbackServer(delay=1.5) as hook:
        w = FakeWatcher("aws")
        async with running_daemon(sock_path, [w], webhook_url=hook.url) as d:
            a = await Subscription(sock_path).open()
            await w.push(make_notice("aws-5"))
            await a.next_notice(timeout=5)
            await a.checkpoint_done("aws-5", step=3)
            await hook.wait_requests(1)
            for _ in range(100):
                if d.metrics.actions.labels("webhook", "outcome", "ok")._value.get() == 1:
                    break
                await asyncio.sleep(0.05)
            assert d.metrics.actions.labels("webhook", "outcome", "ok")._value.get() == 1
            await a.close()


@pytest.mark.serial
async def test_hanging_webhook_never_delays_notices(sock_path: str) -> None:
    """The action's server never answers: a second notice still reaches the trainers at once,
    and the daemon still stops within its bounded drain."""
    async with LoopbackServer(hang=True) as hook, LoopbackServer(hang=True) as slack:
        w = FakeWatcher("aws")
        t_stop = None
        async with running_daemon(sock_path, [w], webhook_url=hook.url, slack_webhook_url=slack.url):
            a = await Subscription(sock_path).open()
            await w.push(make_notice("aws-h1"))
            await a.next_notice(timeout=5)
            await a.checkpoint_done("aws-h1", step=1)
            await hook.wait_requests(1)
            await slack.wait_requests(1)  # both now hang
            await assert_notices_prompt(w.push, a, make_notice, "aws-hx")
            await a.close()
            t_stop = time.monotonic()
        assert time.monotonic() - t_stop < 9, "shutdown waited for a hanging webhook"


@pytest.mark.serial
async def test_deadline_decides_when_a_subscriber_never_reports(sock_path: str) -> None:
    async with LoopbackServer() as hook:
        w = FakeWatcher("aws")
        async with running_daemon(sock_path, [w], webhook_url=hook.url):
            a = await Subscription(sock_path).open()
            b = await Subscription(sock_path).open()
            t0 = time.monotonic()
            await w.push(make_notice("aws-d", in_seconds=2.5))
            await a.next_notice(timeout=5)
            await a.checkpoint_done("aws-d", step=5)
            (req,) = await hook.wait_requests(1, timeout=10)
            # decided 1 s (OUTCOME_MARGIN) before the 2.5 s deadline, not before
            assert 1.4 < time.monotonic() - t0 < 6
            out = req.json()["outcome"]
            assert out["status"] == "incomplete" and out["reason"] == "deadline" and out["step"] == 5
            await a.close()
            await b.close()


async def test_no_webhook_for_rebalance_or_without_flag(sock_path: str) -> None:
    async with LoopbackServer() as hook:
        w = FakeWatcher("aws")
        async with running_daemon(sock_path, [w], webhook_url=hook.url) as d:
            a = await Subscription(sock_path).open()
            await w.push(make_notice("aws-r", kind="rebalance"))
            await a.next_notice(timeout=5)
            await a.checkpoint_done("aws-r", step=5)
            await a.status()
            await asyncio.sleep(0.3)
            assert hook.requests == []
            await a.close()
        async with running_daemon(sock_path, [w]) as d:
            assert d.actions.actions == []


@pytest.mark.parametrize("content, needle", [("Authorization Bearer x", "line 1"), ("Content-Type: a/b", "set by")])
async def test_bad_headers_file_is_a_startup_error(sock_path: str, tmp_path: Path, content: str, needle: str) -> None:
    p = tmp_path / "h"
    p.write_text(content)
    with pytest.raises(StartupError, match=needle) as err:
        async with running_daemon(sock_path, [], webhook_url="http://127.0.0.1:1", webhook_headers_file=str(p)):
            pass
    assert "Bearer x" not in str(err.value)


async def test_bad_template_is_a_startup_error(sock_path: str, tmp_path: Path) -> None:
    p = tmp_path / "t.json"
    p.write_text('{"a": "$nope"}')
    with pytest.raises(StartupError, match=r"unknown placeholder \$nope"):
        async with running_daemon(sock_path, [], webhook_url="http://127.0.0.1:1", webhook_template=str(p)):
            pass
    with pytest.raises(StartupError, match="cannot read"):
        async with running_daemon(sock_path, [], webhook_url="http://127.0.0.1:1", webhook_template=str(p) + "x"):
            pass


def test_render_and_redact() -> None:
    assert render({"s": "$step", "t": "at ${step}!", "n": [1, "$missing"]}, {"step": 7}) == \
        {"s": 7, "t": "at 7!", "n": [1, None]}
    assert render("${__class__}", {}) == None  # noqa: E711 - data only: no attribute access
    assert redact_url("https://hooks.slack.com/services/T/B/secret?x=1") == "https://hooks.slack.com"
    assert redact_url("http://user:pw@127.0.0.1:8080/p") == "http://127.0.0.1:8080"
    assert os.environ.get("SPOTGUARD_WEBHOOK_URL") is None


async def test_no_subscriber_is_an_outcome_at_once_and_a_cancel_sends_nothing(sock_path: str) -> None:
    from spotguard.notice import Cancel

    async with LoopbackServer() as hook:
        w = FakeWatcher("aws")
        async with running_daemon(sock_path, [w], webhook_url=hook.url):
            await w.push(make_notice("aws-alone"))
            (req,) = await hook.wait_requests(1)
            assert req.json()["outcome"]["status"] == "no_subscribers"
            assert "no trainer subscribed on this node" in req.json()["summary"]
            a = await Subscription(sock_path).open()
            await w.push(make_notice("aws-sched", kind="termination", in_seconds=2.5))
            await a.next_notice(timeout=5)
            await w.push(Cancel(id="aws-sched", source="aws"))  # withdrawn before any report
            await asyncio.sleep(2.5)  # past the outcome's deadline timer: it was cancelled too
            assert len(hook.requests) == 1
            await a.close()
