"""What the examples do when no server answers: one line saying where they looked, exit status 1.

The examples import it as a sibling (``python examples/x.py`` puts ``examples/`` on the path).
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def exit_if_unreachable(
    error: type[Exception], url: str, env_var: str = "PREFIXGATE_BASE_URL"
) -> Iterator[None]:
    """Run the block; an ``error`` (the client's connection error class) from it becomes one
    line, nothing answered at ``url``: start a server or point ``env_var`` at one.

    Raises:
        SystemExit: on ``error``, with that line (status 1).
    """
    try:
        yield
    except error as exc:
        sys.exit(
            f"cannot reach a server at {url} ({exc}); start one with "
            f"`prefixgate serve` or point {env_var} at one"
        )
