"""The shared test-data folder: real models and workloads kept beside the checkout.

``shared/`` holds ``models/`` (aidreams-260k, smollm2-135m-shape) and ``workloads/``; it is
``$PREFIXGATE_SHARED`` when set, else the first ``shared`` folder found in the current
directory, its parent, or beside the checkout this file lives in. The one lookup the
benchmarks and the tests' fixtures (``tests/conftest.py``) use.
"""

from __future__ import annotations

import os
from pathlib import Path

_BESIDE_CHECKOUT = Path(__file__).resolve().parents[3] / "shared"


def shared_roots() -> list[Path]:
    """Where the folder is looked for, in order."""
    env = os.environ.get("PREFIXGATE_SHARED")
    if env:
        return [Path(env)]
    return [Path.cwd() / "shared", Path.cwd().parent / "shared", _BESIDE_CHECKOUT]


def shared_dir() -> Path:
    """The shared folder: the first root that exists (the last one when none does, so paths
    under it name where the data was expected)."""
    roots = shared_roots()
    return next((root for root in roots if root.is_dir()), roots[-1])


def find_shared(rel: str | Path) -> Path | None:
    """``rel`` under the shared folder, or ``None`` when absent."""
    for root in shared_roots():
        cand = root / rel
        if cand.exists():
            return cand
    return None
