"""The layout of the code: the lab (lbcomm.cli, lbcomm.testing, scripts/) kept apart from
the library, no import circle inside the benchmark CLI, and no module of lbcomm or scripts over 450
lines. Read with `ast` only: nothing here imports the modules it checks."""
import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
MAX_LINES = 450
# Library modules that still use a module of the lab, none of them when `import lbcomm` runs:
# lbcomm.demo (`python -m lbcomm.demo`) parses its sizes with the CLI's units parser;
# lbcomm.reference resolves its two deprecated names (the simulations that moved to
# lbcomm.testing.kernels in 0.3) on first use, in its module __getattr__.
KNOWN_LAB_USERS = {"lbcomm.demo": ["lbcomm.cli.units"], "lbcomm.reference": ["lbcomm.testing.kernels"]}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules(package: str):
    """{dotted name: path} of every .py file under ROOT/package."""
    return {_module_name(p): p for p in sorted((ROOT / package).rglob("*.py"))}


def _imports(name: str, path: Path, known, module_level_only: bool):
    """The modules of `known` that `name` imports (relative imports resolved; `from pkg
    import sub` counts as an import of pkg.sub when that is a module)."""
    tree = ast.parse(path.read_text(), str(path))
    is_pkg = path.name == "__init__.py"
    nodes = tree.body if module_level_only else list(ast.walk(tree))
    found = set()
    for node in nodes:
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".") if is_pkg else name.split(".")[:-1]
                base = base[:len(base) - (node.level - 1)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            targets = [f"{mod}.{a.name}" if f"{mod}.{a.name}" in known else mod for a in node.names]
        else:
            continue
        for t in targets:
            while t and t not in known:  # import a.b.c of a module a.b
                t = t.rpartition(".")[0]
            if t and t != name:
                found.add(t)
    return found


def _graph(packages, module_level_only):
    mods = {}
    for pkg in packages:
        mods.update(_modules(pkg))
    return {n: _imports(n, p, mods, module_level_only) for n, p in mods.items()}


def _cycles(graph, within: str):
    """Every strongly connected component (of more than one module) among the modules
    named `within`*, by Tarjan's algorithm."""
    nodes = [n for n in graph if n == within or n.startswith(within + ".")]
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in nodes:
                continue
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

    for v in nodes:
        if v not in index:
            visit(v)
    return out


@pytest.mark.parametrize("package", ["lbcomm.cli", "lbcomm.testing"])
def test_no_import_circle(package):
    """No circle among a package's modules, counting the imports inside functions too (a
    deferred import is still a dependency)."""
    graph = _graph(["lbcomm"], module_level_only=False)
    assert _cycles(graph, package) == []


def test_no_import_circle_in_scripts():
    graph = _graph(["scripts"], module_level_only=False)
    assert _cycles(graph, "scripts") == []


def test_the_library_does_not_depend_on_the_lab():
    """No module of the library (lbcomm outside cli/ and testing/) imports lbcomm.cli or
    lbcomm.testing, even inside a function: the kernel fallback is not the test oracle."""
    graph = _graph(["lbcomm"], module_level_only=False)
    lab = ("lbcomm.cli", "lbcomm.testing")
    bad = {n: sorted(d for d in deps if d.startswith(lab)) for n, deps in graph.items()
           if not n.startswith(lab) and any(d.startswith(lab) for d in deps)}
    assert bad == KNOWN_LAB_USERS


def test_import_lbcomm_loads_no_lab_module():
    code = ("import lbcomm, sys; print([m for m in sys.modules if m.startswith(('lbcomm.cli', 'lbcomm.testing', "
            "'bench'))])")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout


@pytest.mark.parametrize("folder", ["lbcomm", "scripts"])
def test_no_module_is_over_450_lines(folder):
    long = {str(p.relative_to(ROOT)): n for p in sorted((ROOT / folder).rglob("*.py"))
            if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert long == {}


# lbcomm.__all__ of 0.2: every name must still resolve on lbcomm (the hooks are grouped in lbcomm.hooks)
NAMES_0_2 = ["OneBitAdam", "OneBitLamb", "ZeroOneAdam", "Lamb", "Lars", "DecentLaM", "DmSGD", "OneBitLocalUpdates",
             "local_gradients_hook", "CommConfig", "OneBitHookState", "onebit_hook", "WarmupAverage",
             "warmup_average_hook", "DCTHookState", "dct_hook", "DCTBoundary", "OneBitHSDPState", "onebit_hsdp",
             "Reducer", "make_reducer", "CompressionState", "HierarchicalState", "Topology", "compressed_allreduce_",
             "compressed_allreduce", "NonFiniteError", "save_sharded", "load_sharded", "attach"]


def test_the_top_level_reads_at_a_glance_and_keeps_the_0_2_names():
    import lbcomm
    import lbcomm.hooks

    assert len(lbcomm.__all__) <= 20, lbcomm.__all__
    assert all(hasattr(lbcomm, n) for n in lbcomm.__all__)
    assert [n for n in NAMES_0_2 if not hasattr(lbcomm, n)] == []
    for n in lbcomm.hooks.__all__:  # one object under both names
        assert getattr(lbcomm.hooks, n) is getattr(lbcomm, n)
