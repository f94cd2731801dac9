"""A real ``redis-server`` on a free loopback port for tests (no persistence: ``--save ''
--appendonly no``), stopped after. Without the binary the test is skipped with a reason,
except in CI (``CI=true``), where a missing server fails the test instead.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time

import pytest
from prefixgate.sdk.bench.targets import terminate

from support.net import free_port


class RedisServer:
    """One ``redis-server`` process; ``stop()`` and ``start()`` again on the same port."""

    def __init__(self, binary: str, port: int) -> None:
        self.binary = binary
        self.port = port
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> RedisServer:
        self.proc = subprocess.Popen(
            [
                self.binary,
                "--port",
                str(self.port),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
                "--daemonize",
                "no",
                "--loglevel",
                "warning",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        import redis

        client = redis.Redis(host="127.0.0.1", port=self.port, socket_connect_timeout=0.2)
        deadline = time.monotonic() + 10
        while True:
            try:
                client.ping()
                break
            except redis.exceptions.ConnectionError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(f"redis-server did not start on port {self.port}") from None
                time.sleep(0.02)
        client.close()
        return self

    def stop(self) -> None:
        if self.proc is not None:
            terminate(self.proc, 5, 5)
        self.proc = None

    def client(self):  # noqa: ANN201 - redis.Redis, imported lazily
        import redis

        return redis.Redis(host="127.0.0.1", port=self.port, decode_responses=True)


def redis_binary() -> str:
    """The ``redis-server`` path; skips the test without one (fails it under ``CI=true``)."""
    binary = shutil.which("redis-server")
    if binary is None:
        reason = "no redis-server binary (apt-get install redis-server; .ci/run installs it)"
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(reason)
        pytest.skip(reason)
    return binary


def start_redis() -> RedisServer:
    """A started ``RedisServer`` on a free loopback port (the caller stops it)."""
    return RedisServer(redis_binary(), free_port()).start()
