"""What the examples do when no server answers, or it refuses the key: one line saying so,
exit status 1 (never a traceback).

The examples import it as a sibling (``python examples/x.py`` puts ``examples/`` on the path).
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def exit_if_unreachable(
    error: type[Exception],
    url: str,
    env_var: str = "PREFIXGATE_BASE_URL",
    unauthorized: type[Exception] | None = None,
) -> Iterator[None]:
    """Run the block; an ``error`` (the client's connection error class) from it becomes one
    line, nothing answered at ``url``: start a server or point ``env_var`` at one; an
    ``unauthorized`` (the client's 401 class) one line too: the key was refused, set
    ``PREFIXGATE_API_KEY``.

    Raises:
        SystemExit: on ``error`` or ``unauthorized``, with that line (status 1).
    """
    try:
        yield
    except error as exc:
        sys.exit(
            f"cannot reach a server at {url} ({exc}); start one with "
            f"`prefixgate serve` or point {env_var} at one"
        )
    except Exception as exc:
        if unauthorized is None or not isinstance(exc, unauthorized):
            raise
        said = " ".join(str(getattr(exc, "message", None) or exc).split())[:200]
        sys.exit(
            f"the server at {url} refused the API key (401: {said}); "
            "set PREFIXGATE_API_KEY to one of its keys"
        )
