"""The docs point only at files that are in the repository (issue 18 item 12)."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
# Paths named in backticks or links: a known top-level folder, then a file name with an extension.
PATH = re.compile(r"(?:`|\]\()((?:\.\./)?(?:docs|examples|spotguard|tests|deploy|systemd|benchmarks)/[\w./-]+\.\w+)")


def test_docs_name_only_files_in_the_repository() -> None:
    missing = []
    for doc in DOCS:
        for rel in PATH.findall(doc.read_text()):
            base = doc.parent if rel.startswith("..") or doc.parent.name == "docs" and not rel.startswith(
                ("docs/", "examples/", "spotguard/", "tests/", "deploy/", "systemd/", "benchmarks/")) else REPO
            if rel.startswith("benchmarks/results/"):
                continue  # written by the benchmarks when run
            if not (base / rel).exists():
                missing.append(f"{doc.relative_to(REPO)}: {rel}")
    assert not missing, missing


def test_no_reference_to_files_outside_the_repository() -> None:
    outside = re.compile(r"SPEC\.md|CLOUD_FACTS|PITFALLS|\.\./shared")
    hits = []
    for path in [*DOCS, *REPO.joinpath("spotguard").rglob("*.py"), *REPO.joinpath("examples").glob("*.py"),
                 *REPO.joinpath("deploy").rglob("*.yaml")]:
        for n, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            if outside.search(line):
                hits.append(f"{path.relative_to(REPO)}:{n}: {line.strip()}")
    assert not hits, hits
