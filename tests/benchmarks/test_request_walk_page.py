"""The architecture page's walk counts are current: ``examples/benchmarks/request_walk.py``
recounts the project files and classes one local chat request passes, and the figures in
docs/architecture.md ("One chat request's walk") must be its figures."""

from __future__ import annotations

import re
from pathlib import Path

from examples.benchmarks.request_walk import measure

PAGE = Path(__file__).resolve().parents[2] / "docs" / "architecture.md"
COMMAND = "python -m examples.benchmarks.request_walk --model ../shared/models/aidreams-260k"
FIGURES = re.compile(
    r"(\d+) project files and (\d+) classes, of which (\d+) are built once per engine step"
    r" rather than per request \(([^)]*)\) and (\d+) are the response's wire models".replace(
        " ", r"\s+"
    )
)


def _page() -> tuple[int, int, list[str], int]:
    """(files, classes, the per-step class names, wire models) as the page states them."""
    found = FIGURES.search(PAGE.read_text(encoding="utf-8"))
    assert found, "docs/architecture.md lost its walk figures"
    files, classes, per_step, names, wire = found.groups()
    listed = re.findall(r"`(\w+)`", names)
    assert int(per_step) == len(listed), names
    return int(files), int(classes), listed, int(wire)


def test_the_walk_figures_on_the_architecture_page_are_current(aidreams_path):
    files, classes, per_step, wire = _page()
    got = measure(aidreams_path, stream=False)
    short = {c.rsplit(".", 1)[1] for c in got["classes"]}
    stale = f"docs/architecture.md's walk figures are stale: run {COMMAND}"
    assert (got["num_files"], got["num_classes"]) == (files, classes), (stale, got)
    assert set(per_step) <= short, (stale, sorted(set(per_step) - short))
    models = [c for c in got["classes"] if ".wire.response_models." in c]
    assert len(models) == wire, (stale, models)
