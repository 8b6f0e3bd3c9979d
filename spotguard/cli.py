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
}

EXIT_USAGE = 2


def build_parser() -> argparse.ArgumentParser:
    from . import __version__

    parser = argparse.ArgumentParser(prog="spotguard", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"spotguard {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for name, (module, help_text) in SUBCOMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        mod = importlib.import_module(module)
        adder = getattr(mod, f"add_{name}_arguments", None) or mod.add_arguments
        adder(p)
        p.set_defaults(_module=module, _name=name)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    # Build only the chosen subcommand's parser eagerly-enough: importing every
    # module for --help is fine (none of them imports torch at module level).
    parser = build_parser()
    args = parser.parse_args(argv)
    mod = importlib.import_module(args._module)
    runner = getattr(mod, f"{args._name}_main", None) or mod.main
    try:
        return int(runner(args) or 0)
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
