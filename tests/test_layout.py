"""The layout of the code: the lab (lbcomm.cli, lbcomm.testing, scripts/) kept apart from
the library, no import circle inside the lab (the CLI, scripts, bench), and no module of
lbcomm, scripts, bench or tests over 450 lines. The import graph is scripts/importgraph.py's
(read with `ast`: nothing here imports the modules it checks)."""
import importlib.util
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


def _importgraph():
    """scripts/importgraph.py, the one implementation of the import graph and its circles."""
    spec = importlib.util.spec_from_file_location("importgraph", ROOT / "scripts" / "importgraph.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


IG = _importgraph()


def _graph(folder: str):
    """{module: the modules of `folder` it imports}, imports inside functions included (a
    deferred import is still a dependency)."""
    root = ROOT / folder
    modules, extensions = IG.module_names(root), IG.extension_names(root)
    return {n: IG.imports_of(n, p, modules, True, extensions) for n, p in modules.items()}


def _cycles(graph, within: str):
    """The circles among the modules named `within`*, the graph cut to them."""
    inside = {n for n in graph if n == within or n.startswith(within + ".")}
    return IG.cycles({n: graph[n] & inside for n in inside})


@pytest.mark.parametrize("package", ["lbcomm.cli", "lbcomm.testing"])
def test_no_import_circle(package):
    """No circle among a package's modules, counting the imports inside functions too (a
    deferred import is still a dependency)."""
    assert _cycles(_graph("lbcomm"), package) == []


@pytest.mark.parametrize("folder", ["scripts", "bench"])
def test_no_import_circle_in_the_lab(folder):
    assert _cycles(_graph(folder), folder) == []


def test_the_library_does_not_depend_on_the_lab():
    """No module of the library (lbcomm outside cli/ and testing/) imports lbcomm.cli or
    lbcomm.testing, even inside a function: the kernel fallback is not the test oracle."""
    graph = _graph("lbcomm")
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


@pytest.mark.parametrize("folder", ["lbcomm", "scripts", "bench", "tests"])
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
