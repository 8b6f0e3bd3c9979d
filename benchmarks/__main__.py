"""Run every benchmark module (``python -m benchmarks [name ...]``) and collect the results."""

from __future__ import annotations

import importlib
import json
import pkgutil
import sys
import time
from pathlib import Path

import benchmarks

# Long benchmarks run only when named (``python -m benchmarks time_to_safe``; ~35-40 min each).
ON_REQUEST = ("time_to_safe", "deepspeed_time_to_safe")


def main(argv: list[str]) -> int:
    names = sorted(m.name for m in pkgutil.iter_modules(benchmarks.__path__) if m.name.startswith("bench_"))
    chosen = [n for n in names if not argv or any(a in n for a in argv)]
    chosen += [n for n in ON_REQUEST if n in argv]  # by exact name: "time_to_safe" is in both names
    out_dir = Path(__file__).parent / "results"
    out_dir.mkdir(exist_ok=True)
    failed = 0
    for name in chosen:
        print(f"=== {name}", flush=True)
        t0 = time.monotonic()
        try:
            result = importlib.import_module(f"benchmarks.{name}").run()
        except Exception as exc:  # one broken benchmark must not hide the others' figures
            print(f"{name} FAILED: {exc!r}", flush=True)
            failed += 1
            continue
        result["_wall_seconds"] = round(time.monotonic() - t0, 1)
        (out_dir / f"{name}.json").write_text(json.dumps(result, indent=2) + "\n")
        print(json.dumps(result, indent=2), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
