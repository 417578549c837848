"""autotune/ imports in one direction: no module imports another that imports it back, directly or
through others, and autotune/memory/ imports down its layers only (issue 30).

An AST check, not import-linter: an import inside a function body (the usual way to break a cycle
at import time) is an edge here too, since the modules still depend on each other both ways.
`from pkg import name` is an edge to pkg.name where that is a module, else to pkg; the implicit
import of a module's parent package is not an edge (every package's __init__ would be in a cycle
with the submodules it imports).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "autotune"

MEMORY_LAYERS: tuple[tuple[str, ...], ...] = (
    ("segments",),                               # the traced step's vocabulary: segments, categories
    ("tracer",),                                 # fake tensors and LiveBytes (torch)
    ("seq_family",),                             # one build replayed over sequence lengths
    ("code_trace",),                             # the programs of transformers' or a factory's code
    ("activations", "overhead", "tensor_parallel"),   # terms that need nothing else of memory/; AutoTP's shard
    ("buffers",),                                # gradients and DeepSpeed's buffers
    ("model_states",),                           # parameters, master weights, optimizer states
    ("host", "lora"),                            # host RAM; LoRA's phases from the full ones
    ("analytic", "sequence_parallel"),           # the analytic phases, MemoryEstimate; Ulysses' terms
    ("traced",),                                 # the traced tier: traced activations + those terms
    ("__init__",),                               # estimate()
    ("baselines", "correction", "grid", "limits"),   # users of estimate()
)
"""memory/'s modules from the bottom up: each imports only modules of the layers below it, and
modules of one layer do not import each other. A new module must be placed here."""

def modules(root: Path = ROOT) -> dict[str, tuple[Path, bool]]:
    """Dotted name -> (file, is a package's __init__) of every module under `root`."""
    out = {}
    for path in root.rglob("*.py"):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        package = parts[-1] == "__init__"
        out[".".join(parts[:-1] if package else parts)] = (path, package)
    return out


def _imported(node: ast.AST, package: str, mods: dict) -> set[str]:
    if isinstance(node, ast.Import):
        return {a.name for a in node.names if a.name in mods}
    if not isinstance(node, ast.ImportFrom):
        return set()
    base = node.module or ""
    if node.level:   # relative: up level - 1 packages from this module's package
        up = package.split(".")[: len(package.split(".")) - node.level + 1]
        base = ".".join(up + ([node.module] if node.module else []))
    return {f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names} & set(mods)


def import_graph(root: Path = ROOT) -> dict[str, set[str]]:
    """Module -> the modules of `root` it imports anywhere in its file, function bodies included."""
    mods = modules(root)
    graph = {}
    for name, (path, is_package) in mods.items():
        package = name if is_package else name.rpartition(".")[0]
        edges = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            edges |= _imported(node, package, mods)
        graph[name] = edges - {name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[frozenset[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            v, children = work[-1]
            w = next(children, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                component = set()
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    component.add(w)
                    if w == v:
                        break
                if len(component) > 1:
                    found.append(frozenset(component))
    return found


def test_the_check_sees_a_cycle_made_by_an_import_inside_a_function(tmp_path):
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from pkg.b import g\n\ndef f():\n    return g()\n")
    (pkg / "b.py").write_text("def g():\n    from pkg import a\n    return a\n")
    (pkg / "c.py").write_text("from . import a\n")
    assert cycles(import_graph(pkg)) == [frozenset({"pkg.a", "pkg.b"})]


def test_no_import_cycle_in_autotune():
    found = cycles(import_graph())
    assert not found, f"import cycles: {[sorted(c) for c in found]}"


def test_memory_imports_down_its_layers_only():
    graph = import_graph()
    layer_of = {("autotune.memory" if m == "__init__" else f"autotune.memory.{m}"): i
                for i, layer in enumerate(MEMORY_LAYERS) for m in layer}
    present = {m for m in graph if m == "autotune.memory" or m.startswith("autotune.memory.")}
    assert present == set(layer_of), f"place in MEMORY_LAYERS: {sorted(present - set(layer_of))}"
    upward = [(m, dep) for m in sorted(present) for dep in sorted(graph[m] & present)
              if layer_of[dep] >= layer_of[m]]
    assert not upward, f"imports up or across memory/'s layers: {upward}"


@pytest.mark.parametrize("public", ["estimate", "MemoryEstimate", "builtin", "_phases"])
def test_the_public_names_of_autotune_memory_stay(public):
    import autotune.memory

    assert callable(getattr(autotune.memory, public))
