"""The pages stay short and about the user's task; every relative link resolves.

mkdocs (strict) checks the links between pages; this checks the READMEs' too, the
length of each page, and that no page or README carries development history: working
sessions, issue numbers, commit hashes or paths of a development machine.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from blocks import ROOT, documents

MAX_LINES = 350
FORBIDDEN = {
    "a working session": re.compile(r"\bsittings?\b", re.IGNORECASE),
    "an issue number": re.compile(r"\bissues? #?\d+", re.IGNORECASE),
    "a helper's name": re.compile(r"\bhelper h\d+", re.IGNORECASE),
    "a commit hash": re.compile(r"\b(?=[0-9a-f]*[a-f])(?=[0-9a-f]*[0-9])[0-9a-f]{7,40}\b"),
    "a machine path": re.compile(r"(?<![\w.])/(?:tmp|root|work|home)/"),
}
LINK = re.compile(r"\]\((?P<target>[^)\s]+)\)")
PAGES = [p for p in documents() if p.is_relative_to(ROOT / "docs")]
READMES = [p for p in documents() if p.name == "README.md"]


def _id(path: Path) -> str:
    return str(path.relative_to(ROOT))


@pytest.mark.parametrize("page", PAGES, ids=_id)
def test_page_is_short(page: Path) -> None:
    lines = len(page.read_text().splitlines())
    assert lines <= MAX_LINES, f"{_id(page)}: {lines} lines (at most {MAX_LINES})"


@pytest.mark.parametrize("document", documents(), ids=_id)
def test_no_development_history(document: Path) -> None:
    found = [
        f"line {n}: {what}: {m.group(0)!r}"
        for n, line in enumerate(document.read_text().splitlines(), 1)
        for what, pattern in FORBIDDEN.items()
        if (m := pattern.search(line))
    ]
    assert not found, "\n".join(found)


@pytest.mark.parametrize("readme", READMES, ids=_id)
def test_readme_links_resolve(readme: Path) -> None:
    broken = []
    for match in LINK.finditer(readme.read_text()):
        target = match["target"]
        if re.match(r"^[a-z]+:", target) or target.startswith("#"):
            continue
        if not (readme.parent / target.split("#")[0]).exists():
            broken.append(target)
    assert not broken, f"{_id(readme)}: links to missing files: {broken}"


def test_every_picture_is_used() -> None:
    """Each PNG under docs/img is shown by a page (a stale chart is deleted, not kept)."""
    text = "\n".join(p.read_text() for p in PAGES)
    unused = [
        str(png.relative_to(ROOT / "docs"))
        for png in sorted((ROOT / "docs" / "img").rglob("*.png"))
        if str(png.relative_to(ROOT / "docs")) not in text
    ]
    assert not unused, f"pictures no page shows: {unused}"
