"""Imports run one way: no circle among ``ratiokl``'s modules.

The graph is read from the source with ``ast``, not by importing it, so it sees every
import: the top-level ones and those inside functions. A function-level import is an edge
like any other, since one that only dodges a circle still is a circle. The exceptions are
the lazy imports in ``OPTIONAL_LAZY`` below, which exist so that ``import ratiokl.torch`` /
``ratiokl.jax`` does not import an optional dependency; each is named with its reason.

An edge to a module's own package (``from ratiokl.torch import _x`` reaching
``ratiokl.torch``) is not counted: a package always starts importing before its submodules.
"""

import ast
import pathlib
from typing import Dict, List, Set, Tuple

SRC = pathlib.Path(__file__).resolve().parents[1] / "src"

# (importer, imported): function-level imports kept lazy because the imported module needs
# an optional dependency that importing the framework binding must not pull in.
_TRITON = "imports triton (ratiokl._kernels): only when a kernel backend runs"
OPTIONAL_LAZY: Dict[Tuple[str, str], str] = {
    ("ratiokl.torch._checks", "ratiokl.torch._launch"): _TRITON,
    ("ratiokl.torch._linear_logprobs", "ratiokl.torch._launch"): _TRITON,
    ("ratiokl.torch._linear_logprobs", "ratiokl.torch._triton"): _TRITON,
    ("ratiokl.torch._route", "ratiokl.torch._linear"): _TRITON,
    ("ratiokl.torch._route", "ratiokl.torch._triton"): _TRITON,
    ("ratiokl.torch._vocab_parallel", "ratiokl.torch._triton"): _TRITON,
    ("ratiokl.torch._vocab_shard", "ratiokl.torch._triton"): _TRITON,
    ("ratiokl.torch.advantages", "ratiokl.torch._launch.gae"): _TRITON,
    ("ratiokl.jax._route", "ratiokl.jax._interpret"): "imports torch and triton (the interpreter)",
    ("ratiokl.jax._route", "ratiokl.jax._linear"): _TRITON,
    ("ratiokl.jax._route", "ratiokl.jax._triton"): _TRITON,
    ("ratiokl.jax._route", "ratiokl.jax._triton_loss"): _TRITON,
    ("ratiokl.jax._route", "ratiokl.jax._triton_shard"): _TRITON,
    ("ratiokl.jax._vocab_linear", "ratiokl.jax._triton_shard"): _TRITON,
}

Edge = Tuple[str, str]


def _module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(SRC).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> Dict[str, pathlib.Path]:
    return {_module_name(p): p for p in sorted((SRC / "ratiokl").rglob("*.py"))}


def _is_package(modules: Dict[str, pathlib.Path], name: str) -> bool:
    return modules[name].name == "__init__.py"


def _imports(node: ast.AST, module: str, modules: Dict[str, pathlib.Path]) -> List[str]:
    """The ratiokl modules that one ``import`` statement names."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names if a.name in modules]
    base = node.module or ""
    if node.level:
        package = module if _is_package(modules, module) else module.rpartition(".")[0]
        for _ in range(node.level - 1):
            package = package.rpartition(".")[0]
        base = f"{package}.{base}" if node.module else package
    if base not in modules:
        return []
    return [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]


def _import_edges() -> Dict[Edge, List[Tuple[int, bool]]]:
    """Each edge with the (line, inside a function) of the statements that make it."""
    modules = _modules()
    edges: Dict[Edge, List[Tuple[int, bool]]] = {}

    def visit(node: ast.AST, module: str, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                for target in _imports(child, module, modules):
                    if target != module and not module.startswith(target + "."):
                        edges.setdefault((module, target), []).append((child.lineno, in_function))
            nested = isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            visit(child, module, in_function or nested)

    for name, path in modules.items():
        visit(ast.parse(path.read_text(), str(path)), name, False)
    return edges


def _graph(edges: Dict[Edge, List[Tuple[int, bool]]]) -> Dict[str, Set[str]]:
    graph: Dict[str, Set[str]] = {}
    for (source, target) in edges:
        if (source, target) not in OPTIONAL_LAZY:
            graph.setdefault(source, set()).add(target)
    return graph


def _circles(graph: Dict[str, Set[str]]) -> List[List[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: Dict[str, int] = {}
    low: Dict[str, int] = {}
    stack: List[str] = []
    on_stack: Set[str] = set()
    found: List[List[str]] = []

    def connect(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in index:
                connect(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            connect(node)
    return found


def _loop_through(start: str, members: Set[str], graph: Dict[str, Set[str]]) -> List[str]:
    """A shortest import loop from ``start`` back to itself, within one component."""
    paths = {start: [start]}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for nxt in sorted(graph.get(node, set()) & members):
                if nxt == start:
                    return paths[node] + [start]
                if nxt not in paths:
                    paths[nxt] = paths[node] + [nxt]
                    following.append(nxt)
        frontier = following
    raise AssertionError(f"{start} is in no loop")


def _describe(circle: List[str], graph, edges) -> str:
    members = set(circle)
    loop = _loop_through(circle[0], members, graph)
    steps = []
    for source, target in zip(loop, loop[1:]):
        where = ", ".join(f"line {n}{' (in a function)' if lazy else ''}"
                          for n, lazy in edges[(source, target)])
        steps.append(f"    {source} -> {target}  [{where}]")
    return (f"  {len(circle)} modules: {', '.join(circle)}\n  one loop:\n" + "\n".join(steps))


def test_no_import_circles():
    edges = _import_edges()
    graph = _graph(edges)
    circles = _circles(graph)
    report = "\n\n".join(_describe(c, graph, edges) for c in circles)
    assert not circles, f"{len(circles)} import circle(s) among ratiokl modules:\n\n{report}"


def test_optional_lazy_imports_are_lazy_and_current():
    """Each allow-listed edge exists and is made only inside functions, so the list can
    neither go stale nor hide a top-level import."""
    edges = _import_edges()
    for edge in OPTIONAL_LAZY:
        assert edge in edges, f"{edge} is allow-listed but no longer imported"
        top_level = [line for line, lazy in edges[edge] if not lazy]
        assert not top_level, f"{edge} is allow-listed but imported at top level, line {top_level}"
