"""The exceptions lbcomm raises for a misconfigured stack (docs/troubleshooting.md)."""

__all__ = ["DoubleCompressionError", "AveragedGradientsError"]


class DoubleCompressionError(RuntimeError):
    """Two lbcomm compressors (onebit_hook and a 1-bit optimizer) on the same gradients."""


class AveragedGradientsError(RuntimeError):
    """A 1-bit optimizer received gradients that are identical on every rank: something
    (DDP's full-precision allreduce, or a compressing hook) has already averaged them."""
