"""Resumes that would go wrong silently: a shard's hook state left out of `load_sharded`
(`MissingHookStateWarning`), and an optimizer state dict loaded into another lbcomm
optimizer class (one `ValueError` naming both classes).

Everything runs in ONE spawn of two real gloo ranks (`two_ranks`, module scope): the
decentralized optimizers need two ranks; every test reads its part of the result."""
import os
import tempfile
import warnings

import pytest
import torch
from torch import nn

import lbcomm
from lbcomm.ddp import MissingHookStateWarning
from lbcomm.optim import BaseOptimizer
from dist_util import run_ranks


# every lbcomm optimizer class: its options, 1-bit stages frozen after two steps
KW = {
    "OneBitAdam": dict(lr=1e-3, freeze_step=2),
    "OneBitLamb": dict(lr=1e-3, freeze_step=2),
    "ZeroOneAdam": dict(lr=1e-3, var_freeze_step=2),
    "Lamb": dict(lr=1e-3),
    "Lars": dict(lr=1e-2),
    "DecentLaM": dict(lr=1e-2),
    "DmSGD": dict(lr=1e-2),
}
STEPS = 4


def _optimizer_classes():
    """Every BaseOptimizer subclass that lbcomm.optim defines."""
    found, todo = {}, list(BaseOptimizer.__subclasses__())
    while todo:
        cls = todo.pop(0)
        if cls.__module__.startswith("lbcomm.optim"):
            found[cls.__name__] = cls
        todo.extend(cls.__subclasses__())
    return found


def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(12, 24), nn.Tanh(), nn.Linear(24, 5))


def _steps(model, opt, rank, steps):
    for t in range(steps):
        x = torch.randn(8, 12, generator=torch.Generator().manual_seed(1000 * rank + t))
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()


