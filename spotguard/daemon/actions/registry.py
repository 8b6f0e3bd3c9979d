"""Which actions the configuration turns on; a bad setting is an ``ActionError`` (exit 2)."""

from __future__ import annotations

from typing import Any

from . import Action, ActionError

__all__ = ["build_actions"]


def build_actions(cfg: Any) -> list[Action]:
    """The actions ``cfg`` (a ``DaemonConfig``) asks for, in the order they run; none by default."""
    actions: list[Action] = []
    if cfg.webhook_url:
        from .webhook import WebhookAction, load_headers, load_template

        headers = load_headers(cfg.webhook_headers_file) if cfg.webhook_headers_file else {}
        template = load_template(cfg.webhook_template) if cfg.webhook_template else None
        actions.append(WebhookAction(cfg.webhook_url, headers=headers, template=template))
    elif cfg.webhook_headers_file or cfg.webhook_template:
        raise ActionError("--webhook-headers-file / --webhook-template need --webhook-url (SPOTGUARD_WEBHOOK_URL)")
    if cfg.slack_webhook_url:
        from .webhook import WebhookAction

        actions.append(WebhookAction(cfg.slack_webhook_url, name="slack", slack=True))
    if cfg.kubernetes_node_actions:
        if not cfg.node:
            raise ActionError("--kubernetes-node-actions needs the node's name: set --node / SPOTGUARD_NODE from "
                              "the downward API (fieldRef: spec.nodeName)")
        from .kubernetes import KubernetesAction

        actions.append(KubernetesAction(cfg.node))
    if cfg.asg_lifecycle_hook:
        from .asg import AsgLifecycleAction

        actions.append(AsgLifecycleAction(None if cfg.asg_lifecycle_hook == "auto" else cfg.asg_lifecycle_hook))
    return actions
