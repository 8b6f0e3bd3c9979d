"""A fork server for the oracle's short version (``EXO_LAUNCHER=zygote``): torch imported once, every run forked.

Each pattern run is 1-2 processes whose CPU is mostly ``import torch`` and ``torch.distributed.checkpoint``
(~2-3 CPU-seconds each); the short version starts ~120 of them on 2 cores. Two more imports every run made
after its fork until these were imported here too: ``torch._dynamo`` (the first optimizer's ``__init__`` imports
it: ~1 CPU-s) and ``structlog`` (``spotguard.logs``; with ``rich``: ~0.3 CPU-s). This process imports those
modules once (never ``spotguard``: whatever ``spotguard`` the run finds on its ``PYTHONPATH`` is tested, as in
a fresh process) and forks a child per request; the child becomes what ``python SCRIPT`` would be: its own
session (``setsid``), the request's environment, working directory and argv, stdout/stderr to the log, stdin
from /dev/null; ``SystemExit`` and exceptions give the exit code an interpreter gives, then non-daemon threads
are joined and ``atexit`` runs, as at a normal interpreter exit. ``os._exit`` (the hook's exits) and signals
end it as they end any process.

What differs from a fresh process: the hash seed (``PYTHONHASHSEED``) is the server's, shared by every run
of a test session, and torch's import-time environment is the server's (``OMP_NUM_THREADS=1``, as the oracle
sets for every run). ``make exactness`` runs under real ``torchrun``.

``_zygote.py MODULE...`` also imports those modules first (the oracle keeps one server per framework a pattern
script imports: ``lightning.pytorch``, ``transformers``, ~3-4 CPU-seconds each, so that their import is not paid
by every run). What such an import reads from the environment the child reads again from its own
(``_AS_IF_IMPORTED_HERE``): lightning's ``rank_zero_only.rank`` and the variable it sets; ``transformers``'s
own reads (``HF_HUB_OFFLINE``, ``TRANSFORMERS_NO_ADVISORY_WARNINGS``) are set before it as its pattern does.

Protocol (JSON lines): stdin ``{"id", "argv", "env", "cwd", "log"}``; stdout ``{"id", "pid"}`` once forked,
``{"pid", "status"}`` when a child ends (``status``: the exit code, or -N for signal N). EOF on stdin: the
server kills what it started and leaves.
"""

from __future__ import annotations

import json
import os
import select
import signal
import sys

import numpy  # noqa: F401
import structlog  # noqa: F401 - spotguard.logs' (with rich, which structlog.dev imports when installed)
import torch  # noqa: F401
import torch._dynamo  # noqa: F401 - imported by every optimizer's __init__ (torch.optim's _disable_dynamo)
import torch.distributed  # noqa: F401
import torch.distributed.checkpoint  # noqa: F401
import torch.utils.data  # noqa: F401


def _lightning_env() -> None:
    """What ``import lightning`` derives from the environment, derived from the child's (a fresh import would)."""
    from lightning.fabric.utilities import rank_zero  # noqa: PLC0415

    rank_zero.rank_zero_only.rank = rank_zero._get_rank() or 0
    os.environ["PYTORCH_NVML_BASED_CUDA_CHECK"] = "1"  # lightning/fabric/__init__.py sets it at import


_AS_IF_IMPORTED_HERE = {"lightning.pytorch": _lightning_env}
_PRELOADED: list[str] = []


def _preload(modules: list[str]) -> None:
    """Import the framework modules every run of this server imports (``transformers``: its pattern's
    environment first, as ``patterns/hf_trainer.py`` sets it before the import)."""
    import importlib  # noqa: PLC0415

    for name in modules:
        if name == "transformers":
            os.environ.setdefault("HF_HUB_OFFLINE", "1")
            os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
        importlib.import_module(name)
        _PRELOADED.append(name)


def _child(req: dict) -> None:  # never returns
    code = 1
    try:
        os.setsid()
        null = os.open(os.devnull, os.O_RDONLY)
        out = os.open(req["log"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        os.dup2(null, 0)
        os.dup2(out, 1)
        os.dup2(out, 2)
        os.close(null)
        os.close(out)
        os.chdir(req["cwd"])
        os.environ.clear()
        os.environ.update(req["env"])
        for name in _PRELOADED:
            if name in _AS_IF_IMPORTED_HERE:
                _AS_IF_IMPORTED_HERE[name]()
        import io  # noqa: PLC0415
        import runpy  # noqa: PLC0415

        unbuffered = bool(req["env"].get("PYTHONUNBUFFERED"))
        sys.stdin = open(0, closefd=False)  # noqa: SIM115
        sys.stdout = io.TextIOWrapper(open(1, "wb", closefd=False), line_buffering=True, write_through=unbuffered)
        sys.stderr = io.TextIOWrapper(open(2, "wb", closefd=False), line_buffering=True, write_through=True,
                                      errors="backslashreplace")
        sys.argv = list(req["argv"])
        sys.path[0] = os.path.dirname(os.path.abspath(sys.argv[0]))
        try:
            runpy.run_path(sys.argv[0], run_name="__main__")
            code = 0
        except SystemExit as exc:
            if exc.code is None:
                code = 0
            elif isinstance(exc.code, int):
                code = exc.code
            else:
                print(exc.code, file=sys.stderr)
                code = 1
        except BaseException:  # noqa: BLE001 - what the interpreter prints for an uncaught exception
            import traceback  # noqa: PLC0415

            traceback.print_exc()
            code = 1
        import atexit  # noqa: PLC0415
        import threading  # noqa: PLC0415

        threading._shutdown()  # type: ignore[attr-defined]  # the interpreter joins non-daemon threads first
        atexit._run_exitfuncs()
        for f in (sys.stdout, sys.stderr):
            try:
                f.flush()
            except Exception:  # noqa: BLE001
                pass
    finally:
        os._exit(code & 0xFF if code >= 0 else 1)


def main() -> None:
    _preload(sys.argv[1:])
    inp = sys.stdin.buffer
    out = sys.stdout
    kids: set[int] = set()
    buf = b""
    eof = False
    while not eof or kids:
        if not eof:
            ready, _, _ = select.select([inp], [], [], 0.02)
            if ready:
                chunk = os.read(inp.fileno(), 65536)
                if not chunk:
                    eof = True
                    for pid in kids:  # the oracle is gone: nothing it started may outlive it
                        try:
                            os.killpg(pid, signal.SIGKILL)
                        except OSError:
                            pass
                buf += chunk
                while b"\n" in buf:
                    line, buf = buf.split(b"\n", 1)
                    req = json.loads(line)
                    out.flush()
                    pid = os.fork()
                    if pid == 0:
                        _child(req)
                    kids.add(pid)
                    out.write(json.dumps({"id": req["id"], "pid": pid}) + "\n")
                    out.flush()
        else:
            select.select([], [], [], 0.02)
        while kids:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                kids.clear()
                break
            if pid == 0:
                break
            kids.discard(pid)
            code = os.waitstatus_to_exitcode(status)
            out.write(json.dumps({"pid": pid, "status": code}) + "\n")
            out.flush()


if __name__ == "__main__":
    main()
