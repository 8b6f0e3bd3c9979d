"""``torchft_lighthouse`` without ``import torchft``: the console script imports the package, whose
``__init__`` imports torch (~3 CPU-seconds before the Rust lighthouse binds; tests start six). This loads the
package's compiled ``_torchft`` module by itself and runs the same ``lighthouse_main`` with the same argv.
conftest.py writes it behind a ``#!`` line naming this interpreter (the extension is built for it)."""

import importlib.machinery
import importlib.util
import sys
from pathlib import Path


def _torchft_extension() -> object:
    package = importlib.util.find_spec("torchft")  # finds the package folder without running its __init__
    if package is None or package.origin is None:
        raise SystemExit("torchft is not installed")
    so = next(p for p in Path(package.origin).parent.iterdir()
              if p.name.startswith("_torchft.") and p.suffix in (".so", ".pyd"))
    loader = importlib.machinery.ExtensionFileLoader("torchft._torchft", str(so))
    spec = importlib.util.spec_from_file_location("torchft._torchft", so, loader=loader)
    assert spec is not None
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


if __name__ == "__main__":
    sys.argv[0] = "torchft_lighthouse"
    sys.exit(_torchft_extension().lighthouse_main())  # type: ignore[attr-defined]
