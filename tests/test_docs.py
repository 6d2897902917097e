"""The user guide builds, and every code block in README.md and docs/*.md runs.

* `mkdocs build --strict` (broken links, anchors, snippets and docstrings fail it).
* Every fenced block of README.md and docs/*.md is checked:
  - ```python blocks run: as a script in a temporary directory, or, when they set up a
    process group (`init_process_group`), under
    `python -m torch.distributed.run --standalone --nproc-per-node 2` (gloo, 1 thread);
  - shell blocks (bash, sh, console or no language) may only hold commands of
    `lbcomm-bench` (parsed by its own argument parser), `python -m bench.NAME` and
    `scripts/gpu-check` (their `--help` must list every option the command uses), and
    every command runs (slow tier; those on an emulated cluster where one can be built),
    in a temporary directory, and must exit 0;
  - a shell block that cannot run here (it needs a GPU, or takes longer than a test may)
    carries `<!-- parse-only: reason -->` instead: its commands are parsed and checked
    against `--help` but not run;
  - a block whose only content is a snippet include (`--8<-- "path"`) must name an
    existing file;
  - a block that is not meant to run (install lines, output samples, fragments) carries
    `<!-- not-run: reason -->` on the line(s) right before its fence; any other
    unmarked block fails.
  README.md's demo and test commands (between `<!-- demo-command -->` /
  `<!-- test-command -->` and their closing markers) run in CI itself, and its recipes
  (between `<!-- recipe: NAME -->` and `<!-- /recipe -->`) are checked by
  test_integrations_recipes.py: both are skipped here.
"""
import glob
import os
import re
import shlex
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOC_FILES = ["README.md"] + sorted(os.path.relpath(p, REPO) for p in glob.glob(os.path.join(REPO, "docs", "*.md")))

FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>`{3,}|~{3,})[ \t]*(?P<info>[^`\n]*)$")
NOT_RUN = re.compile(r"^\s*<!--\s*not-run:\s*(?P<reason>\S.*?)\s*-->\s*$")
PARSE_ONLY = re.compile(r"^\s*<!--\s*parse-only:\s*(?P<reason>\S.*?)\s*-->\s*$")
REGION_OPEN = re.compile(r"^\s*<!--\s*(demo-command|test-command|recipe:\s*[\w-]+)\s*-->\s*$")
REGION_CLOSE = {"demo-command": "<!-- /demo-command -->", "test-command": "<!-- /test-command -->",
                "recipe": "<!-- /recipe -->"}
SNIPPET = re.compile(r'^\s*-{1,}8<-{1,}\s+"(?P<path>[^"]+)"\s*$')
SHELL_LANGS = {"", "bash", "sh", "shell", "console", "shell-session"}
PYTHON_LANGS = {"python", "py", "python3"}
TIMEOUT = 150  # seconds per block; a block should take a few
SHELL_TIMEOUT = 420  # seconds per shell command (benchmarks on 2 busy cores)


class Block:
    def __init__(self, path, line, lang, code, not_run, parse_only=None):
        self.path, self.line, self.lang, self.code, self.not_run = path, line, lang, code, not_run
        self.parse_only = parse_only

    @property
    def id(self):
        return f"{self.path}:{self.line}"

    @property
    def kind(self):
        if self.not_run is not None:
            return "not-run"
        lines = [ln for ln in self.code.splitlines() if ln.strip()]
        if lines and all(SNIPPET.match(ln) for ln in lines):
            return "snippet"
        if self.lang in PYTHON_LANGS:
            return "torchrun" if "init_process_group" in self.code else "python"
        if self.lang in SHELL_LANGS:
            return "shell"
        return "unknown"


