"""moto's server (``moto.server.main``) with the two Auto Scaling lifecycle calls moto 5.2.5 lacks.

moto implements DescribeAutoScalingInstances / PutLifecycleHook / DescribeLifecycleHooks
but not CompleteLifecycleAction or RecordLifecycleActionHeartbeat (it answers them with
an error). They are added here as AWS documents them: both need an existing hook on the
group and an instance of that group, else ``ValidationError`` (400); the result must be
``CONTINUE`` or ``ABANDON``; completing a terminating action moves the instance to
``Terminating:Proceed``; ``GlobalTimeout`` follows AWS's rule min(100 x HeartbeatTimeout, 172800). Every call is appended as a JSON line to ``$MOTO_ASG_LOG`` for
the tests to read. ``$MOTO_FIRST_INSTANCE_ID`` fixes the first instance id (the
emulator's identity document names ``i-0123456789abcdef0``), again after each ``POST /moto-api/reset`` (one
server serves many tests: ``test_actions_asg.moto``).

    python tests/daemon/moto_asg.py -H 127.0.0.1 -p PORT
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any


def _patch() -> None:
    from moto.autoscaling.exceptions import ValidationError
    from moto.autoscaling.responses import AutoScalingResponse
    from moto.core.responses import EmptyResult

    def _record(self: Any, action: str) -> Any:
        backend = self.autoscaling_backend
        group_name = self._get_param("AutoScalingGroupName")
        hook = self._get_param("LifecycleHookName")
        instance_id = self._get_param("InstanceId")
        entry = {"action": action, "group": group_name, "hook": hook, "instance": instance_id, "t": time.time(),
                 "result": self._get_param("LifecycleActionResult")}
        if f"{group_name}_{hook}" not in backend.lifecycle_hooks:
            raise ValidationError(f"No Lifecycle Hook found with name {hook} for group {group_name}")
        group = backend.autoscaling_groups.get(group_name)
        states = [s for s in (group.instance_states if group else []) if s.instance.id == instance_id]
        if not states:
            raise ValidationError(f"No active Lifecycle Action found with instance ID {instance_id}")
        if action == "CompleteLifecycleAction":
            if entry["result"] not in ("CONTINUE", "ABANDON"):
                raise ValidationError("LifecycleActionResult must be CONTINUE or ABANDON")
            states[0].lifecycle_state = "Terminating:Proceed"
        path = os.environ.get("MOTO_ASG_LOG")
        if path:
            with open(path, "a") as f:
                f.write(json.dumps(entry) + "\n")
        return EmptyResult()

    AutoScalingResponse.complete_lifecycle_action = lambda self: _record(self, "CompleteLifecycleAction")
    AutoScalingResponse.record_lifecycle_action_heartbeat = lambda self: _record(self, "RecordLifecycleActionHeartbeat")

    # AWS: GlobalTimeout = min(100 x HeartbeatTimeout, 172800) (moto hard-codes 172800).
    from moto.autoscaling.models import LifecycleHook

    original_init = LifecycleHook.__init__

    def init(self: Any, *a: Any, **kw: Any) -> None:
        original_init(self, *a, **kw)
        self.global_timeout = min(100 * int(self.heartbeat_timeout), 172800)

    LifecycleHook.__init__ = init

    first = os.environ.get("MOTO_FIRST_INSTANCE_ID")
    if first:
        import moto.ec2.models.instances as instances
        from moto.moto_api._internal.models import MotoAPIBackend

        original = instances.random_instance_id
        pending = [first]
        instances.random_instance_id = lambda: pending.pop() if pending else original()

        original_reset = MotoAPIBackend.reset

        def reset(self: Any) -> None:  # POST /moto-api/reset: a fresh account, the first instance id again
            original_reset(self)
            pending[:] = [first]

        MotoAPIBackend.reset = reset


if __name__ == "__main__":
    _patch()
    from moto.server import main

    sys.exit(main(sys.argv[1:]))
