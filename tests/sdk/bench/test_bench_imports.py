"""The SDK's import rules, read from the source (AST) of every module under ``sdk/``:

- no module imports ``prefixgate.engine``, ``prefixgate.gateway`` or ``prefixgate.kernels``,
  at import time or lazily inside a function, by ``import``, ``from ... import``, a relative
  import that climbs out of ``prefixgate.sdk``, or ``importlib.import_module`` / ``__import__``
  with a literal name (a benchmark that needs a server starts it as a process by module name);
- none imports torch, transformers or triton at import time (``bench compare`` loads
  transformers' tokenizer lazily to count tokens), so the SDK-only install imports all of it.
"""

from __future__ import annotations

import ast
from pathlib import Path

import prefixgate.sdk as sdk

SDK_DIR = Path(sdk.__file__).parent
OTHER_PARTS = ("prefixgate.engine", "prefixgate.gateway", "prefixgate.kernels")
HEAVY = ("torch", "transformers", "triton")


def _module_name(path: Path, root: Path) -> str:
    rel = path.relative_to(root).with_suffix("")
    parts = ["prefixgate", "sdk", *rel.parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _package(path: Path, root: Path) -> str:
    name = _module_name(path, root)
    return name if path.name == "__init__.py" else name.rpartition(".")[0]


def _imports(path: Path, *, root: Path = SDK_DIR, top_level_only: bool = False) -> set[str]:
    """Absolute names of the modules ``path`` (a module under ``root``, the folder of
    ``prefixgate.sdk``) imports, relative imports resolved."""
    tree = ast.parse(path.read_text(), filename=str(path))
    names: set[str] = set()
    for node in tree.body if top_level_only else ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                package = _package(path, root).split(".")
                up = package[: len(package) - (node.level - 1)]
                base = ".".join([*up, base] if base else up)
            names.add(base)
            names.update(f"{base}.{a.name}" for a in node.names)  # `from prefixgate import engine`
        elif (
            isinstance(node, ast.Call)
            and (
                (isinstance(node.func, ast.Attribute) and node.func.attr == "import_module")
                or (
                    isinstance(node.func, ast.Name)
                    and node.func.id in ("import_module", "__import__")
                )
            )
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
        ):
            names.add(node.args[0].value)
    return names


def _within(name: str, prefixes: tuple[str, ...]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def _sdk_modules() -> list[Path]:
    paths = sorted(p for p in SDK_DIR.rglob("*.py") if "__pycache__" not in p.parts)
    assert SDK_DIR / "bench" / "loadgen.py" in paths  # the load generator is looked at too
    return paths


def test_sdk_imports_no_other_part_of_the_project():
    for path in _sdk_modules():
        bad = {n for n in _imports(path) if _within(n, OTHER_PARTS)}
        rel = path.relative_to(SDK_DIR)
        assert not bad, f"sdk/{rel} imports {sorted(bad)}: start a server as a process instead"


def test_sdk_imports_neither_torch_nor_transformers_at_import_time():
    for path in _sdk_modules():
        bad = {n for n in _imports(path, top_level_only=True) if _within(n, HEAVY)}
        assert not bad, f"sdk/{path.relative_to(SDK_DIR)} imports {sorted(bad)} at import time"


def test_the_rule_sees_every_kind_of_import(tmp_path):
    """The checker itself: each spelling of an import of another part is caught."""
    fake = tmp_path / "sdk"
    (fake / "bench").mkdir(parents=True)
    spellings = {
        "import prefixgate.engine.llm": "prefixgate.engine.llm",
        "from prefixgate.gateway import app": "prefixgate.gateway",
        "from prefixgate import kernels": "prefixgate.kernels",
        "from ...engine import LLM": "prefixgate.engine",
        "def f():\n    import prefixgate.engine": "prefixgate.engine",
        "import importlib\nimportlib.import_module('prefixgate.gateway.cli')": "prefixgate.gateway.cli",
        "__import__('prefixgate.kernels.torch_ref')": "prefixgate.kernels.torch_ref",
    }
    for i, (source, name) in enumerate(spellings.items()):
        path = fake / "bench" / f"m{i}.py"
        path.write_text(source + "\n")
        found = {n for n in _imports(path, root=fake) if _within(n, OTHER_PARTS)}
        assert name in found, (source, found)
    ok = fake / "bench" / "ok.py"
    ok.write_text(
        "import subprocess, sys\nfrom . import workload\nfrom ..types import ChatCompletion\n"
        "subprocess.run([sys.executable, '-m', 'prefixgate.gateway.cli', 'serve'])\n"
    )
    assert not {n for n in _imports(ok, root=fake) if _within(n, OTHER_PARTS)}
    assert _imports(ok, root=fake) >= {"prefixgate.sdk.bench.workload", "prefixgate.sdk.types"}
