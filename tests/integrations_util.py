"""Run an integration worker or recipe the way a user does: torchrun, 2 ranks, gloo on CPU."""
import os
import subprocess
import sys

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKERS = os.path.join(REPO, "tests", "integrations_workers")
RECIPES = os.path.join(REPO, "tests", "integrations_recipes")


def torchrun(script, *args, nproc=2, timeout=240, cwd=None):
    """`torchrun --standalone --nproc_per_node nproc script args...`; returns its output.
    torchrun sets MASTER_ADDR/PORT, RANK, WORLD_SIZE, LOCAL_RANK for the ranks."""
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1",
               TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", script,
           *map(str, args)]
    proc = subprocess.run(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          timeout=timeout)
    if proc.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout[-12000:]}")
    return proc.stdout


def results(out_dir, nproc=2):
    return [torch.load(os.path.join(out_dir, f"result-rank{r}.pt"), weights_only=False) for r in range(nproc)]


def assert_bitwise(a, b, what):
    """Two {path: tensor or scalar} maps are identical, bit for bit."""
    assert a.keys() == b.keys(), f"{what}: keys differ: {sorted(set(a) ^ set(b))[:10]}"
    for k in a:
        x, y = a[k], b[k]
        if isinstance(x, torch.Tensor):
            assert isinstance(y, torch.Tensor) and x.dtype == y.dtype and x.shape == y.shape, f"{what}{k}"
            assert torch.equal(x.view(-1).view(torch.uint8) if x.is_floating_point() else x,
                               y.view(-1).view(torch.uint8) if y.is_floating_point() else y), \
                f"{what}{k}: differs (max abs diff {(x.double() - y.double()).abs().max()})"
        else:
            assert x == y, f"{what}{k}: {x!r} != {y!r}"


def assert_same_shards(dir_a, dir_b, nproc=2):
    """Every rank's lbcomm shard (model, optimizer, extra) in dir_a equals the one in dir_b bit for bit."""
    from integrations_workers.common import tensors_of
    from lbcomm.checkpoint import shard_path

    for r in range(nproc):
        a = torch.load(shard_path(dir_a, r, nproc), weights_only=False)
        b = torch.load(shard_path(dir_b, r, nproc), weights_only=False)
        assert_bitwise(tensors_of(a), tensors_of(b), f"rank {r} shard ")


def run_recipe_and_resume(name, out):
    """Run a recipe to the end, then again resuming from its mid-compression checkpoint;
    returns both outputs. The recipes save their final state to final-<start>."""
    script = os.path.join(RECIPES, f"recipe_{name}.py")
    full = torchrun(script, out)
    resumed = torchrun(script, out, "--resume")
    return full, resumed
