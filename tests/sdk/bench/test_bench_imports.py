"""The SDK's import rules, read from the source (AST) of every module under ``sdk/``:

- no module imports ``prefixgate.engine``, ``prefixgate.gateway`` or ``prefixgate.kernels``,
  at import time or lazily inside a function, by ``import``, ``from ... import``, a relative
  import that climbs out of ``prefixgate.sdk``, or ``importlib.import_module`` / ``__import__``
  with a literal name (a benchmark that needs a server starts it as a process by module name);
- none imports torch, transformers or triton at import time (``bench compare`` loads
  transformers' tokenizer lazily to count tokens), so the SDK-only install imports all of it.
"""

from __future__ import annotations

from pathlib import Path

import prefixgate.sdk as sdk
from support.imports import imported_names

SDK_DIR = Path(sdk.__file__).parent
OTHER_PARTS = ("prefixgate.engine", "prefixgate.gateway", "prefixgate.kernels")
HEAVY = ("torch", "transformers", "triton")


def _imports(path: Path, *, root: Path = SDK_DIR, top_level_only: bool = False) -> set[str]:
    """Absolute names of the modules ``path`` (a module under ``root``, the folder of
    ``prefixgate.sdk``) imports, relative imports resolved."""
    return imported_names(path, root, "prefixgate.sdk", top_level_only=top_level_only)


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
