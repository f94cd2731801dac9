"""What the examples do when no server answers: one line saying where they looked, exit status 1.

The examples import it as a sibling (``python examples/x.py`` puts ``examples/`` on the path).
"""

from __future__ import annotations

import sys
from typing import NoReturn


def exit_unreachable(url: str, exc: Exception, env_var: str = "PREFIXGATE_BASE_URL") -> NoReturn:
    """Exit with one line: nothing answered at ``url`` (``exc`` says why); start a server or
    point ``env_var`` at one.

    Raises:
        SystemExit: always, with that line (status 1).
    """
    sys.exit(
        f"cannot reach a server at {url} ({exc}); start one with "
        f"`prefixgate serve` or point {env_var} at one"
    )