def extract_blocks(path):
    """The fenced code blocks of one markdown file (outside the skipped regions)."""
    with open(os.path.join(REPO, path)) as f:
        lines = f.read().splitlines()
    blocks, i, region = [], 0, None
    while i < len(lines):
        line = lines[i]
        if region is not None:
            if line.strip() == region:
                region = None
            i += 1
            continue
        m = REGION_OPEN.match(line)
        if m:
            region = REGION_CLOSE[m.group(1).split(":")[0]]
            i += 1
            continue
        m = FENCE.match(line)
        if not m:
            i += 1
            continue
        indent, fence = m.group("indent"), m.group("fence")
        lang = m.group("info").strip().split(" ")[0].lstrip(".").lower() if m.group("info").strip() else ""
        body, j = [], i + 1
        while j < len(lines):
            s = lines[j]
            if s.strip().startswith(fence[0] * len(fence)) and s.strip().strip(fence[0]) == "":
                break
            body.append(s[len(indent):] if s.startswith(indent) else s.lstrip())
            j += 1
        k = i - 1
        while k >= 0 and not lines[k].strip():
            k -= 1
        mark = NOT_RUN.match(lines[k]) if k >= 0 else None
        parse = PARSE_ONLY.match(lines[k]) if k >= 0 else None
        blocks.append(Block(path, i + 1, lang, "\n".join(body) + "\n", mark.group("reason") if mark else None,
                            parse.group("reason") if parse else None))
        i = j + 1
    assert region is None, f"{path}: a region marker is not closed ({region} missing)"
    return blocks


ALL_BLOCKS = [b for p in DOC_FILES for b in extract_blocks(p)]


def _env():
    env = dict(os.environ)
    env["OMP_NUM_THREADS"] = "1"
    env["PYTHONPATH"] = REPO + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.setdefault("NO_MKDOCS_2_WARNING", "1")
    return env


def _run(cmd, cwd, what):
    try:
        proc = subprocess.run(cmd, cwd=cwd, env=_env(), capture_output=True, text=True, timeout=TIMEOUT)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"{what}: timed out after {TIMEOUT} s\n{exc.stdout or ''}\n{exc.stderr or ''}")
    assert proc.returncode == 0, f"{what}: exit status {proc.returncode}\n{proc.stdout[-4000:]}\n{proc.stderr[-6000:]}"
    return proc.stdout + proc.stderr


# ---------------------------------------------------------------------------- mkdocs


def test_mkdocs_build_strict(tmp_path):
    pytest.importorskip("mkdocs", reason="mkdocs is not installed (pip install mkdocs mkdocs-material mkdocstrings-python)")
    pytest.importorskip("material", reason="mkdocs-material is not installed")
    pytest.importorskip("mkdocstrings_handlers.python", reason="mkdocstrings-python is not installed")
    out = _run([sys.executable, "-m", "mkdocs", "build", "--strict", "-q", "-d", str(tmp_path / "site")], REPO,
               "mkdocs build --strict")
    assert "WARNING" not in out, out
    assert (tmp_path / "site" / "index.html").exists()
    assert (tmp_path / "site" / "api" / "index.html").exists()


# ---------------------------------------------------------------------------- the blocks


def test_blocks_found():
    assert any(b.path.startswith("docs") for b in ALL_BLOCKS), "no code block found under docs/"


PYTHON_BLOCKS = [b for b in ALL_BLOCKS if b.kind in ("python", "torchrun")]
_POOL = None
_FUTURES = {}


def _launch(block, workdir):
    script = os.path.join(workdir, "block.py")
    with open(script, "w") as f:
        f.write(block.code)
    if block.kind == "torchrun":
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", script]
    else:
        cmd = [sys.executable, script]
    try:
        proc = subprocess.run(cmd, cwd=workdir, env=_env(), capture_output=True, text=True, timeout=TIMEOUT)
    except subprocess.TimeoutExpired as exc:
        return None, f"{exc.stdout or ''}\n{exc.stderr or ''}"
    return proc.returncode, proc.stdout + proc.stderr


def _block_result(block, request):
    """The selected blocks start together on first use, two at a time (most of a block's
    time is importing torch), and each test waits for its own."""
    global _POOL
    if _POOL is None:
        from concurrent.futures import ThreadPoolExecutor

        _POOL = ThreadPoolExecutor(max_workers=2)
        factory = request.getfixturevalue("tmp_path_factory")
        selected = [getattr(item, "callspec", None) for item in request.session.items]
        selected = [c.params["block"] for c in selected if c is not None and isinstance(c.params.get("block"), Block)]
        for b in [b for b in selected if b.kind in ("python", "torchrun")] or [block]:
            _FUTURES[b.id] = _POOL.submit(_launch, b, str(factory.mktemp("block")))
    if block.id not in _FUTURES:
        _FUTURES[block.id] = _POOL.submit(_launch, block, str(request.getfixturevalue("tmp_path_factory").mktemp("block")))
    return _FUTURES[block.id].result()


