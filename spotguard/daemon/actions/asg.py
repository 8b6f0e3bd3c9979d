"""AWS Auto Scaling lifecycle hook: hold ``Terminating:Wait`` until the checkpoint is safe.

The twin of the Azure approval (``--azure-ack-after-checkpoint``). When a
terminating lifecycle hook holds an instance, IMDS's ``target-lifecycle-state``
reads ``Terminated`` and the AWS watcher yields a ``termination`` notice. Then:

* at the notice: ``DescribeAutoScalingInstances`` (instance id and region from the
  identity document) gives the group; the hook is the one named by
  ``--asg-lifecycle-hook`` or, with ``auto``, every ``autoscaling:EC2_INSTANCE_TERMINATING``
  hook of the group whose name starts with ``spotguard`` (``AUTO_PREFIX``; e.g.
  ``spotguard-drain``) — never a hook another tool owns (a log shipper's, a drainer's):
  heartbeating or completing it would cut that tool's own work short;
  ``RecordLifecycleActionHeartbeat`` now and every third of the hook's ``HeartbeatTimeout``
  while the checkpoint runs;
* the deadline: the watcher's notice says 120 s, but a held hook keeps the instance for
  ``HeartbeatTimeout`` after each heartbeat, up to the hook's ``GlobalTimeout`` (AWS:
  ``min(100 × HeartbeatTimeout, 172800 s)``) after the wait began. So each good heartbeat
  moves the outcome's deadline to ``min(now + HeartbeatTimeout, start + GlobalTimeout)``
  (``Action.extend``): a checkpoint longer than 119 s keeps heartbeating and still ends
  in ``CompleteLifecycleAction``;
* at the outcome: every subscriber committed (or none was subscribed) →
  ``CompleteLifecycleAction`` with ``CONTINUE``, and the instance terminates now
  instead of at the timeout. A failed or missing checkpoint completes nothing: the
  heartbeats stop and the hook's own timeout applies its ``DefaultResult``, as the
  Azure event is left to start at its ``NotBefore``.

boto3 is synchronous: every call runs in the action's own threads, never on the event loop.
The endpoint honours ``AWS_ENDPOINT_URL`` / ``AWS_ENDPOINT_URL_AUTO_SCALING`` (boto3 itself).
IAM: ``autoscaling:DescribeAutoScalingInstances``, ``autoscaling:DescribeLifecycleHooks``,
``autoscaling:RecordLifecycleActionHeartbeat``, ``autoscaling:CompleteLifecycleAction``.
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
from dataclasses import dataclass
from typing import Any, Optional

from ...logs import get_logger
from ...notice import Notice
from ...timefmt import utcnow
from ..book import Entry
from . import Action, ActionError, Outcome

__all__ = ["AsgLifecycleAction", "is_asg_notice"]

log = get_logger("spotguard.actions.asg")

TERMINATING = "autoscaling:EC2_INSTANCE_TERMINATING"
#: ``--asg-lifecycle-hook auto`` acts only on the group's terminating hooks whose name starts with this.
AUTO_PREFIX = "spotguard"
#: AWS's ceiling on a lifecycle action's total wait (48 h), and GlobalTimeout = min(100 x HeartbeatTimeout, it).
MAX_GLOBAL_TIMEOUT = 172800
IDENTITY_WAIT = 10.0  # seconds on_notice waits for the AWS watcher's identity document (after a restart)
HEARTBEAT_CAP = 300.0  # seconds: the longest gap between heartbeats, whatever the hook's timeout
IAM_FIX = ("allow autoscaling:DescribeAutoScalingInstances, DescribeLifecycleHooks, RecordLifecycleActionHeartbeat "
           "and CompleteLifecycleAction in the instance profile (docs/deploy.md)")


def is_asg_notice(notice: Notice) -> bool:
    """The AWS watcher's notice for ``target-lifecycle-state`` = ``Terminated``."""
    return (notice.source == "aws" and notice.kind == "termination"
            and (notice.key.startswith("asg|") or notice.detail.startswith("target-lifecycle-state=")))


@dataclass
class _Target:
    instance_id: str
    group: str
    hooks: list[tuple[str, int]]  # (name, HeartbeatTimeout seconds)
    global_timeout: int = MAX_GLOBAL_TIMEOUT  # the smallest of the hooks' GlobalTimeout


def global_timeout(hook: dict[str, Any]) -> int:
    """The hook's ``GlobalTimeout``, never above AWS's rule ``min(100 x HeartbeatTimeout, 172800)``."""
    heartbeat = int(hook.get("HeartbeatTimeout") or 3600)
    rule = min(100 * heartbeat, MAX_GLOBAL_TIMEOUT)
    given = hook.get("GlobalTimeout")
    return min(int(given), rule) if isinstance(given, int) and given > 0 else rule


