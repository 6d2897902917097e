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
        assert res["optimizer_twice"].startswith("TypeError") and "optimizer= is for a hook state" in \
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


# ---------------------------------------------------------------------------- DCTHookState
def _refused(call):
    try:
        call()
        return None
    except (TypeError, ValueError, DoubleCompressionError) as exc:
        return f"{type(exc).__name__}: {exc}"


def _dct_cases(rank, p):
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    torch.manual_seed(0)
    out = {}
    ddp = DDP(torch.nn.Linear(64, 64))
    sgd = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)  # no momentum check: not a OneBitHookState
    # refreshed every call: ~5 % of the entries pass each time
    state = lbcomm.DCTHookState(2, density=0.05, refresh_every=1, comm=lbcomm.CommConfig(exact_numel=0))
    out["onebit"] = _refused(lambda: attach(ddp, state, optimizer=lbcomm.OneBitAdam(ddp.parameters(), freeze_step=2)))
    out["lamb"] = _refused(lambda: attach(ddp, state, optimizer=lbcomm.Lamb(ddp.parameters())))
    out["warmup_fp16"] = _refused(lambda: attach(ddp, state, optimizer=sgd, warmup_fp16=True))
    out["hooks_after_refusal"] = len(getattr(ddp, "_comm_hooks", []))
    out["attached"] = attach(ddp, state, optimizer=sgd) is ddp
    out["again_is_noop"] = attach(ddp, state, optimizer=sgd) is ddp
    out["other_state"] = _refused(lambda: attach(ddp, lbcomm.DCTHookState(2), optimizer=sgd))
    out["onebit_state"] = _refused(lambda: attach(ddp, lbcomm.OneBitHookState(2), optimizer=sgd))
    out["registered"] = [(h.__name__, s is state) for h, s in ddp._comm_hooks]
    other = DDP(torch.nn.Linear(4, 4))
    other.register_comm_hook(None, allreduce_hook)  # a hook registered before lbcomm's
    out["other_hook"] = _refused(lambda: attach(other, lbcomm.DCTHookState(2)))
    for it in range(5):
        sgd.zero_grad()
        ddp(torch.randn(4, 64, generator=torch.Generator().manual_seed(10 * rank + it))).square().sum().backward()
        sgd.step()
    out["grad"] = ddp.module.weight.grad.clone()
    out["weight"] = ddp.module.weight.detach().clone()
    out["stats"] = state.compression_stats()
    out["numel"] = sum(q.numel() for q in ddp.parameters())
    return out


def test_attach_dct_hook_state_on_two_ranks():
    """attach(ddp, DCTHookState, optimizer=) registers dct_hook with OneBitHookState's checks:
    a 1-bit optimizer or Lamb beside it is refused before anything is registered, another
    hook or state is refused, re-attaching is a no-op; after start_iter the buckets are
    exchanged sparsely (fewer bytes than fp32) and the replicas stay bitwise identical."""
    r = run_ranks(_dct_cases, 2)
    for res in r:
        assert res["onebit"].startswith("DoubleCompressionError") and "DCTHookState's dct_hook" in res["onebit"]
        assert res["lamb"].startswith("ValueError") and "lbcomm.Lamb averages its gradients itself" in res["lamb"]
        assert res["warmup_fp16"].startswith("ValueError") and "warmup_fp16" in res["warmup_fp16"]
        assert res["hooks_after_refusal"] == 0
        assert res["attached"] and res["again_is_noop"] and res["registered"] == [("dct_hook", True)]
        for key in ("other_state", "onebit_state", "other_hook"):
            assert res[key].startswith("ValueError") and "already has a communication hook" in res[key], key
        stats, numel = res["stats"], res["numel"]
        assert stats["iter"] == 5 and stats["compressed_calls"] == 3  # iterations 3 to 5, one bucket each
        ring = 2 * (2 - 1) * numel * 4 // 2  # one fp32 ring allreduce of the bucket, this rank's bytes
        assert stats["bytes_uncompressed"] == 5 * ring
        sparse = stats["bytes_sent"] - 2 * ring  # what the 3 compressed iterations sent
        assert 0 < sparse < 3 * ring / 5, (sparse, ring)
        assert 0 < stats["sent_fraction"] < 0.1
    assert torch.equal(r[0]["grad"], r[1]["grad"]) and torch.equal(r[0]["weight"], r[1]["weight"])


# ---------------------------------------------------------------------------- OneBitLocalUpdates
H = 3  # sync_every of the local-updates cases


def _local_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 8))


def _local_train(forward, module, inner, local, rank, steps=2 * H + 1):
    """`steps` inner steps on this rank's data; the gradients the inner optimizer saw, the
    weights at every synchronization and at the end."""
    grads, at_sync = [], []
    for it in range(steps):
        x = torch.randn(4, 16, generator=torch.Generator().manual_seed(100 * rank + it))
        inner.zero_grad()
        forward(x).square().mean().backward()
        grads.append(torch.cat([q.grad.reshape(-1) for q in module.parameters()]).clone())
        inner.step()
        if local.step():
            at_sync.append(torch.cat([q.detach().reshape(-1) for q in module.parameters()]).clone())
    return grads, at_sync, torch.cat([q.detach().reshape(-1) for q in module.parameters()]).clone()


