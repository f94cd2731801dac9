"""Routing policies own their lifecycle: the gateway calls the same hooks of whichever policy
routes (``proxy.policies.base.Policy``), so no code outside ``gateway/proxy/policies/`` names a
particular policy. Checked on the source (AST): an identifier, attribute, keyword, import or
string that names ``precise`` outside the policies' folder fails, except the settings' option
names, the registry's name list copied into settings (``ROUTING_POLICIES``: settings imports
no room; tests/test_architecture.py holds it equal to ``policies.REGISTRY``) and the CLI's help
text; docstrings and comments are prose, not code.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GATEWAY = ROOT / "gateway"
POLICY = "precise"
# The settings' option names (``GatewaySettings`` fields and their ``--flags``) may name it.
OPTIONS = {"precise_max_load_ratio", "precise_overlap_weight"}
# Folders whose code may name a policy: the policies themselves; the fleet simulator and the
# benchmarks, which choose a policy by name as a user does.
OWNERS = ("proxy/policies/", "sim/", "bench/")
# Files whose strings may name it: the CLI's help text.
HELP_FILES = {"serve/args.py", "serve/help_text.py"}


def _docstrings(tree: ast.AST) -> set[int]:
    """ids of the docstring nodes of ``tree`` (module, classes, functions)."""
    out: set[int] = set()
    for node in ast.walk(tree):
        if (
            isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
            and node.body
        ):
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                out.add(id(first.value))
    return out


# Assignments whose strings are the policies' names as a list (settings' copy of the registry).
NAME_LISTS = {"ROUTING_POLICIES"}


def _name_lists(tree: ast.AST) -> set[int]:
    """ids of the string constants inside an assignment to one of ``NAME_LISTS``."""
    out: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id in NAME_LISTS for t in node.targets
        ):
            out.update(id(n) for n in ast.walk(node.value) if isinstance(n, ast.Constant))
    return out


def _named(word: str) -> bool:
    return POLICY in word.lower() and word not in OPTIONS


def special_cases(source: str, rel: str) -> list[str]:
    """Where ``source`` (the file ``rel`` under gateway/) names the policy in code."""
    tree = ast.parse(source, rel)
    docs = _docstrings(tree) | _name_lists(tree)
    found: list[str] = []
    for node in ast.walk(tree):
        words: list[str] = []
        if isinstance(node, ast.Name):
            words = [node.id]
        elif isinstance(node, ast.Attribute):
            words = [node.attr]
        elif isinstance(node, ast.keyword) and node.arg:
            words = [node.arg]
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            words = [node.name]
        elif isinstance(node, ast.arg):
            words = [node.arg]
        elif isinstance(node, ast.ImportFrom):
            words = [node.module or "", *(a.name for a in node.names)]
        elif isinstance(node, ast.Import):
            words = [a.name for a in node.names]
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            if id(node) in docs or rel in HELP_FILES:
                continue
            words = [node.value]
        for word in words:
            if _named(word):
                found.append(f"{rel}:{getattr(node, 'lineno', '?')}: {word[:60]!r}")
    return found


def test_no_policy_is_special_cased_outside_policies() -> None:
    found: list[str] = []
    for path in sorted(GATEWAY.rglob("*.py")):
        rel = path.relative_to(GATEWAY).as_posix()
        if rel.startswith(OWNERS):
            continue
        found += special_cases(path.read_text(), rel)
    assert found == [], "\n".join(found)


def test_the_check_finds_a_special_case() -> None:
    """The check itself: the special cases that used to be in the app and the routes."""
    assert special_cases('if s.routing == "precise":\n    pass\n', "app.py")
    assert special_cases("router.precise.start()\n", "app.py")
    assert special_cases("from x.precise_routing import PreciseRouting\n", "app.py")
    assert (
        special_cases('"""About precise routing."""\nx = s.precise_max_load_ratio\n', "a.py") == []
    )
    assert (
        special_cases('p.add_argument("--routing", help="precise: ...")\n', "serve/args.py") == []
    )