class AsgLifecycleAction(Action):
    name = "asg"
    holds = True

    def __init__(self, hook_name: Optional[str] = None, *, heartbeat_cap: Optional[float] = None) -> None:
        self.hook_name = hook_name
        self.heartbeat_cap = HEARTBEAT_CAP if heartbeat_cap is None else heartbeat_cap
        self._boto3: Any = None
        self._config: Any = None
        self._client: Any = None
        self._targets: dict[str, asyncio.Future[Optional[_Target]]] = {}
        self._heartbeats: dict[str, asyncio.Task[None]] = {}

    @staticmethod
    async def _run(fn: Any, *args: Any, **kw: Any) -> Any:
        """``fn`` in a daemon thread of its own: a hung AWS call can hold neither the loop nor the
        daemon's exit (an executor's threads are joined at interpreter exit; these are not)."""
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[Any] = loop.create_future()

        def settle(ok: bool, value: Any) -> None:
            if not fut.done():
                fut.set_result(value) if ok else fut.set_exception(value)

        def work() -> None:
            try:
                result, ok = fn(*args, **kw), True
            except BaseException as exc:  # handed to the awaiting task
                result, ok = exc, False
            try:
                loop.call_soon_threadsafe(settle, ok, result)
            except RuntimeError:  # the loop is gone: the daemon stopped meanwhile
                pass

        threading.Thread(target=work, name="spotguard-asg", daemon=True).start()
        return await fut

    def wants(self, notice: Notice) -> bool:
        return is_asg_notice(notice)

    async def start(self) -> None:
        try:
            import boto3
            from botocore.config import Config
        except ImportError:
            raise ActionError("--asg-lifecycle-hook needs boto3: pip install 'spotguard[aws]' (the spotguard image "
                              "has it)") from None
        self._boto3 = boto3
        self._config = Config(connect_timeout=3, read_timeout=5, retries={"mode": "standard", "max_attempts": 3})
        await self._run(self._preload)

    def _preload(self) -> None:
        """Build a client now: botocore loads the service model and endpoint data (~11 MB) at start, not at
        the notice, when the memory limit matters most. No network call; the client of the notice's own
        region reuses the loaded data (the default session's loader caches it)."""
        region = os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION") or "us-east-1"
        self._boto3.client("autoscaling", region_name=region, config=self._config)

    def _autoscaling(self, region: Optional[str]) -> Any:
        if self._client is None:
            region = region or os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION")
            self._client = self._boto3.client("autoscaling", region_name=region, config=self._config)
        return self._client

    # --- the notice ------------------------------------------------------------------

    async def on_notice(self, entry: Entry, node: str) -> Optional[bool]:
        notice = entry.notice
        fut: asyncio.Future[Optional[_Target]] = asyncio.get_running_loop().create_future()
        self._targets[notice.id] = fut
        identity = await self._identity(entry)
        instance_id = identity.get("instanceId") or (node if node.startswith("i-") else "")
        if not instance_id:
            log.error("asg.no_instance_id", notice_id=notice.id,
                      fix="the AWS watcher could not read the identity document; check IMDS access")
            fut.set_result(None)
            return False
        try:
            target = await self._run(self._resolve, instance_id, identity.get("region"))
        except Exception as exc:
            target = None
            self._log_error("asg.resolve_failed", notice.id, exc)
        fut.set_result(target)
        if target is None:
            return False
        log.info("asg.holding", notice_id=notice.id, instance_id=target.instance_id, group=target.group,
                 hooks=[h for h, _ in target.hooks])
        first = asyncio.get_running_loop().create_future()
        self._heartbeats[notice.id] = asyncio.create_task(self._heartbeat(notice, target, first))
        return await first

    @staticmethod
    async def _identity(entry: Entry, wait: float = IDENTITY_WAIT) -> dict[str, Any]:
        """The watcher's identity document. Just after a daemon restart the restored notice comes with the
        first poll, before the watcher read the document (notices first): wait for it, briefly."""
        end = time.monotonic() + max(0.0, min(wait, entry.notice.seconds_left() - 5.0))
        while True:
            identity = getattr(entry.watcher, "identity", None) or {}
            if identity.get("instanceId") or time.monotonic() >= end:
                return identity
            await asyncio.sleep(0.1)

    def _resolve(self, instance_id: str, region: Optional[str]) -> Optional[_Target]:
        asg = self._autoscaling(region)
        found = asg.describe_auto_scaling_instances(InstanceIds=[instance_id]).get("AutoScalingInstances", [])
        if not found:
            log.error("asg.not_in_group", instance_id=instance_id,
                      detail="DescribeAutoScalingInstances does not list this instance")
            return None
        group = found[0]["AutoScalingGroupName"]
        kw: dict[str, Any] = {"AutoScalingGroupName": group}
        if self.hook_name:
            kw["LifecycleHookNames"] = [self.hook_name]
        found_hooks = [h for h in asg.describe_lifecycle_hooks(**kw).get("LifecycleHooks", [])
                       if h.get("LifecycleTransition") == TERMINATING]
        if not self.hook_name:
            others = [h["LifecycleHookName"] for h in found_hooks
                      if not str(h.get("LifecycleHookName", "")).startswith(AUTO_PREFIX)]
            found_hooks = [h for h in found_hooks if str(h.get("LifecycleHookName", "")).startswith(AUTO_PREFIX)]
            if others:
                log.info("asg.hooks_left_alone", group=group, hooks=others[:16],
                         detail=f"--asg-lifecycle-hook auto acts only on hooks named {AUTO_PREFIX}*; "
                                "these belong to other tools")
        hooks = [(h["LifecycleHookName"], int(h.get("HeartbeatTimeout") or 3600)) for h in found_hooks]
        if not hooks and not self.hook_name:
            log.error("asg.no_hook", group=group, hook="auto",
                      fix=f"name spotguard's terminating lifecycle hook on {group} '{AUTO_PREFIX}...' (auto acts "
                          f"only on those) or pass its name: --asg-lifecycle-hook NAME")
            return None
        if not hooks:
            log.error("asg.no_hook", group=group, hook=self.hook_name or "auto",
                      fix=f"create a terminating lifecycle hook on {group} (aws autoscaling put-lifecycle-hook "
                          f"--lifecycle-transition {TERMINATING} ...) or fix --asg-lifecycle-hook")
            return None
        return _Target(instance_id, group, hooks, min(global_timeout(h) for h in found_hooks))

    async def _heartbeat(self, notice: Notice, target: _Target, first: asyncio.Future[bool]) -> None:
        timeout = min(t for _, t in target.hooks)
        interval = max(0.2, min(self.heartbeat_cap, timeout / 3))
        # The wait began when the instance entered Terminating:Wait, about when the notice was first seen.
        global_end = time.monotonic() - max(0.0, (utcnow() - notice.received_at).total_seconds()) + \
            target.global_timeout
        beats = 0
        while True:
            ok = True
            for hook, _ in target.hooks:
                try:
                    await self._run(self._autoscaling(None).record_lifecycle_action_heartbeat,
                                            LifecycleHookName=hook, AutoScalingGroupName=target.group,
                                            InstanceId=target.instance_id)
                    log.info("asg.heartbeat", notice_id=notice.id, hook=hook, group=target.group)
                except Exception as exc:
                    ok = False
                    self._log_error("asg.heartbeat_failed", notice.id, exc)
            if ok:
                beats += 1
                self.note(notice.id, heartbeats=beats, hooks=",".join(h for h, _ in target.hooks))
                # Held for HeartbeatTimeout from now, never past the global timeout: the outcome may wait that long.
                self.extend(notice.id, min(float(timeout), global_end - time.monotonic()))
            if not first.done():
                first.set_result(ok)
            await asyncio.sleep(interval)

    def _stop_heartbeat(self, notice_id: str) -> None:
        task = self._heartbeats.pop(notice_id, None)
        if task is not None:
            task.cancel()

    def cancelled(self, notice_id: str) -> None:
        self._stop_heartbeat(notice_id)

    # --- the outcome -----------------------------------------------------------------

    async def on_outcome(self, outcome: Outcome) -> Optional[bool]:
        notice = outcome.notice
        fut = self._targets.pop(notice.id, None)
        target = await fut if fut is not None else None
        self._stop_heartbeat(notice.id)
        if target is None:
            return None if fut is None else False
        if outcome.status not in ("committed", "no_subscribers"):
            log.warning("asg.not_completing", notice_id=notice.id, status=outcome.status, group=target.group,
                        detail="the checkpoint is not safe: heartbeats stop and the hook's timeout applies its "
                               "DefaultResult")
            return None
        ok = True
        for hook, _ in target.hooks:
            try:
                await self._run(self._autoscaling(None).complete_lifecycle_action,
                                        LifecycleHookName=hook, AutoScalingGroupName=target.group,
                                        InstanceId=target.instance_id, LifecycleActionResult="CONTINUE")
                log.info("asg.completed", notice_id=notice.id, hook=hook, group=target.group, result="CONTINUE",
                         status=outcome.status)
            except Exception as exc:
                ok = False
                self._log_error("asg.complete_failed", notice.id, exc)
        return ok

    @staticmethod
    def _log_error(event: str, notice_id: str, exc: Exception) -> None:
        code = getattr(exc, "response", {}).get("Error", {}).get("Code", "") if hasattr(exc, "response") else ""
        fix = IAM_FIX if code in ("AccessDenied", "AccessDeniedException", "UnauthorizedOperation") else None
        log.error(event, notice_id=notice_id, error=f"{type(exc).__name__}: {str(exc)[:300]}", code=code or None,
                  fix=fix)

    async def close(self) -> None:
        for notice_id in list(self._heartbeats):
            self._stop_heartbeat(notice_id)
