"""No import cycles among longtrain's modules, counting imports inside functions too.

A cycle hidden in a function (`def f(): from a import b`) still ties the modules together: neither
can be read, tested or moved without the other. Lazy imports that keep `longtrain -h` fast are fine;
they must point one way.
"""

from __future__ import annotations

import ast
from pathlib import Path

import longtrain

PACKAGE = Path(longtrain.__file__).parent


def runtime_imports(tree: ast.AST):
    """Every import statement anywhere in `tree` (functions included) but under `if TYPE_CHECKING:`."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.If) and ast.unparse(node.test).endswith("TYPE_CHECKING"):
            yield from (n for child in node.orelse for n in runtime_imports(ast.Module(body=[child], type_ignores=[])))
            continue
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        yield from runtime_imports(node)


def import_graph(package: Path = PACKAGE) -> dict[str, set[str]]:
    """{module: longtrain modules it imports anywhere in its source}; `from pkg import mod` counts as mod."""
    modules = {}
    for path in package.rglob("*.py"):
        parts = list(path.relative_to(package.parent).with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        modules[".".join(parts[:-1] if is_package else parts)] = (path, is_package)
    graph = {}
    for name, (path, is_package) in modules.items():
        graph[name] = set()
        for node in runtime_imports(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                graph[name] |= {a.name for a in node.names if a.name in modules}
            elif isinstance(node, ast.ImportFrom):
                if node.level:  # relative: from the module's package, one level up per extra dot
                    base = name.split(".")[: None if is_package else -1]
                    base = base[: len(base) - node.level + 1]
                    target = ".".join(base + ([node.module] if node.module else []))
                else:
                    target = node.module
                for a in node.names:
                    sub = f"{target}.{a.name}"
                    graph[name] |= {sub} if sub in modules else {target} if target in modules else set()
        graph[name].discard(name)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_finder_sees_a_cycle_through_a_function_level_import(tmp_path):
    pkg = tmp_path / "longtrain"
    (pkg / "data").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "data" / "__init__.py").write_text("")
    (pkg / "data" / "a.py").write_text("from .b import x\n")
    (pkg / "data" / "b.py").write_text("def f():\n    from longtrain.data import a\n")
    (pkg / "c.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from longtrain.d import y\n")
    (pkg / "d.py").write_text("from longtrain.c import x\n")  # c's import of d is for type checkers only
    assert cycles(import_graph(pkg)) == [["longtrain.data.a", "longtrain.data.b"]]


def test_longtrain_has_no_import_cycles():
    found = cycles(import_graph())
    assert found == [], "import cycles (break each by moving what both sides need into a lower module):\n" + "\n".join(
        " <-> ".join(c) for c in found
    )
