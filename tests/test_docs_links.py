"""The operator's README stays short, and every relative link in it and in docs/ resolves."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README_MAX_LINES = 250
# [text](target) outside code spans; the target up to the first ')' or space.
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def _anchor_of(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to dashes."""
    text = heading.strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    return {_anchor_of(line.lstrip("#")) for line in path.read_text().splitlines() if line.startswith("#")}


def _documents() -> list[Path]:
    return [ROOT / "README.md", ROOT / "CONTRIBUTING.md", *sorted((ROOT / "docs").glob("*.md"))]


def _broken_links(path: Path) -> list[str]:
    broken = []
    in_code = False
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if line.startswith("```"):
            in_code = not in_code
        if in_code:
            continue
        for target in LINK.findall(re.sub(r"`[^`]*`", "", line)):
            if re.match(r"^[a-z]+:", target):
                continue  # an external address: not checked offline
            file_part, _, anchor = target.partition("#")
            resolved = (path.parent / file_part).resolve() if file_part else path
            if not resolved.exists():
                broken.append(f"{path.name}:{number}: {target} (no such file)")
            elif anchor and resolved.suffix == ".md" and anchor not in _anchors(resolved):
                broken.append(f"{path.name}:{number}: {target} (no such heading)")
    return broken


def test_readme_is_short_enough_for_an_operator():
    assert len((ROOT / "README.md").read_text().splitlines()) <= README_MAX_LINES


def test_every_relative_link_resolves():
    documents = _documents()
    assert len(documents) >= 8  # README, CONTRIBUTING and the six docs pages at least
    broken = [entry for path in documents for entry in _broken_links(path)]
    assert broken == []


def test_the_link_check_finds_a_missing_file_and_a_missing_heading(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("# Title\n\n[ok](#title) [gone](missing.md) [no anchor](#nowhere)\n")
    assert _broken_links(page) == ["page.md:3: missing.md (no such file)", "page.md:3: #nowhere (no such heading)"]


def test_every_docs_page_is_linked_from_the_readme():
    readme_targets = set(LINK.findall((ROOT / "README.md").read_text()))
    pages = {f"docs/{page.name}" for page in (ROOT / "docs").glob("*.md")}
    assert pages - readme_targets == set()