def _load(load):
    """The MissingHookStateWarning messages of one load_sharded call."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        load()
    return [str(w.message) for w in caught if issubclass(w.category, MissingHookStateWarning)]


def _local_updates(rank, ckpt):
    def build():
        model = _mlp()
        inner = torch.optim.AdamW(model.parameters(), lr=1e-2)
        return model, inner, lbcomm.OneBitLocalUpdates(model.parameters(), inner, sync_every=2)

    model, inner, local = build()
    for t in range(2):  # one round: the save is at a synchronization
        x = torch.randn(8, 12, generator=torch.Generator().manual_seed(1000 * rank + t))
        inner.zero_grad()
        model(x).square().mean().backward()
        inner.step()
        local.step()
    lbcomm.save_sharded(ckpt, inner, model, hook_state=local)
    saved = local.state_dict()
    out = {}
    model, inner, local = build()
    out["without"] = _load(lambda: lbcomm.load_sharded(ckpt, inner, model))
    out["with"] = _load(lambda: lbcomm.load_sharded(ckpt, inner, model, hook_state=local))
    out["restored"] = local.state_dict()["syncs"] == saved["syncs"] == 1
    out["model_only"] = _load(lambda: lbcomm.load_sharded(ckpt, model=_mlp()))
    # a shard written before save_sharded recorded the hook state's class
    path = lbcomm.checkpoint.shard_path(ckpt, rank, 2)
    payload = torch.load(path, weights_only=True)
    payload.pop("hook_state_type", None)
    torch.save(payload, path)
    model, inner, local = build()
    out["untyped"] = _load(lambda: lbcomm.load_sharded(ckpt, inner, model))
    return out


def _hook_state(rank, ckpt):
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    lbcomm.save_sharded(ckpt, opt, model, hook_state=lbcomm.OneBitHookState(start_iter=2))
    out = {"without": _load(lambda: lbcomm.load_sharded(ckpt, opt, model)),
           "with": _load(lambda: lbcomm.load_sharded(ckpt, opt, model, hook_state=lbcomm.OneBitHookState(2)))}
    # saved without a hook state: nothing to warn about
    plain = ckpt + "-plain"
    lbcomm.save_sharded(plain, opt, model)
    out["none_saved"] = _load(lambda: lbcomm.load_sharded(plain, opt, model))
    return out


def _try_load(opt, sd):
    try:
        opt.load_state_dict(sd)
    except Exception as e:  # noqa: BLE001 - the test reads the type and the message
        return type(e).__name__, str(e)
    return None


def _optimizers(rank):
    classes = _optimizer_classes()
    saved = {}
    for name, cls in classes.items():
        model = _mlp()
        opt = cls(model.parameters(), **KW[name])
        _steps(model, opt, rank, STEPS)
        saved[name] = opt.state_dict()
    out = {"pairs": {}, "same": {}}
    for a in classes:
        for b, cls in classes.items():
            opt = cls(_mlp().parameters(), **KW[b])
            (out["same"] if a == b else out["pairs"])[(a, b)] = _try_load(opt, saved[a])
    # a state dict written before the "lbcomm" entry named its class: the older checks
    old = dict(saved["OneBitAdam"], lbcomm={k: v for k, v in saved["OneBitAdam"]["lbcomm"].items() if k != "class"})
    out["old_adam_into_lamb"] = _try_load(lbcomm.OneBitLamb(_mlp().parameters(), **KW["OneBitLamb"]), old)
    # torch's AdamW
    model = _mlp()
    adamw = torch.optim.AdamW(model.parameters(), lr=1e-3)
    _steps(model, adamw, rank, 2)
    out["adamw_into_onebit_adam"] = _try_load(lbcomm.OneBitAdam(_mlp().parameters(), **KW["OneBitAdam"]),
                                              adamw.state_dict())
    return out


def _ranks(rank, p, d):
    return {"local": _local_updates(rank, os.path.join(d, "local")), "hook": _hook_state(rank, os.path.join(d, "hook")),
            "optim": _optimizers(rank)}


@pytest.fixture(scope="module")
def two_ranks():
    with tempfile.TemporaryDirectory() as d:
        return run_ranks(_ranks, 2, d, timeout=300)


def test_local_updates_state_left_out_of_load_sharded_warns(two_ranks):
    for r in range(2):
        res = two_ranks[r]["local"]
        assert len(res["without"]) == 1, res["without"]
        msg = res["without"][0]
        assert "OneBitLocalUpdates" in msg and "hook_state=" in msg and f"shard-{r:05d}-of-00002.pt" in msg
        assert res["with"] == [] and res["restored"]
        assert res["model_only"] == []  # the weights alone: a restart, not a resume
        assert len(res["untyped"]) == 1 and "hook_state=" in res["untyped"][0]


def test_onebit_hook_state_left_out_of_load_sharded_warns(two_ranks):
    for r in range(2):
        res = two_ranks[r]["hook"]
        assert len(res["without"]) == 1 and "OneBitHookState" in res["without"][0]
        assert "hook_state=" in res["without"][0]
        assert res["with"] == [] and res["none_saved"] == []


def test_every_optimizer_class_is_covered():
    assert set(_optimizer_classes()) == set(KW)


def test_state_dict_into_another_optimizer_class_names_both(two_ranks):
    for r in range(2):
        res = two_ranks[r]["optim"]
        assert len(res["pairs"]) == len(KW) * (len(KW) - 1)
        for (saver, loader), raised in res["pairs"].items():
            assert raised is not None, f"{saver} -> {loader} loaded"
            kind, msg = raised
            assert kind == "ValueError", (saver, loader, msg)
            assert f"saved by {saver}" in msg and f"loaded into {loader}" in msg, msg
            assert f"load it into {saver}" in msg, msg
        assert all(v is None for v in res["same"].values()), res["same"]


def test_old_or_foreign_state_dicts_are_refused_cleanly(two_ranks):
    for r in range(2):
        res = two_ranks[r]["optim"]
        kind, msg = res["old_adam_into_lamb"]
        assert kind == "ValueError" and "another optimizer class" in msg, msg
        kind, msg = res["adamw_into_onebit_adam"]
        assert kind == "ValueError" and "OneBitAdam" in msg and "not saved by an lbcomm optimizer" in msg, msg
