"""Every relative link of README.md and docs/ points at a file of the checkout, and every
heading anchor it names exists on that page (GitHub's anchor rule: lower case, punctuation
dropped, spaces to hyphens)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LINK = re.compile(r"\]\(([^)\s]+)\)")
CODE = re.compile(r"```.*?```", re.DOTALL)


def _pages() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def _anchors(page: Path) -> set[str]:
    out = set()
    for line in CODE.sub("", page.read_text(encoding="utf-8")).splitlines():
        if line.startswith("#"):
            title = line.lstrip("#").strip().lower()
            out.add(re.sub(r"[^\w\- ]", "", title).replace(" ", "-"))
    return out


def test_relative_links_resolve():
    broken = []
    for page in _pages():
        text = CODE.sub("", page.read_text(encoding="utf-8"))
        for target in LINK.findall(text):
            if re.match(r"[a-z]+:", target):
                continue  # http(s), mailto
            path, _, anchor = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            if not dest.exists():
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such heading)")
    assert not broken, "\n".join(broken)


def test_readme_is_one_page():
    assert len((ROOT / "README.md").read_text(encoding="utf-8").splitlines()) <= 300


def _cells(row: str) -> int:
    """Cells of a Markdown table row: pipes inside code spans or escaped (``\\|``) split none."""
    row = re.sub(r"`[^`]*`", "code", row.strip()).replace("\\|", "")
    return len(row.strip("|").split("|"))


def test_table_rows_have_their_header_s_cells():
    """A row with fewer cells than its header renders its text under the wrong columns (the
    README's demo row once held its command and its time in one cell)."""
    bad = []
    for page in [*_pages(), *sorted((ROOT / "examples").rglob("*.md"))]:
        lines = CODE.sub("", page.read_text(encoding="utf-8")).splitlines()
        for i, line in enumerate(lines[:-1]):
            if not (line.lstrip().startswith("|") and re.match(r"\s*\|?\s*:?-{3,}", lines[i + 1])):
                continue
            want = _cells(line)
            for j in range(i + 2, len(lines)):
                if not lines[j].lstrip().startswith("|"):
                    break
                if _cells(lines[j]) != want:
                    bad.append(
                        f"{page.relative_to(ROOT)}: row {lines[j][:60]!r}: {want} cells wanted"
                    )
    assert not bad, "\n".join(bad)