def _local_cases(rank, p):
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    out = {}
    module = _local_model()
    ddp = DDP(module)
    inner = torch.optim.AdamW(module.parameters(), lr=1e-2)
    local = lbcomm.OneBitLocalUpdates(module.parameters(), inner, H)
    out["other_optimizer"] = _refused(lambda: attach(ddp, local, optimizer=torch.optim.SGD(module.parameters(), lr=1)))
    onebit = lbcomm.OneBitAdam(module.parameters(), freeze_step=2)
    out["onebit_inner"] = _refused(lambda: attach(ddp, lbcomm.OneBitLocalUpdates(module.parameters(), onebit, H)))
    out["hooks_after_refusal"] = len(getattr(ddp, "_comm_hooks", []))
    out["attached"] = attach(ddp, local, optimizer=inner) is ddp
    out["again_is_noop"] = attach(ddp, local) is ddp
    out["registered"] = [(h.__name__, s is local) for h, s in ddp._comm_hooks]
    out["hook_state_after"] = _refused(lambda: attach(ddp, lbcomm.OneBitHookState(2)))
    other = DDP(torch.nn.Linear(4, 4))
    other.register_comm_hook(None, allreduce_hook)
    other_inner = torch.optim.SGD(other.parameters(), lr=0.1)
    out["other_hook"] = _refused(lambda: attach(other, lbcomm.OneBitLocalUpdates(other.parameters(), other_inner, H)))
    out["ddp"] = _local_train(ddp, module, inner, local, rank)
    out["stats"] = local.compression_stats()
    # The same training without DDP: the plain module with the same local updates.
    plain = _local_model()
    inner = torch.optim.AdamW(plain.parameters(), lr=1e-2)
    local = lbcomm.OneBitLocalUpdates(plain.parameters(), inner, H)
    out["plain"] = _local_train(plain, plain, inner, local, rank)
    return out


def test_attach_local_updates_on_two_ranks():
    """attach(ddp, OneBitLocalUpdates) registers local_gradients_hook: every rank's gradient
    stays its own (DDP neither averages nor divides it), the synchronizations every H steps
    give bitwise identical replicas, and the run is bitwise the plain module's with the
    same local updates. An optimizer other than the inner one, a lbcomm inner optimizer
    and a hook already registered are refused."""
    r = run_ranks(_local_cases, 2)
    for res in r:
        assert res["other_optimizer"].startswith("ValueError") and "not the OneBitLocalUpdates' inner optimizer" in \
            res["other_optimizer"]
        assert res["onebit_inner"].startswith("ValueError") and "communicates at every step by itself" in \
            res["onebit_inner"]
        assert res["hooks_after_refusal"] == 0
        assert res["attached"] and res["again_is_noop"] and res["registered"] == [("local_gradients_hook", True)]
        for key in ("hook_state_after", "other_hook"):
            assert res[key].startswith("ValueError") and "already has a communication hook" in res[key], key
        assert res["stats"]["syncs"] == 2 and res["stats"]["compressed_calls"] == 2
        grads, at_sync, final = res["ddp"]
        p_grads, p_sync, p_final = res["plain"]
        assert len(at_sync) == 2
        for g, pg in zip(grads, p_grads):  # the local gradient, as without DDP
            assert torch.equal(g, pg)
        assert all(torch.equal(a, b) for a, b in zip(at_sync, p_sync)) and torch.equal(final, p_final)
    g0, g1 = r[0]["ddp"][0], r[1]["ddp"][0]
    assert all(not torch.equal(a, b) for a, b in zip(g0, g1))  # nothing averaged them
    for a, b in zip(r[0]["ddp"][1], r[1]["ddp"][1]):  # the replicas after every synchronization
        assert torch.equal(a, b)
    assert not torch.equal(r[0]["ddp"][2], r[1]["ddp"][2])  # one local step after the last one


def test_local_updates_and_dct_checks_in_one_process():
    """The checks that need no ranks: the callbacks' arguments, the local updates' inner
    optimizer, OneBitHookState-only checks that leave a DCTHookState alone."""
    from lbcomm.integrations.attach import check_callback_args, check_hook_momentum, check_not_communicating

    model = torch.nn.Linear(4, 4)
    sgd = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    local = lbcomm.OneBitLocalUpdates(model.parameters(), sgd, 2)
    assert attach(model, local, optimizer=sgd) is None  # one process, no DDP: nothing to attach
    assert attach(model, lbcomm.DCTHookState(2), optimizer=sgd) is None
    with pytest.raises(ValueError, match="not the OneBitLocalUpdates' inner optimizer"):
        attach(model, local, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(ValueError, match="warmup_fp16"):
        attach(model, local, warmup_fp16=True)
    with pytest.raises(DoubleCompressionError, match="DCTHookState's dct_hook"):
        attach(model, lbcomm.DCTHookState(2), optimizer=[sgd, lbcomm.OneBitLamb(model.parameters(), freeze_step=2)])
    with pytest.raises(ValueError, match="DCTHookState's dct_hook would have averaged"):
        check_not_communicating("cb", lbcomm.Lamb(model.parameters()), lbcomm.DCTHookState(2))
    check_hook_momentum("cb", lbcomm.DCTHookState(2), [sgd])  # no momentum setting: nothing to check
    check_callback_args("cb", lbcomm.DCTHookState(2), None)
    check_callback_args("cb", None, None, local)
    with pytest.raises(TypeError, match="OneBitHookState or lbcomm.DCTHookState"):
        check_callback_args("cb", local, None)
    with pytest.raises(TypeError, match="must be a lbcomm.OneBitLocalUpdates"):
        check_callback_args("cb", None, None, lbcomm.DCTHookState(2))
    with pytest.raises(ValueError, match="pass one of them"):
        check_callback_args("cb", lbcomm.OneBitHookState(2), None, local)
    with pytest.raises(ValueError, match="clips it by its own norm"):
        check_callback_args("cb", None, 1.0, local)
