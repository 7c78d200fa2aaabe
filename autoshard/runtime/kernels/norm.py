"""The normalisation kernels: layer norm over a split feature dim and batch norm
synchronised over a split batch."""

from __future__ import annotations

import torch

from .. import collectives as C
from .common import autocast_on

__all__ = ["dist_layer_norm", "sync_batch_norm"]


def dist_layer_norm(x, normalized_shape, w, b, eps, *, group: str, count: int):
    """LayerNorm over a hidden dim split over ``group``: Σx and Σ(x-μ)² all-reduced
    both ways (the statistics are used with split data, so their grads are partial).

    Computed in float32 at least, as the dense kernel does (float64 stays float64); the
    result has ``x``'s dtype, or float32 under autocast (where ``layer_norm`` runs in float32)."""
    dtype = torch.float32 if autocast_on(x) else x.dtype
    acc = torch.promote_types(x.dtype, torch.float32)
    x = x.to(acc)
    h = x.shape[-1] * count
    mean = C.all_reduce_both(x.sum(-1, keepdim=True), group) / h
    xc = x - mean
    var = C.all_reduce_both((xc * xc).sum(-1, keepdim=True), group) / h
    y = xc * torch.rsqrt(var + eps)
    if w is not None:
        y = y * w.to(acc)
    if b is not None:
        y = y + b.to(acc)
    return y.to(dtype)


def sync_batch_norm(x, w, b, running_mean, running_var, *, momentum, eps, group: str):
    """``batch_norm`` in training over a batch whose rows are split over ``group``, as
    ``torch.nn.SyncBatchNorm``: each rank's per-channel mean and sum of squared
    deviations (over its rows and positions) are all-gathered in one call and combined
    (Chan's parallel variance: exact, no cancellation); backward reduce-scatters their
    gradients home, so every rank's input gradient is that of the global batch. The
    running statistics are updated in place from the global figures (unbiased
    variance), identically on every rank. Every rank holds as many rows (the batch
    divides the split). Computed in float32 at least, as the dense kernel does."""
    dtype = torch.float32 if autocast_on(x) else x.dtype
    acc = torch.promote_types(x.dtype, torch.float32)
    xa = x.to(acc)
    red = [0] + list(range(2, x.dim()))
    n = xa.numel() // max(xa.shape[1] if x.dim() > 1 else 1, 1)          # values per channel on this rank
    mean_r = xa.mean(red)
    m2_r = ((xa - mean_r.view(_bn_shape(x))) ** 2).sum(red)
    every = C.gather_partial(torch.stack([mean_r, m2_r]).unsqueeze(0), 0, group)        # [p, 2, C]
    p = every.shape[0]
    means = every[:, 0]
    mean = means.mean(0)
    m2 = every[:, 1].sum(0) + n * ((means - mean) ** 2).sum(0)
    total = n * p
    var = m2 / total
    y = (xa - mean.view(_bn_shape(x))) * torch.rsqrt(var + eps).view(_bn_shape(x))
    if w is not None:
        y = y * w.to(acc).view(_bn_shape(x))
    if b is not None:
        y = y + b.to(acc).view(_bn_shape(x))
    if running_mean is not None and momentum is not None:
        with torch.no_grad():
            running_mean.mul_(1 - momentum).add_(mean.detach().to(running_mean.dtype), alpha=momentum)
            unbiased = m2.detach() / max(total - 1, 1)
            running_var.mul_(1 - momentum).add_(unbiased.to(running_var.dtype), alpha=momentum)
    return y.to(dtype)


def _bn_shape(x) -> tuple:
    """``[1, C, 1, ...]``: a per-channel vector broadcast over ``x``."""
    return (1, -1) + (1,) * (x.dim() - 2)
