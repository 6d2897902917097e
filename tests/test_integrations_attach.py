"""lbcomm.integrations.attach: finds the DDP through wrappers, registers the right hook,
and refuses what would not compress (2 real gloo ranks; no framework needed)."""
import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

import lbcomm
from dist_util import run_ranks
from lbcomm.errors import DoubleCompressionError
from lbcomm.integrations import attach, find_ddp


def _cases(rank, p):
    torch.manual_seed(0)
    out = {}
    ddp = DDP(torch.nn.Linear(8, 8))
    opt = lbcomm.OneBitAdam(ddp.parameters(), lr=1e-3, freeze_step=2)
    compiled = torch.compile(ddp)  # an OptimizedModule around the DDP (nothing compiled until called)
    out["found_through_compile"] = find_ddp(compiled) is ddp
    out["attached"] = attach(compiled, opt) is ddp
    out["again_is_noop"] = attach(ddp, opt) is ddp
    for name, call in {
        "other_state": lambda: attach(ddp, lbcomm.OneBitHookState(start_iter=2)),
        "no_ddp": lambda: attach(torch.nn.Linear(2, 2), opt),
        "adamw": lambda: attach(ddp, torch.optim.AdamW(ddp.parameters())),
        "object": lambda: attach(ddp, object()),
        "optimizer_twice": lambda: attach(ddp, opt, optimizer=opt),
    }.items():
        try:
            call()
            out[name] = None
        except (TypeError, ValueError) as exc:
            out[name] = f"{type(exc).__name__}: {exc}"
    # A OneBitHookState on a fresh DDP: gradients go through onebit_hook, bitwise equal on every rank.
    ddp2 = DDP(torch.nn.Linear(64, 64))
    sgd = torch.optim.SGD(ddp2.parameters(), lr=0.1, momentum=0.9)
    try:  # another momentum than the SGD's: refused before anything is registered
        attach(ddp2, lbcomm.OneBitHookState(start_iter=2, momentum=0.5), optimizer=sgd)
        out["momentum_mismatch"] = None
    except ValueError as exc:
        out["momentum_mismatch"] = str(exc)
    out["hooks_after_refusal"] = len(getattr(ddp2, "_comm_hooks", []))
    state = lbcomm.OneBitHookState(2, comm=lbcomm.CommConfig(exact_numel=0))  # a 64 x 64 layer: compress it all
    attach(ddp2, state, optimizer=sgd)  # SGD momentum under the default state: a hint, not an error
    for it in range(4):
        ddp2.zero_grad()
        ddp2(torch.randn(4, 64, generator=torch.Generator().manual_seed(10 * rank + it))).square().sum().backward()
    out["hook_grad"] = ddp2.module.weight.grad.clone()
    out["hook_calls"] = state.compression_stats()["compressed_calls"]
    return out


def test_attach_on_two_ranks():
    r = run_ranks(_cases, 2)
    for res in r:
        assert res["found_through_compile"] and res["attached"] and res["again_is_noop"]
        assert res["other_state"].startswith("ValueError") and "already has a communication hook" in res["other_state"]
        assert res["no_ddp"].startswith("ValueError") and "found no DistributedDataParallel" in res["no_ddp"]
        assert res["adamw"].startswith("TypeError") and "OneBitHookState" in res["adamw"]
        assert res["object"].startswith("TypeError")
        assert res["optimizer_twice"].startswith("TypeError") and "optimizer= is for a OneBitHookState" in \
            res["optimizer_twice"]
        assert "must equal the SGD's momentum" in res["momentum_mismatch"] and res["hooks_after_refusal"] == 0
        assert res["hook_calls"] == 2  # iterations 3 and 4 were compressed
    assert torch.equal(r[0]["hook_grad"], r[1]["hook_grad"])


def test_attach_single_process_is_a_noop(caplog):
    model = torch.nn.Linear(4, 4)
    opt = lbcomm.OneBitAdam(model.parameters(), lr=1e-3, freeze_step=2)
    with caplog.at_level("INFO", logger="lbcomm.integrations.attach"):
        assert attach(model, opt) is None
    assert "nothing is attached" in caplog.text
    with pytest.raises(TypeError, match="OneBitHookState"):
        attach(model, torch.optim.SGD(model.parameters(), lr=0.1))
    sgd = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    with pytest.raises(ValueError, match="must equal the SGD's momentum"):  # checked with one process too
        attach(model, lbcomm.OneBitHookState(momentum=0.5), optimizer=sgd)
    for onebit in (lbcomm.OneBitAdam(model.parameters(), lr=1e-3, freeze_step=2),  # checked before any DDP is
                   lbcomm.OneBitLamb(model.parameters(), lr=1e-3, freeze_step=2),  # looked for
                   lbcomm.ZeroOneAdam(model.parameters(), lr=1e-3)):
        name = type(onebit).__name__
        with pytest.raises(DoubleCompressionError, match=rf"lbcomm.{name} compresses.*attach\(model, opt\)"):
            attach(model, lbcomm.OneBitHookState(), optimizer=onebit)
        with pytest.raises(DoubleCompressionError):  # also inside a list (Lightning's trainer.optimizers)
            attach(model, lbcomm.OneBitHookState(), optimizer=[sgd, onebit])
    with pytest.raises(ValueError, match="lbcomm.Lamb averages its gradients itself"):
        attach(model, lbcomm.OneBitHookState(), optimizer=lbcomm.Lamb(model.parameters()))
    caplog.clear()
    with caplog.at_level("INFO", logger="lbcomm.integrations.attach"):
        assert attach(model, lbcomm.OneBitHookState(momentum=0.9, normalize="adaptive"), optimizer=sgd) is None
        assert "compresses the momentum instead" not in caplog.text
        attach(model, lbcomm.OneBitHookState(), optimizer=sgd)
    assert "lbcomm.attach: SGD with momentum 0.9 under a hook that compresses gradients" in caplog.text


def test_hook_momentum_must_be_the_sgds(caplog):
    """OneBitHookState(momentum=mu) hands SGD m^_t - mu m^_(t-1): right only for SGD(momentum=mu).
    The callbacks check it through wrappers (accelerate/Lightning keep the SGD in .optimizer)."""
    from lbcomm.integrations.attach import check_hook_momentum

    class Wrapper(torch.optim.Optimizer):  # like accelerate's AcceleratedOptimizer: an Optimizer itself
        def __init__(self, inner):
            self.optimizer = inner

    model = torch.nn.Linear(4, 4)
    sgd = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    wrapped = Wrapper(sgd)
    check_hook_momentum("cb", lbcomm.OneBitHookState(momentum=0.9), [wrapped])  # matches: fine
    check_hook_momentum("cb", None, [sgd])  # no hook: nothing to check
    for state, opt in ((lbcomm.OneBitHookState(momentum=0.9), torch.optim.SGD(model.parameters(), lr=0.1)),
                       (lbcomm.OneBitHookState(momentum=0.5), wrapped)):
        with pytest.raises(ValueError, match="must equal the SGD's momentum"):
            check_hook_momentum("cb", state, [opt])
    check_hook_momentum("cb", lbcomm.OneBitHookState(momentum=0.9), [torch.optim.AdamW(model.parameters())])
    with caplog.at_level("INFO", logger="lbcomm.integrations.attach"):
        check_hook_momentum("cb", lbcomm.OneBitHookState(), [wrapped])
    assert "OneBitHookState(momentum=0.9, normalize='adaptive')" in caplog.text
