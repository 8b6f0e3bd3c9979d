"""The ``spotguard`` command: one entry point, one module per subcommand.

Each subcommand module exposes ``add_arguments(parser)`` and ``main(args) -> int``
and is imported only when chosen, so ``spotguard daemon`` never imports torch.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from typing import Optional, Sequence

__all__ = ["main", "build_parser"]

# name -> (module, help)
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "daemon": ("spotguard.daemon.app", "run the notice daemon in the foreground"),
    "emulate": ("spotguard.emulator.server", "run a local AWS/GCP/Azure metadata emulator"),
    "drill": ("spotguard.daemon.client", "ask a running daemon to send a synthetic notice"),
    "status": ("spotguard.daemon.client", "print a running daemon's state"),
    "demo": ("spotguard.demo", "the whole story on one machine"),
    "checkpoints": ("spotguard.storage.listing", "list checkpoints under a storage URI"),
    "wait-checkpoint": ("spotguard.daemon.waitckpt",
                        "block until every local trainer reported its checkpoint for the active notice"),
}

EXIT_USAGE = 2


def build_parser(command: Optional[str] = None) -> argparse.ArgumentParser:
    """Only the chosen subcommand's module is imported: one broken module cannot break the others."""
    from . import __version__

    parser = argparse.ArgumentParser(prog="spotguard", description="Turn spot/preemptible VM termination notices into a committed checkpoint and a clean exit.")
    parser.add_argument("--version", action="version", version=f"spotguard {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for name, (module, help_text) in SUBCOMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        p.set_defaults(_module=module, _name=name)
        if name == command:
            mod = importlib.import_module(module)
            adder = getattr(mod, f"add_{name}_arguments", None) or mod.add_arguments
            adder(p)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    command = next((a for a in argv if not a.startswith("-")), None)
    parser = build_parser(command if command in SUBCOMMANDS else None)
    args = parser.parse_args(argv)
    mod = importlib.import_module(args._module)
    runner = getattr(mod, f"{args._name}_main", None) or mod.main
    try:
        return int(runner(args) or 0)
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
