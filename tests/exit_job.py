"""One small multi-rank job of tests/test_exit.py: it uses lbcomm one way and returns, as a
user script does (no destroy_process_group: the harder case for a clean exit). Run under
torchrun (gloo), or under mpirun for the "mpi" variant. Usage: exit_job.py VARIANT."""
import sys

import torch
import torch.distributed as dist

variant = sys.argv[1]
if variant == "mpi":
    import lbcomm

    state = lbcomm.CompressionState(4096, backend="mpi")
    grad = torch.randn(4096)
    for _ in range(5):
        lbcomm.compressed_allreduce_(grad, state)
    sys.exit(0)

dist.init_process_group("gloo")
if variant == "import":  # the reporter's job: lbcomm imported, plain gloo collectives, destroy
    import lbcomm  # noqa: F401

    x = torch.ones(16)
    for _ in range(5):
        dist.all_reduce(x)
    dist.destroy_process_group()
elif variant == "allreduce":
    import lbcomm

    state = lbcomm.CompressionState(4096)
    grad = torch.randn(4096)
    for _ in range(4):
        lbcomm.compressed_allreduce_(grad, state)
    lbcomm.compressed_allreduce_(grad, state, async_op=True).wait()
elif variant == "onebit_adam":  # through the freeze: the warmup's averaging, then compressed momentum
    import lbcomm

    torch.manual_seed(0)  # the same initial weights on every rank, as data parallelism needs
    model = torch.nn.Linear(64, 64)
    torch.manual_seed(1 + dist.get_rank())  # each rank its own batches
    opt = lbcomm.OneBitAdam(model.parameters(), lr=1e-3, freeze_step=3, comm=lbcomm.CommConfig(exact_numel=0))
    for _ in range(6):
        model(torch.randn(8, 64)).square().mean().backward()
        opt.step()
        opt.zero_grad()
    assert opt.frozen and opt.compression_state.worker_error.abs().sum() > 0  # compression really ran
elif variant == "ddp_hook":
    import lbcomm

    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(64, 64))
    state = lbcomm.OneBitHookState(2, comm=lbcomm.CommConfig(exact_numel=0))
    model.register_comm_hook(state, lbcomm.onebit_hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(6):
        model(torch.randn(8, 64)).square().mean().backward()
        opt.step()
        opt.zero_grad()
    assert state.compression_stats()["compressed_calls"] > 0, state.compression_stats()
else:
    raise SystemExit(f"unknown variant {variant!r}")
