"""The project speaks in its own words: code, docs and test text name what a figure or check is
about, never which work item asked for it ("issue 12", "issue 11's benchmark")."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# "issue 12", "issue #12", "issues 3-5"; upstream projects' issue numbers are written
# "triton#11584" and are allowed.
WORK_ITEM = re.compile(r"\bissues? #?\d+", re.IGNORECASE)


def _tracked_text_files() -> list[Path]:
    out = subprocess.run(
        ["git", "ls-files", "*.py", "*.md", "*.js", "*.html", "*.toml", "*.sh"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
    )
    if out.returncode != 0:
        pytest.skip(f"not a git checkout (git ls-files: {out.stderr.strip()})")
    return [ROOT / line for line in out.stdout.splitlines() if line]


def test_no_work_item_numbers_in_the_tree():
    hits = []
    for path in _tracked_text_files():
        if not path.is_file() or path == Path(__file__).resolve():  # its own examples
            continue
        for n, line in enumerate(
            path.read_text(encoding="utf-8", errors="replace").splitlines(), 1
        ):
            if WORK_ITEM.search(line) and "triton" not in line.lower():
                hits.append(f"{path.relative_to(ROOT)}:{n}: {line.strip()}")
    assert not hits, "work-item numbers in the project's text:\n" + "\n".join(hits)
