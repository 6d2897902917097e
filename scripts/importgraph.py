#!/usr/bin/env python3
"""Import circles among the modules of a package (stdlib only).

Builds the graph of the imports a package's modules make when they are imported (module
level and class bodies; imports inside functions and under ``if TYPE_CHECKING:`` run later
or never, and are left out unless --lazy), finds its strongly connected components, and
prints one circle of each. Exit status 1 when there is a circle, else 0.

An import of ``a.b.c`` is an edge to ``a.b.c`` only: the parent packages that Python
imports first are not edges (every module would otherwise close a circle through its
package's ``__init__``).

Usage::

    python scripts/importgraph.py                  # lbcomm/
    python scripts/importgraph.py --only lbcomm.reduce --lazy
"""
from __future__ import annotations

import argparse
import ast
import sys
from pathlib import Path
from typing import Dict, Iterable, List, Set


def module_names(root: Path) -> Dict[str, Path]:
    """Dotted name -> file for every .py file under the package directory `root`."""
    base = root.parent
    out = {}
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(base).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def extension_names(root: Path) -> Set[str]:
    """Dotted names of the compiled modules under `root` (leaves: they import nothing here)."""
    base = root.parent
    return {".".join(path.relative_to(base).parent.parts + (path.name.split(".")[0],))
            for pattern in ("*.so", "*.pyd") for path in root.rglob(pattern)}


def _eager(tree: ast.AST, lazy: bool) -> Iterable[ast.stmt]:
    """The import statements that run when the module is imported (all of them if lazy)."""
    stack = list(ast.iter_child_nodes(tree))
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
            continue
        if not lazy and isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            continue
        if not lazy and isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            stack.extend(node.orelse)
            continue
        stack.extend(ast.iter_child_nodes(node))


def imports_of(name: str, path: Path, modules: Dict[str, Path], lazy: bool, extensions: Set[str] = frozenset()
               ) -> Set[str]:
    """The modules of `modules` that module `name` imports (`extensions`: compiled ones)."""
    is_pkg = path.name == "__init__.py"
    package = name if is_pkg else name.rpartition(".")[0]
    found = set()
    for node in _eager(ast.parse(path.read_text(), str(path)), lazy):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        else:
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[:len(parts) - node.level + 1])
                target = f"{base}.{node.module}" if node.module else base
            else:
                target = node.module or ""
            # `from pkg import sub` imports the submodule; `from mod import name` the module
            subs = [f"{target}.{alias.name}" for alias in node.names]
            if all(t in extensions for t in subs):
                continue
            targets = [t for t in subs if t in modules] or [target]
        found.update(t for t in targets if t in modules and t != name)
    return found


def cycles(graph: Dict[str, Set[str]]) -> List[List[str]]:
    """One circle (a list of modules, the first repeated at the end) per strongly connected
    component of more than one module (Tarjan's algorithm, iterative)."""
    index: Dict[str, int] = {}
    low: Dict[str, int] = {}
    on_stack: Set[str] = set()
    stack: List[str] = []
    components = []
    counter = 0
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            v, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[v] = min(low[v], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    components.append(sorted(comp))
    return [_circle(graph, comp) for comp in components]


def _circle(graph: Dict[str, Set[str]], comp: List[str]) -> List[str]:
    """A shortest circle through the first module of a component (breadth first)."""
    members, first = set(comp), comp[0]
    parents = {first: None}
    queue = [first]
    while queue:
        v = queue.pop(0)
        for w in sorted(graph[v] & members):
            if w == first:
                path = [v]
                while parents[path[-1]] is not None:
                    path.append(parents[path[-1]])
                return path[::-1] + [first]
            if w not in parents:
                parents[w] = v
                queue.append(w)
    return comp + [first]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("root", nargs="?", default=str(Path(__file__).resolve().parent.parent / "lbcomm"),
                        help="the package directory (default: lbcomm/ of this checkout)")
    parser.add_argument("--only", default=None, help="report circles that touch this package only (dotted name)")
    parser.add_argument("--lazy", action="store_true", help="count imports inside functions too")
    args = parser.parse_args(argv)
    root = Path(args.root).resolve()
    modules, extensions = module_names(root), extension_names(root)
    graph = {name: imports_of(name, path, modules, args.lazy, extensions) for name, path in modules.items()}
    found = cycles(graph)
    if args.only:
        found = [c for c in found if any(m == args.only or m.startswith(args.only + ".") for m in c)]
    edges = sum(len(v) for v in graph.values())
    print(f"{len(modules)} modules, {edges} import edges ({'all' if args.lazy else 'at import time'}): "
          f"{len(found)} circle(s)")
    for circle in found:
        print("  " + " -> ".join(circle))
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
