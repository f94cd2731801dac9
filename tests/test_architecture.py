"""The house rules of the layout, checked on the source (AST, so lazy and type-only imports count).

- No import circle between the project's modules.
- The SDK imports no other part of the project.
- The gateway is in rooms: at most 12 modules at its top level, each room imports only the
  rooms below it (``ROOM_IMPORTS``; docs/architecture.md, "The gateway's rooms"), and
  ``settings`` / ``state`` import no room above the rooms that import them (``TOP_IMPORTS``).
"""

from __future__ import annotations

import ast
import functools
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PARTS = {"sdk": "prefixgate.sdk", "gateway": "prefixgate.gateway", "engine": "prefixgate.engine"}
PARTS["kernels"] = "prefixgate.kernels"

# What each gateway room may import of the gateway (besides itself). The top-level modules
# (``settings``, ``state``, ``app``, ``cli``, ``dashboard``) are not rooms. The two modes are
# rooms side by side over the shared wire floor: neither imports the other.
GW = "prefixgate.gateway"
ROOM_IMPORTS = {
    "http": {f"{GW}.settings"},
    "tenancy": {f"{GW}.settings", f"{GW}.http"},
    "wire": {f"{GW}.settings", f"{GW}.http", f"{GW}.tenancy"},
    "local": {f"{GW}.settings", f"{GW}.state", f"{GW}.http", f"{GW}.tenancy", f"{GW}.wire"},
    "proxy": {f"{GW}.settings", f"{GW}.state", f"{GW}.http", f"{GW}.tenancy", f"{GW}.wire"},
    # the fleet simulator: admission and routing as they are, no server
    "sim": {f"{GW}.http", f"{GW}.tenancy", f"{GW}.proxy"},
}
# What the top-level modules the rooms import may import of the gateway: nothing above the
# lowest room that imports them, so no room reaches another room through them.
TOP_IMPORTS = {
    "settings": set(),
    "state": {f"{GW}.settings", f"{GW}.http", f"{GW}.tenancy"},
}


@functools.cache
def _modules() -> dict[str, Path]:
    """Dotted module name -> file, for every module of the four parts."""
    out: dict[str, Path] = {}
    for folder, package in PARTS.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            rel = path.relative_to(ROOT / folder).with_suffix("")
            parts = [p for p in rel.parts if p != "__init__"]
            out[".".join([package, *parts])] = path
    return out


def _imports(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """Project modules ``name`` imports anywhere in its file (top level, lazy, TYPE_CHECKING)."""
    is_package = path.name == "__init__.py"
    here = name if is_package else name.rsplit(".", 1)[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("prefixgate."))
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = here.split(".")
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join([*anchor, *([base] if base else [])])
            if not base.startswith("prefixgate."):
                continue
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                found.add(sub if sub in known else base)
    return {m for m in found if m in known and m != name}


@functools.cache
def _graph() -> dict[str, set[str]]:
    known = _modules()
    return {name: _imports(name, path, known) for name, path in known.items()}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_import_circle() -> None:
    assert _cycles(_graph()) == []


def test_sdk_imports_no_other_part() -> None:
    bad = {
        (name, dep)
        for name, deps in _graph().items()
        if name.startswith("prefixgate.sdk")
        for dep in deps
        if not dep.startswith("prefixgate.sdk")
    }
    assert bad == set()


def test_gateway_top_level_is_small() -> None:
    top = sorted(p.name for p in (ROOT / "gateway").glob("*.py"))
    assert len(top) <= 12, top


def test_rooms_import_only_rooms_below() -> None:
    bad = []
    for name, deps in _graph().items():
        parts = name.split(".")
        if len(parts) < 4 or parts[1] != "gateway" or parts[2] not in ROOM_IMPORTS:
            continue
        room = f"{GW}.{parts[2]}"
        allowed = ROOM_IMPORTS[parts[2]]
        for dep in deps:
            if not dep.startswith(GW + ".") or dep.startswith(room):
                continue
            if not any(dep == a or dep.startswith(a + ".") for a in allowed):
                bad.append(f"{name} imports {dep}")
    assert bad == []


def test_settings_and_state_import_no_room_above_them() -> None:
    bad = []
    for top, allowed in TOP_IMPORTS.items():
        name = f"{GW}.{top}"
        for dep in _graph()[name]:
            if dep.startswith(GW + ".") and not any(
                dep == a or dep.startswith(a + ".") for a in allowed
            ):
                bad.append(f"{name} imports {dep}")
    assert bad == []


def test_settings_names_agree_with_their_registries() -> None:
    """``settings`` checks ``routing``, ``tool_call_parser`` and ``upstream_cache_salt``
    against its own copy of the names (it imports no room); each copy is its registry's."""
    from prefixgate.gateway import settings
    from prefixgate.gateway.proxy.policies import POLICIES
    from prefixgate.gateway.wire.tool_parsers import PARSERS

    assert settings.ROUTING_POLICIES == POLICIES
    assert settings.TOOL_CALL_PARSERS == tuple(PARSERS)


def test_every_package_is_in_the_distribution() -> None:
    """A folder with ``__init__.py`` missing from pyproject's ``packages`` is left out of a
    built wheel (the editable install still finds it, so nothing else would notice)."""
    import tomllib

    listed = set(
        tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]
    )
    found = {name for name, path in _modules().items() if path.name == "__init__.py"}
    assert found - listed == set() and listed - found == set()