@pytest.mark.parametrize("block", PYTHON_BLOCKS, ids=lambda b: b.id)
def test_python_block_runs(block, request):
    rc, out = _block_result(block, request)
    how = "under torch.distributed.run, 2 ranks" if block.kind == "torchrun" else "as a script"
    assert rc is not None, f"{block.id} ({how}): timed out after {TIMEOUT} s\n{out[-8000:]}"
    assert rc == 0, f"{block.id} ({how}): exit status {rc}\n{out[-8000:]}"


@pytest.mark.parametrize("block", [b for b in ALL_BLOCKS if b.kind == "snippet"], ids=lambda b: b.id)
def test_snippet_block_names_a_file(block):
    for line in block.code.splitlines():
        m = SNIPPET.match(line)
        if m:
            assert os.path.isfile(os.path.join(REPO, m.group("path"))), f"{block.id}: {m.group('path')} does not exist"


def test_every_block_is_run_or_marked():
    bad = [f"{b.id} (```{b.lang})" for b in ALL_BLOCKS if b.kind == "unknown"]
    assert not bad, ("blocks that are neither python, a known shell command nor marked "
                     "<!-- not-run: reason -->: " + ", ".join(bad))


def shell_commands(block):
    """(argv, text) of every command of a shell block; continuation lines joined, comments,
    prompts, `sudo` and leading VAR=value assignments dropped."""
    joined, cur = [], ""
    for line in block.code.splitlines():
        s = line.rstrip()
        if s.startswith("$ "):
            s = s[2:]
        if s.endswith("\\"):
            cur += s[:-1] + " "
            continue
        joined.append(cur + s)
        cur = ""
    if cur:
        joined.append(cur)
    out = []
    for text in joined:
        argv = shlex.split(text, comments=True)
        while argv and (argv[0] == "sudo" or re.match(r"^[A-Za-z_][A-Za-z0-9_]*=", argv[0])):
            argv = argv[1:]
        if argv:
            out.append((argv, text.strip()))
    return out


def _classify(argv):
    py = os.path.basename(argv[0]) in ("python", "python3")
    if argv[0] == "lbcomm-bench":
        return "lbcomm-bench", argv[1:]
    if py and argv[1:3] == ["-m", "lbcomm.cli"]:
        return "lbcomm-bench", argv[3:]
    if py and len(argv) > 2 and argv[1] == "-m" and argv[2].startswith("bench."):
        return argv[2], argv[3:]
    if argv[0] in ("scripts/gpu-check", "./scripts/gpu-check"):
        return "scripts/gpu-check", argv[1:]
    return None, argv


SHELL_BLOCKS = [b for b in ALL_BLOCKS if b.kind == "shell"]


def test_shell_blocks_are_known_commands():
    bad = []
    for b in SHELL_BLOCKS:
        for argv, text in shell_commands(b):
            if _classify(argv)[0] is None:
                bad.append(f"{b.id}: {text}")
    assert not bad, ("shell blocks may hold only lbcomm-bench, python -m bench.NAME and scripts/gpu-check "
                     "commands; mark the others <!-- not-run: reason -->:\n" + "\n".join(bad))


def _options(args):
    return sorted({a.split("=", 1)[0] for a in args if a.startswith("--")} - {"--help"})


def test_lbcomm_bench_commands_parse():
    cmds = [(b.id, args) for b in SHELL_BLOCKS for argv, _ in shell_commands(b)
            for tool, args in [_classify(argv)] if tool == "lbcomm-bench"]
    if not cmds:
        pytest.skip("no lbcomm-bench command in the docs")
    code = ("import json, sys\nfrom lbcomm.cli.args import build_parser\n"
            "for where, args in json.loads(sys.argv[1]):\n"
            "    try:\n        build_parser().parse_args(args)\n"
            "    except SystemExit as e:\n"
            "        if e.code:\n            sys.exit(f'{where}: lbcomm-bench {\" \".join(args)}: does not parse')\n")
    import json

    _run([sys.executable, "-c", code, json.dumps(cmds)], REPO, "lbcomm-bench commands")


def _module_commands():
    found = {}
    for b in SHELL_BLOCKS:
        for argv, _ in shell_commands(b):
            tool, args = _classify(argv)
            if tool not in (None, "lbcomm-bench"):
                found.setdefault(tool, []).append((b.id, args))
    return sorted(found.items())


