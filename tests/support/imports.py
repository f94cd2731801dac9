"""The names a module imports, read from its source (AST), for the import-rule tests."""

from __future__ import annotations

import ast
from pathlib import Path


def module_name(path: Path, root: Path, package: str) -> str:
    """Dotted name of ``path``, a module under ``root`` (the folder of ``package``)."""
    rel = path.relative_to(root).with_suffix("")
    parts = [*package.split("."), *rel.parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _package_of(path: Path, root: Path, package: str) -> str:
    name = module_name(path, root, package)
    return name if path.name == "__init__.py" else name.rpartition(".")[0]


def _literal_import(node: ast.AST) -> str | None:
    """The module of ``importlib.import_module("x")`` / ``__import__("x")``, else None."""
    if not isinstance(node, ast.Call) or not node.args:
        return None
    func = node.func
    named = (isinstance(func, ast.Attribute) and func.attr == "import_module") or (
        isinstance(func, ast.Name) and func.id in ("import_module", "__import__")
    )
    arg = node.args[0]
    if named and isinstance(arg, ast.Constant) and isinstance(arg.value, str):
        return arg.value
    return None


def imported_names(
    path: Path,
    root: Path | None = None,
    package: str = "",
    *,
    top_level_only: bool = False,
) -> set[str]:
    """Absolute names of the modules ``path`` imports (``from a import b`` gives ``a`` and
    ``a.b``), lazily inside functions too unless ``top_level_only``, and literal
    ``import_module`` / ``__import__`` names. A relative import is resolved against ``package``
    (``root`` its folder); without ``root`` it fails the test (use the absolute name).
    """
    tree = ast.parse(path.read_text(), filename=str(path))
    names: set[str] = set()
    for node in tree.body if top_level_only else ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                assert root is not None, f"{path.name}: relative import (use the absolute name)"
                parts = _package_of(path, root, package).split(".")
                up = parts[: len(parts) - (node.level - 1)]
                base = ".".join([*up, base] if base else up)
            names.add(base)
            names.update(f"{base}.{a.name}" for a in node.names)  # `from prefixgate import engine`
        elif (literal := _literal_import(node)) is not None:
            names.add(literal)
    return names
