"""``spotguard demo``: the plain story (``plain.py``) and, with ``--engine torchft``, the replica-group one
(``torchft.py``). The CLI imports this package and calls ``add_arguments`` / ``main``."""

from __future__ import annotations

from .plain import add_arguments, main

__all__ = ["add_arguments", "main"]
