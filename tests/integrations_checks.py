"""Checks shared by the framework tests: DDP's allreduce is off in the compression stage,
the bytes on the wire are what lbcomm's state reports, resume is bitwise."""
from integrations_util import assert_bitwise

# Besides the gradient communication, a training step of the frameworks sends a little:
# their own scalar collectives (loss / token counts) and gloo's message headers. It is
# measured in the warmup (step bytes minus the fp32 ring volume); the compressed call's
# collectives (all-to-all, all-gather and the small finiteness agreement, whose payload
# bytes_per_call() counts) may add gloo's message headers on top, at most this many bytes.
HEADER_SLACK = 1024


def ring_bytes(numel, world):
    """Bytes one rank sends in a ring allreduce of numel fp32 elements (DDP's allreduce)."""
    return 2 * (world - 1) * numel * 4 // world


def check_wire(step_bytes, per_call, warmup_steps, steady_steps, numel, world):
    """Warmup steps carry DDP's fp32 allreduce; steady compression steps carry the compressed
    call of `per_call` bytes and nothing else of size."""
    ring = ring_bytes(numel, world)
    overhead = min(step_bytes[s] - ring for s in warmup_steps)
    assert overhead >= 0, (step_bytes, ring)
    for s in steady_steps:
        extra = step_bytes[s] - per_call
        assert 0 <= extra <= overhead + HEADER_SLACK, (s, step_bytes[s], per_call, overhead)
        assert step_bytes[s] * 10 < ring, (s, step_bytes[s], ring)  # the fp32 allreduce is really off


def check_resume(full, resumed, keys):
    for key in keys:
        assert_bitwise(full[key], resumed[key], f"rank state {key}: ")
