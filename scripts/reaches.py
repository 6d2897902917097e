#!/usr/bin/env python3
"""Count reaches into other objects' private attributes.

A reach is an attribute access ``X._name`` (one leading underscore, not a dunder) whose
object ``X`` is not the object's own (``self``, ``cls``, ``super()``, or the name of a
class the access is written in) and not a module imported in the same file (``torch._C``,
``F._helper`` with ``from . import functional as F`` are module attributes, not object
reaches). Stdlib only.

Usage::

    python scripts/reaches.py lbcomm            # per-file counts and the total
    python scripts/reaches.py lbcomm --list     # every site, file:line: expression
    python scripts/reaches.py lbcomm/optim a.py # several paths
"""
from __future__ import annotations

import argparse
import ast
import os
import sys
from typing import Iterator, List, Set, Tuple

OWN = {"self", "cls"}


def _is_private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__") and len(name) > 1


def _module_names(tree: ast.AST) -> Set[str]:
    """Names the file's imports bind to modules: every ``import a.b [as c]`` (``a``, ``c``),
    and every ``from x import y [as z]`` whose name is only ever used as ``y.attr`` (never
    called, subclassed or passed on, as a class or function would be): ``F`` of
    ``from . import functional as F``."""
    plain: Set[str] = set()
    imported: Set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                plain.add(a.asname or a.name.split(".")[0])
        elif isinstance(node, ast.ImportFrom):
            for a in node.names:
                if a.name != "*":
                    imported.add(a.asname or a.name)
    attr_bases = {id(node.value) for node in ast.walk(tree)
                  if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)}
    used_otherwise = {node.id for node in ast.walk(tree)
                      if isinstance(node, ast.Name) and node.id in imported and id(node) not in attr_bases}
    return plain | (imported - used_otherwise)


def _root(node: ast.AST) -> ast.AST:
    while isinstance(node, ast.Attribute):
        node = node.value
    return node


class _Finder(ast.NodeVisitor):
    """Collects the reaches of one module, knowing the classes it is inside (``Name._x``
    where Name is an enclosing class is the class's own attribute, as ``super()._x`` is)."""

    def __init__(self, src: str, modules: Set[str]):
        self.src, self.modules = src, modules
        self.classes: List[str] = []
        self.found: List[Tuple[int, int, str]] = []

    def visit_ClassDef(self, node: ast.ClassDef) -> None:
        self.classes.append(node.name)
        self.generic_visit(node)
        self.classes.pop()

    def visit_Attribute(self, node: ast.Attribute) -> None:
        if _is_private(node.attr) and not self._own(node.value):
            self.found.append((node.lineno, node.col_offset, ast.get_source_segment(self.src, node) or node.attr))
        self.generic_visit(node)

    def _own(self, base: ast.AST) -> bool:
        if isinstance(base, ast.Name) and (base.id in OWN or base.id in self.classes):
            return True
        if isinstance(base, ast.Call) and isinstance(base.func, ast.Name) and base.func.id == "super":
            return True
        root = _root(base)  # torch._C, torch.nn._reduction: an attribute of a module
        return isinstance(root, ast.Name) and root.id in self.modules


def reaches(path: str) -> Iterator[Tuple[int, str]]:
    """(line, source text) of each reach in one file."""
    with open(path, encoding="utf-8") as fh:
        src = fh.read()
    try:
        tree = ast.parse(src, filename=path)
    except SyntaxError as exc:  # pragma: no cover - a broken file is reported, not counted
        print(f"{path}: cannot parse ({exc})", file=sys.stderr)
        return
    finder = _Finder(src, _module_names(tree))
    finder.visit(tree)
    for line, _, text in sorted(finder.found):
        yield line, text


def files(paths: List[str]) -> Iterator[str]:
    for p in paths:
        if os.path.isdir(p):
            for root, dirs, names in os.walk(p):
                dirs[:] = sorted(d for d in dirs if not d.startswith(".") and d != "__pycache__")
                for n in sorted(names):
                    if n.endswith(".py"):
                        yield os.path.join(root, n)
        else:
            yield p


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("paths", nargs="+", help="files or directories")
    ap.add_argument("--list", action="store_true", help="print every site")
    args = ap.parse_args(argv)
    total = 0
    for path in files(args.paths):
        sites = list(reaches(path))
        if not sites:
            continue
        total += len(sites)
        print(f"{len(sites):5d}  {path}")
        if args.list:
            for line, text in sites:
                print(f"         {path}:{line}: {text}")
    print(f"{total:5d}  total")
    return 0


if __name__ == "__main__":
    sys.exit(main())
