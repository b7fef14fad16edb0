"""Every link in README.md, docs/*.md and bench/*.md resolves inside the repository.

A user's clone has only the repository: a link to a file outside it (such as a sibling
directory of the checkout) or to a missing file, or to a heading that does not exist in the
linked Markdown file, is a dead link; and the project's documents carry what a user needs
themselves, so no link leaves the repository (a web address is not a link).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = [
    ROOT / "README.md",
    *sorted((ROOT / "docs").glob("*.md")),
    *sorted((ROOT / "bench").glob("*.md")),
]
_LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
_FENCE = re.compile(r"^```.*?^```", re.S | re.M)


def _slugs(md: Path) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces to hyphens."""
    out: set[str] = set()
    for line in _FENCE.sub("", md.read_text()).splitlines():
        m = re.match(r"#{1,6}\s+(.*?)\s*#*$", line)
        if m:
            text = re.sub(r"`", "", m.group(1)).strip().lower()
            out.add(re.sub(r"[^\w\- ]", "", text).replace(" ", "-"))
    return out


def _links(md: Path) -> list[str]:
    return _LINK.findall(_FENCE.sub("", md.read_text()))


@pytest.mark.parametrize("md", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve_inside_the_repository(md: Path) -> None:
    dead = []
    for target in _links(md):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
            dead.append(f"{target} (leaves the repository)")
            continue
        path, _, anchor = target.partition("#")
        dest = (md.parent / path).resolve() if path else md
        if not dest.is_relative_to(ROOT):
            dead.append(f"{target} (outside the repository)")
        elif not dest.exists():
            dead.append(f"{target} (no such file)")
        elif anchor and dest.suffix == ".md" and anchor not in _slugs(dest):
            dead.append(f"{target} (no such heading)")
    assert not dead, f"{md.relative_to(ROOT)}: {dead}"
