r"""Gradient statistics of data-parallel training at the cost of a few scalars per step:
the gradient noise scale, AdaScale's gain, and the norm test of adaptive batch sizes.

Estimators (McCandlish et al. 2018, appendix A). A rank's gradient over its b samples
and the average over p ranks (B = p b samples) satisfy

.. math::
    E|g_b|^2 = |G|^2 + \mathrm{tr}(\Sigma)/b, \qquad E|g_B|^2 = |G|^2 + \mathrm{tr}(\Sigma)/B

with G the true gradient and \Sigma the per-sample covariance, so

.. math::
    |G|^2 \approx \frac{B |g_B|^2 - b |g_b|^2}{B - b}, \qquad
    \mathrm{tr}(\Sigma) \approx \frac{|g_b|^2 - |g_B|^2}{1/b - 1/B}

unbiased, with |g_b|^2 the mean over the ranks of the local squared norms (one scalar).
Both are smoothed by a bias-corrected EMA before any ratio: the noise scale
B_simple = tr(\Sigma)/|G|^2 and AdaScale's gain (Johnson et al. 2020) for a batch s times
the base batch b0, r = (\sigma^2 + |G|^2) / (\sigma^2/s + |G|^2) with \sigma^2 = tr(\Sigma)/b0.

Where |g_B|^2 comes from:

* ``exact``: the averaged gradient itself (warmup of the lbcomm optimizers, DDP with an
  exact hook, `allreduce_gradients_`). Costs one fp32 scalar on the wire.
* ``sketch``: with 1-bit communication the exact mean is never formed (the compressed
  result carries the error-feedback residual, whose norm would inflate |g_B|^2). A random
  sample of k coordinates, drawn afresh each step from a seed shared by all ranks, is
  averaged exactly beside it: with x = sqrt(n/k) g[idx] (idx uniform with replacement),
  E|x|^2 = |g|^2 for every vector g, so both |g_b|^2 (mean over ranks of |x_r|^2) and
  |g_B|^2 (|mean_r x_r|^2) are unbiased, and so are the estimators, which are linear in
  them. Costs k + 2 fp32 scalars per step (sketch_size, default 4096: 16 KiB); its noise is
  averaged by the EMA (bias and spread against exact values: bench/large_batch.py).

Sources: `GradientNoiseScale.measure`/`observe` for any loop, `allreduce_gradients_` for a
plain torch loop, the lbcomm optimizers (``optimizer.gradient_stats = tracker``: exact in
warmup, sketch in the compression stage) and `stats_hook` around any DDP communication hook.

Example::

    >>> # xdoctest: +SKIP
    >>> stats = lbcomm.stats.GradientNoiseScale(local_batch=32)
    >>> opt = lbcomm.stats.AdaScale(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
    ...                              stats, base_batch=128, batch=32 * world_size)
    >>> for x, y in loader:
    ...     opt.zero_grad(); loss_fn(model(x), y).backward()
    ...     lbcomm.stats.allreduce_gradients_(model.parameters(), stats)   # averages the grads too
    ...     opt.step()
    >>> stats.noise_scale, opt.gain, opt.scale_invariant_steps
"""
from .control import AdaScale, BatchSizeController
from .hook import StatsHookState, stats_hook
from .noise import GradientNoiseScale, adascale_gain, allreduce_gradients_, noise_estimates

__all__ = ["noise_estimates", "adascale_gain", "GradientNoiseScale", "allreduce_gradients_", "AdaScale",
           "BatchSizeController", "StatsHookState", "stats_hook"]
