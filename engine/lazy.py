"""Lazy package attributes (PEP 562 module ``__getattr__``, as vLLM's ``vllm/__init__.py``):
a package maps each public name to the module that defines it, and that module is imported
on the name's first use (so importing the package loads no torch)."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any

from prefixgate.engine.threads import note_engine_import

# The engine's packages import this module first, before anything loads torch: OpenMP's passive
# waiting is set here (engine/threads.py), so LLM, AsyncEngine and the benches get it without
# an environment variable. (It belongs in engine/__init__.py, which imports nothing else first.)
note_engine_import()


def lazy_getattr(
    package: str, namespace: dict[str, Any], lazy: Mapping[str, str]
) -> Callable[[str], Any]:
    """The module ``__getattr__`` of ``package``: ``name`` is imported from the module
    ``lazy[name]`` and stored in ``namespace`` (the package's ``globals()``, so later lookups
    skip ``__getattr__``).

    Raises (from the returned function):
        AttributeError: ``name`` is not in ``lazy``.
    """

    def __getattr__(name: str) -> Any:
        module = lazy.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module), name)
        namespace[name] = value
        return value

    return __getattr__
