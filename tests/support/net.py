"""Loopback networking helpers for tests."""

from __future__ import annotations

import socket


def free_port() -> int:
    """A free TCP port on 127.0.0.1 (bound then released: the caller binds it right after, or
    uses it as an address nobody listens on)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
