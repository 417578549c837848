"""Data flows one way (specs -> estimate -> prune or run -> result -> report): no autotune module
imports, even lazily inside a function, a module that imports it back. Units are the top-level
modules and packages (autotune.trial, autotune.memory, ...); `python tests/test_layering.py` prints
the graph."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "autotune"


def unit(module: str) -> str:
    return ".".join(module.split(".")[:2])


def graph() -> dict[str, set[str]]:
    """unit -> the units it imports (module level or inside functions)."""
    out: dict[str, set[str]] = {}
    for path in PACKAGE.rglob("*.py"):
        me = unit(".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts))
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("autotune"):
                names = [node.module] if node.module != "autotune" else [f"autotune.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names if a.name.startswith("autotune")]
            out.setdefault(me, set()).update(u for u in map(unit, names) if u != me)
    return out


def cycles(g: dict[str, set[str]]) -> list[tuple[str, str]]:
    def reach(a: str) -> set[str]:
        seen, todo = set(), [a]
        while todo:
            for b in g.get(todo.pop(), ()):
                if b not in seen:
                    seen.add(b)
                    todo.append(b)
        return seen
    return sorted((a, b) for a in g for b in g[a] if a in reach(b))


def test_no_import_runs_back_up():
    g = graph()
    assert g["autotune.hardware"] and "autotune.models" not in g["autotune.hardware"]   # the graph is real
    assert cycles(g) == []


def test_a_cycle_is_found():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [("a", "b"), ("b", "c"), ("c", "a")]


if __name__ == "__main__":
    for a, bs in sorted(graph().items()):
        print(f"{a:26} -> {', '.join(sorted(b.removeprefix('autotune.') for b in bs))}")
