"""``docs/api.md`` names every public argument and member of the Python API (issue 18 item 12)."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

from spotguard.data import ElasticDistributedSampler
from spotguard.hook import Hook, Preempted, install_preemption_hook, parse_every
from spotguard.storage import Storage, check_uri, open_storage

DOC = Path(__file__).resolve().parents[2] / "docs" / "api.md"


def _mentions(name: str, doc: str) -> bool:
    return re.search(rf"\b{re.escape(name)}\b", doc) is not None


def test_every_public_argument_is_documented() -> None:
    doc = DOC.read_text()
    missing = []
    for fn in (install_preemption_hook, Hook.__init__, ElasticDistributedSampler.__init__, open_storage,
               parse_every, check_uri, Hook.range, Hook.notify):
        for name in inspect.signature(fn).parameters:
            if name not in ("self", "args", "kwargs") and not _mentions(f"{name}", doc):
                missing.append(f"{fn.__qualname__}({name})")
    assert not missing, f"docs/api.md does not mention: {missing}"


def test_every_public_member_is_documented() -> None:
    doc = DOC.read_text()
    members = [m for m in dir(Hook) if not m.startswith("_")]
    members += [m for m in ("set_epoch", "attach", "state_dict", "load_state_dict") if hasattr(ElasticDistributedSampler, m)]
    members += [m for m in dir(Storage) if not m.startswith("_")]
    members += ["code", "notice_id", "step", "uri", "committed"]
    missing = [m for m in members if not _mentions(m, doc)]
    assert not missing, f"docs/api.md does not mention: {missing}"
    p = Preempted(143, notice_id="n", step=1, uri="u", committed=True)
    assert (p.code, p.notice_id, p.step, p.uri, p.committed) == (143, "n", 1, "u", True)


def test_api_doc_exit_codes_match_the_code() -> None:
    from spotguard.hook.core import EXIT_SAVE_FAILED

    doc = DOC.read_text()
    assert f"| {EXIT_SAVE_FAILED} |" in doc and "| 143 (`exit_code=`) |" in doc
    assert "Default `None` keeps **every** checkpoint" in doc
