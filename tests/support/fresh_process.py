"""Run test code in a fresh Python interpreter (what a first import costs or pulls in)."""

from __future__ import annotations

import subprocess
import sys


def run_code(code: str, timeout_s: float) -> str:
    """Run ``code`` with ``python -c`` in a new process (this interpreter, this environment);
    assert it exits 0 (else show its stderr) and return its stdout."""
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout_s
    )
    assert out.returncode == 0, out.stderr
    return out.stdout
