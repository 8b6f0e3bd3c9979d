"""``python -m spotguard.torchft.worker`` for a replica group forked by the test fork server (conftest.py):
the server runs a script, and the worker module's relative imports need it imported as a package module."""

import sys

from spotguard.torchft.worker import main

if __name__ == "__main__":
    sys.exit(main())
