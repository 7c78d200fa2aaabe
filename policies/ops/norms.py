"""Normalisation: ``layer_norm`` (statistics reduced over a split hidden dim)
and ``batch_norm`` (statistics synced over a split batch). ``group_norm`` is per
sample (:mod:`autoshard.policies.ops.convolution`).
"""

from __future__ import annotations

import torch
from torch import fx

from autoshard.ir.kernels import DistLayerNorm, SyncBatchNorm
from autoshard.ir.spec import ShardSpec, replicated

from ..base import Choice, RuleContext
from .common import batch_rows, need_unsplit, register
from .convolution import per_sample

aten = torch.ops.aten

__all__ = ["batch_norm", "layer_norm"]


@register(aten.layer_norm.default)
def layer_norm(ctx: RuleContext) -> Choice:
    """``layer_norm``: local when the normalised dim is whole; over one split dim the
    :class:`~autoshard.ir.kernels.DistLayerNorm` kernel all-reduces the statistics over
    its axes (an all-reduce backward); the weight and bias follow the normalised dims."""
    node = ctx.node
    x = node.args[0]
    s = ctx.spec(x).with_partial(())
    nd = len(node.args[1])
    ndim = s.ndim
    normed = range(ndim - nd, ndim)
    axes = tuple(a for d in normed for a in s.dims[d])
    if nd > 1 and axes:
        s = need_unsplit(s, normed)
        axes = ()
    inputs = {(0,): s}
    pspec = ShardSpec(dims=tuple(s.dims[d] for d in normed), segments=tuple(s.segments[d] for d in normed))
    for i in (2, 3):
        if len(node.args) > i and isinstance(node.args[i], fx.Node):
            inputs[(i,)] = pspec
    if not axes:
        return Choice(out=s, inputs=inputs)
    return Choice.run(DistLayerNorm(axes=axes, in_specs=tuple(inputs.items()), out_spec=s),
                      grad_complete=frozenset({(0,)}), notes=(f"statistics reduced over {','.join(axes)}",))


@register(aten.batch_norm.default)
def batch_norm(ctx: RuleContext) -> Choice:
    """``batch_norm``. With running statistics (eval) it is per sample (:func:`per_sample`).
    In training the statistics are of the whole batch: with its rows split, the
    :class:`~autoshard.ir.kernels.SyncBatchNorm` kernel all-reduces each channel's sum and
    sum of squares over the batch axes (``SyncBatchNorm``: the same figures on every rank,
    equal to dense, and so are the running statistics it updates); the backward
    all-reduces the statistics' gradients. Channels and positions are whole, the weight,
    bias and running statistics whole (the weight's and bias's gradients summed over the
    batch axes, as any whole parameter's)."""
    node = ctx.node
    a = list(node.args) + [None] * 9
    if not a[5]:
        return per_sample(ctx)
    x = a[0]
    rows = batch_rows(ctx, x, ctx.spec(x))
    lead = rows.dims[0] if rows else ()
    nd = ctx.spec(x).ndim
    spec = ShardSpec(dims=(lead,) + ((),) * (nd - 1))
    inputs = {(0,): spec}
    for i in (1, 2, 3, 4):
        if isinstance(a[i], fx.Node):
            inputs[(i,)] = replicated(ctx.spec(a[i]).ndim)
    if not lead:
        return Choice(out=spec, inputs=inputs)
    k = SyncBatchNorm(axes=lead, in_specs=tuple(inputs.items()), out_spec=spec)
    return Choice.run(k, notes=(f"couples samples: statistics synced over {','.join(lead)} "
                                f"(SyncBatchNorm; running statistics from the global figures)",))
