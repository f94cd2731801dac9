"""glibc malloc's trim threshold set once for a CPU engine (engine/malloc.py)."""

from __future__ import annotations

import sys

import pytest
from prefixgate.engine.malloc import USER_ENV, keep_freed_memory


@pytest.mark.parametrize("key", USER_ENV)
def test_the_users_setting_wins(key):
    assert keep_freed_memory(environ={key: "x"}) is False


def test_refuses_values_mallopt_cannot_take():
    for bad in (-1, 2**31):
        with pytest.raises(ValueError, match="trim_bytes"):
            keep_freed_memory(bad, environ={})


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt: Linux")
def test_sets_the_threshold_on_glibc():
    import platform

    if platform.libc_ver()[0] != "glibc":
        pytest.skip("not glibc")
    assert keep_freed_memory(environ={}) is True
