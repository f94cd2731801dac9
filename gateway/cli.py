"""``python -m prefixgate.gateway.cli serve ...``: the ``prefixgate`` command (:mod:`prefixgate.sdk.cli`)."""

from __future__ import annotations

import sys

from prefixgate.sdk.cli import main

__all__ = ["main"]

if __name__ == "__main__":
    sys.exit(main())
