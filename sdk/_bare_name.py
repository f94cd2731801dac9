"""The checkout's top-level folders (``sdk/``, ``gateway/``, ``engine/``, ``kernels/``) are the
packages ``prefixgate.sdk`` … ``prefixgate.kernels`` (pyproject's ``package-dir``), never
top-level packages of their own.

A Python started in the checkout's root (``python3 -m pytest``, ``python3 -c``, a subprocess
started there) has the root first on ``sys.path``, so ``import kernels`` would find the folder
``kernels/`` before the distribution that owns the name (Hugging Face's ``kernels``, which
transformers imports when a model loads). Each folder's ``__init__.py`` calls
:func:`step_aside` when it runs under its bare name: the name goes to the next module of that
name on ``sys.path`` past the checkout's root, or to none.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import os
import sys


def step_aside(name: str, init_file: str) -> None:
    """Replace ``sys.modules[name]`` (the folder imported by its bare name) by the module of
    that name found on ``sys.path`` without the checkout's root, executed.

    Args:
        name: the bare name the folder was imported under (its ``__name__``).
        init_file: the folder's ``__init__.py`` (its ``__file__``).

    Raises:
        ModuleNotFoundError: no other module of that name is installed.
    """
    root = os.path.dirname(os.path.dirname(os.path.realpath(init_file)))
    path = [p for p in sys.path if os.path.realpath(p or os.getcwd()) != root]
    spec = importlib.machinery.PathFinder.find_spec(name, path)
    if spec is None or spec.loader is None:
        raise ModuleNotFoundError(f"No module named {name!r}", name=name)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        sys.modules.pop(name, None)
        raise
