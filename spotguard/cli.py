"""The ``spotguard`` command: one entry point, one module per subcommand.

Each subcommand module exposes ``add_arguments(parser)`` and ``main(args) -> int``
and is imported only when chosen, so ``spotguard daemon`` never imports torch.
"""

from __future__ import annotations

import argparse
import difflib
import importlib
import os
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
    "report": ("spotguard.report.cli", "what spot cost a job: goodput, preemptions, downtime, money (history/)"),
    "wait-checkpoint": ("spotguard.daemon.waitckpt",
                        "block until every local trainer reported its checkpoint for the active notice"),
}

EXIT_USAGE = 2


def build_parser(command: Optional[str] = None) -> argparse.ArgumentParser:
    """Only the chosen subcommand's module is imported: one broken module cannot break the others."""
    from .version import __version__

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


def _unknown_options(parser: argparse.ArgumentParser, name: str, extras: list[str]) -> str:
    """One line naming each unknown option, the closest real one, and where the list is."""
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices[name]
    known = [o for a in sub._actions for o in a.option_strings]
    parts = []
    after_unknown = False
    for arg in extras:
        flag = arg.split("=", 1)[0]
        if not flag.startswith("-"):
            if not after_unknown:  # else: the value of the unknown option before it
                parts.append(f"unexpected argument {arg!r}")
            after_unknown = False
            continue
        after_unknown = "=" not in arg
        near = difflib.get_close_matches(flag, known, n=1, cutoff=0.6)
        parts.append(f"unknown option {flag}" + (f" (did you mean {near[0]}?)" if near else ""))
    return f"spotguard {name}: error: {'; '.join(parts)}; `spotguard {name} --help` lists the options"


def _quiet_broken_pipe() -> int:
    """stdout's reader went away (``spotguard status | grep -q active``): no traceback, exit 141 like `cat`."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())  # the interpreter's final flush must not raise again
    except (OSError, ValueError):
        pass
    return 141  # 128 + SIGPIPE


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["status"] and "--live" in argv:  # the liveness probe: stdlib only, no argparse (live.py)
        from .live import main as live_main

        return live_main(argv)
    command = next((a for a in argv if not a.startswith("-")), None)
    parser = build_parser(command if command in SUBCOMMANDS else None)
    try:
        args, extras = parser.parse_known_args(argv)
        if extras:
            print(_unknown_options(parser, args._name, extras), file=sys.stderr)
            return EXIT_USAGE
        mod = importlib.import_module(args._module)
        runner = getattr(mod, f"{args._name}_main", None) or mod.main
        code = int(runner(args) or 0)
        if sys.stdout is not None:  # None when the process was started with fd 1 closed (a daemon's log stream)
            sys.stdout.flush()
        return code
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        return _quiet_broken_pipe()


if __name__ == "__main__":
    sys.exit(main())