@pytest.mark.parametrize("tool,uses", _module_commands(), ids=lambda x: x if isinstance(x, str) else "")
def test_script_options_exist(tool, uses):
    if tool == "scripts/gpu-check":
        cmd = [os.path.join(REPO, "scripts", "gpu-check"), "--help"]
    else:
        cmd = [sys.executable, "-m", tool, "--help"]
    help_text = _run(cmd, REPO, f"{tool} --help")
    for where, args in uses:
        for opt in _options(args):
            assert opt in help_text, f"{where}: {tool} has no option {opt} (its --help does not list it)"


def _on_cluster(tool, args):
    """Whether a command builds an emulated cluster (network namespaces; root)."""
    if tool in ("bench.hier_stages", "bench.train_profile"):
        return True
    if tool != "lbcomm-bench":
        return False
    rates = [a.split("=", 1)[1] if "=" in a else args[i + 1] for i, a in enumerate(args)
             if a.split("=", 1)[0] == "--bandwidth" and ("=" in a or i + 1 < len(args))]
    measures = args[:1] in (["model"], ["model-nodes"]) and "--from-json" not in args  # calibration runs
    return "--nodes" in args or any(r != "none" for r in rates) or measures


def _command_line(tool, args):
    if tool == "lbcomm-bench":
        return [sys.executable, "-m", "lbcomm.cli"] + args
    if tool == "scripts/gpu-check":
        return [os.path.join(REPO, "scripts", "gpu-check")] + args
    return [sys.executable, "-m", tool] + args


@pytest.mark.parametrize("block", [b for b in SHELL_BLOCKS if b.parse_only is None], ids=lambda b: b.id)
def test_shell_block_runs(block, tmp_path):
    """Each command of the block runs as written (`sudo` dropped: the tests run as root
    where an emulated cluster can be built), in a temporary directory, and exits 0."""
    commands = [_classify(argv) for argv, _ in shell_commands(block)]
    if any(_on_cluster(tool, args) for tool, args in commands):
        from lbcomm.cli import netns

        ok, why = netns.available()
        if not ok:
            pytest.skip(f"emulated cluster unavailable: {why}")
    for (tool, args), (_, text) in zip(commands, shell_commands(block)):
        cmd = _command_line(tool, args)
        try:
            proc = subprocess.run(cmd, cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=SHELL_TIMEOUT)
        except subprocess.TimeoutExpired as exc:
            pytest.fail(f"{block.id}: `{text}` timed out after {SHELL_TIMEOUT} s; shorten it or mark the block "
                        f"<!-- parse-only: reason -->\n{exc.stdout or ''}\n{exc.stderr or ''}")
        assert proc.returncode == 0, (f"{block.id}: `{text}` exited {proc.returncode}\n{proc.stdout[-12000:]}\n"
                                      f"{proc.stderr[-12000:]}")


def test_not_run_markers_have_reasons():
    for path in DOC_FILES:
        with open(os.path.join(REPO, path)) as f:
            for n, line in enumerate(f, 1):
                if "not-run" in line and "<!--" in line:
                    assert NOT_RUN.match(line), f"{path}:{n}: write the marker as <!-- not-run: reason -->"
                if "parse-only" in line and "<!--" in line:
                    assert PARSE_ONLY.match(line), f"{path}:{n}: write the marker as <!-- parse-only: reason -->"


def test_parse_only_blocks_are_shell_commands():
    bad = [b.id for b in ALL_BLOCKS if b.parse_only is not None and b.kind != "shell"]
    assert not bad, "<!-- parse-only --> marks shell blocks of known commands only: " + ", ".join(bad)


def test_no_references_outside_the_repository():
    pattern = re.compile(r"DESIGN\.md|\bissue \d+|\bshared/|\.\./")
    for path in [p for p in DOC_FILES if p.startswith("docs")] + ["mkdocs.yml"]:
        with open(os.path.join(REPO, path)) as f:
            for n, line in enumerate(f, 1):
                assert not pattern.search(line), f"{path}:{n}: refers outside the repository: {line.strip()}"


def test_recipes_are_included_not_copied():
    """docs/integrations.md includes the tested recipe files instead of holding copies."""
    with open(os.path.join(REPO, "docs", "integrations.md")) as f:
        text = f.read()
    for name in ("trainer", "accelerate", "lightning", "torchrun_ddp", "dcp"):
        assert f'--8<-- "tests/integrations_recipes/recipe_{name}.py"' in text, name
