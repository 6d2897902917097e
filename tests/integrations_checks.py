"""Checks shared by the framework tests: DDP's allreduce is off in the compression stage,
the bytes on the wire are what lbcomm's state reports, resume is bitwise."""
from integrations_util import assert_bitwise

# Besides the gradient communication, a training step of the frameworks sends a little:
# their own scalar collectives (loss / token counts) and gloo's message headers. It is
# measured in the warmup (step bytes minus the fp32 ring volume). A compression-stage step
# may carry a little more: gloo's headers of the compressed call's collectives (all-to-all,
# all-gather, the finiteness agreement; bytes_per_call() counts their payload), the
# shared-norm clipping's scalar allreduce (none in the warmup), and now and then bytes of
# a small collective counted in the next step (CI runs measured 1.1 and 1.6 KB over the
# warmup's overhead). 4 KB is still far below DDP's fp32 allreduce (>= 66 KB here), which
# check_wire also excludes with its own assertion.
HEADER_SLACK = 4096


def ring_bytes(numel, world):
    """Bytes one rank sends in a ring allreduce of numel fp32 elements (DDP's allreduce)."""
    return 2 * (world - 1) * numel * 4 // world


def check_wire(step_bytes, per_call, warmup_steps, steady_steps, numel, world):
    """Warmup steps carry DDP's fp32 allreduce; steady compression steps carry the `per_call`
    bytes the compression reports (a 1-bit optimizer's bytes_per_step total: the compressed
    call, the exact parameters, the agreement, OneBitLamb's norm estimate) and nothing else
    of size."""
    ring = ring_bytes(numel, world)
    overhead = min(step_bytes[s] - ring for s in warmup_steps)
    assert overhead >= 0, (step_bytes, ring)
    for s in steady_steps:
        extra = step_bytes[s] - per_call
        assert 0 <= extra <= overhead + HEADER_SLACK, (s, step_bytes[s], per_call, overhead)
        # the fp32 allreduce is really off (it alone would send `ring`); OneBitLamb's norm
        # estimate keeps a step of these 17k-parameter models at about 1/7 of it
        assert step_bytes[s] * 4 < ring, (s, step_bytes[s], ring)


def check_resume(full, resumed, keys):
    for key in keys:
        assert_bitwise(full[key], resumed[key], f"rank state {key}: ")


def check_shared_clipping(g0, g1, freeze, clip, steps=9):
    """The gradients the optimizer saw on 2 ranks with LbcommCallback(max_grad_norm=clip):
    warmup gradients (averaged by the hook) clipped as torch would; compression-stage
    gradients (local) scaled by one coefficient on both ranks, so sqrt(mean_r ||g_r||^2)
    equals clip (every step must clip)."""
    import torch

    for step in range(1, freeze + 1):
        assert torch.equal(g0[step], g1[step]) and float(g0[step].norm()) <= clip * (1 + 1e-5), step
    for step in range(freeze + 1, steps + 1):
        assert not torch.equal(g0[step], g1[step]), step
        shared = ((g0[step].norm() ** 2 + g1[step].norm() ** 2) / 2).sqrt()
        assert abs(float(shared) - clip) <= clip * 1e-4, (step, float(shared))
