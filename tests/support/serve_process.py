"""``prefixgate serve`` as a real process in tests: the command line, the wait for its log to
say it listens and is ready, and ``terminate`` (``prefixgate.sdk.bench.targets``'s) to stop it."""

from __future__ import annotations

import re
import subprocess
import sys
import time

from prefixgate.sdk.bench.targets import terminate

__all__ = ["READY_LINE", "SERVE", "read_until_ready", "terminate"]

SERVE = [sys.executable, "-m", "prefixgate.gateway.cli", "serve"]
"""The ``prefixgate serve`` command of this interpreter (flags follow)."""

READY_LINE = "ready (max_model_len"
"""What the server's log line says once its model is served ("model 'x' ready (max_model_len
N)"): other lines may hold the word "ready" before that."""

_LISTENING = re.compile(r"listening on (http://127\.0\.0\.1:\d+)")


def read_until_ready(
    proc: subprocess.Popen, deadline: float, ready: str = READY_LINE
) -> tuple[str | None, list[str], bool]:
    """Read ``proc``'s log (text stdout) line by line until a line holding ``ready`` once the
    listening URL was logged, the end of the log, or ``deadline`` (``time.monotonic()``
    seconds).

    Returns:
        (the base URL or None, the lines read, whether the ready line came).
    """
    log: list[str] = []
    url = None
    assert proc.stdout is not None
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        log.append(line)
        m = _LISTENING.search(line)
        url = url or (m.group(1) if m else None)
        if url and ready in line:
            return url, log, True
    return url, log, False
