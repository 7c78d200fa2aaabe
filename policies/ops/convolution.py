"""Convolution and other per-sample ops (pooling, interpolation, padding, group
norm, pixel shuffles): each sample computed from its own row, so the batch split
stays; a convolution along a cp-split sequence exchanges its halo.
"""

from __future__ import annotations

import torch

from autoshard.ir.kernels import SequenceConv
from autoshard.ir.spec import ShardSpec, replicated
from autoshard.ir.tokens import sequence_conv

from ..base import Choice, RuleContext, SymbolicSizes
from .common import batch_rows, fallback, register, tensor_args

aten = torch.ops.aten

__all__ = ["PER_SAMPLE", "convolution", "per_sample", "sequence_conv_rule"]


@register(aten.conv1d.default, aten.conv2d.default, aten.conv3d.default, aten.conv1d.padding, aten.conv2d.padding,
          aten.conv3d.padding, aten.convolution.default, aten.conv_transpose1d.default, aten.conv_transpose2d.input,
          aten.conv_transpose3d.input)
def convolution(ctx: RuleContext) -> Choice:
    """``conv1d`` / ``conv2d`` / ``conv3d`` / ``convolution`` (a vision patch embedding, an
    audio front end): each sample is convolved on its own, so the batch split stays
    (re-laid as the batch's) and the output keeps it; channels and positions are whole,
    the weight and bias whole (their gradients summed over the batch axes, as any whole
    parameter's)."""
    node = ctx.node
    x, w = node.args[:2]
    rows = batch_rows(ctx, x, ctx.spec(x))
    # an unbatched input ([C, L] for a weight [C', C, k]) has no rows (found by the OpInfo check)
    lead = rows.dims[0] if rows and ctx.spec(x).ndim == ctx.spec(w).ndim else ()
    inputs = {}
    for path, a in tensor_args(ctx):
        nd = ctx.spec(a).ndim
        inputs[path] = ShardSpec(dims=(lead,) + ((),) * (nd - 1)) if path == (0,) else replicated(nd)
    out = ShardSpec(dims=(lead,) + ((),) * (len(ctx.pshape(node)) - 1))
    return Choice(out=out, inputs=inputs,
                  notes=("convolution: sample by sample" + (f", rows over {','.join(lead)}" if lead else "")
                         + "; weight whole",))


@register(sequence_conv)
def sequence_conv_rule(ctx: RuleContext) -> Choice:
    """:func:`autoshard.ir.tokens.sequence_conv` (a convolution along the sequence whose
    output keeps its length, e.g. a causal one): as :func:`convolution`, and a time dim
    split over ``cp`` keeps its split: the :class:`~autoshard.ir.kernels.SequenceConv`
    kernel exchanges the halo, the rows the kernel reaches past each block's edges."""
    node = ctx.node
    x = node.args[0]
    s = ctx.spec(x)
    rows = batch_rows(ctx, x, s)
    lead = rows.dims[0] if rows else ()
    time = ("cp",) if s.ndim == 3 and s.dims[2] == ("cp",) and not s.partial else ()
    if not time:
        return convolution(ctx)
    spec = ShardSpec(dims=(lead, (), time))
    inputs = {(0,): spec}
    for path, a in tensor_args(ctx):
        if path != (0,):
            inputs[path] = replicated(ctx.spec(a).ndim)
    left, right = node.args[3], node.args[4]
    if left + right == 0:           # a pointwise convolution: no row crosses a block's edge
        return Choice(out=spec, inputs=inputs, notes=("convolution along the sequence, pointwise: cp split kept",))
    k = SequenceConv(axes=time, left=left, right=right, chunks=2 if ctx.cp_order == "balanced" else 1,
                     in_specs=tuple(inputs.items()), out_spec=spec)
    return Choice.run(k, notes=(f"convolution along the cp-split sequence: halo of {left} row(s) before and "
                                f"{right} after each block, gathered over cp",))


#: ATen ops (by overload packet) that compute each sample from its own row alone
#: (docs/design.md, "The batch contract"): pooling, interpolation, padding, group
#: norm, pixel shuffles. Their rule keeps the batch split of dim 0 and holds every
#: other dim whole; checked on torch's OpInfo samples (tests/policies/test_opinfo.py).
PER_SAMPLE = frozenset(getattr(aten, n) for n in (
    "upsample_nearest1d", "upsample_nearest2d", "upsample_nearest3d", "_upsample_nearest_exact1d",
    "_upsample_nearest_exact2d", "_upsample_nearest_exact3d", "upsample_linear1d", "upsample_bilinear2d",
    "upsample_bicubic2d", "upsample_trilinear3d", "_upsample_bilinear2d_aa", "_upsample_bicubic2d_aa",
    "max_pool1d", "max_pool2d", "max_pool3d", "avg_pool1d", "avg_pool2d", "avg_pool3d",
    "adaptive_avg_pool1d", "adaptive_avg_pool2d", "adaptive_avg_pool3d", "_adaptive_avg_pool2d",
    "group_norm", "pixel_shuffle", "pixel_unshuffle", "channel_shuffle", "reflection_pad1d",
    "reflection_pad2d", "reflection_pad3d", "replication_pad1d", "replication_pad2d", "replication_pad3d",
    "constant_pad_nd", "im2col", "col2im", "grid_sampler", "grid_sampler_2d") if hasattr(aten, n))


@register(packets=PER_SAMPLE)
def per_sample(ctx: RuleContext) -> Choice:
    """An op of :data:`PER_SAMPLE` (or ``batch_norm`` with running statistics): each
    sample's output is computed from that sample alone, so the rows of a batch split
    stay split (re-laid as the batch's when swapped) and every tensor argument whose
    leading dim is the batch follows them; every other dim, and every other argument
    (weights, sizes), whole."""
    node = ctx.node
    targs = tensor_args(ctx)
    x = targs[0][1] if targs else None
    rows = batch_rows(ctx, x, ctx.spec(x)) if x is not None else None
    lead = rows.dims[0] if rows else ()
    inputs = {}
    for path, a in targs:
        nd = ctx.spec(a).ndim
        keep = lead if nd and SymbolicSizes.is_rows(ctx.pshape(a)[0]) and \
            ctx.pshape(a)[0] == ctx.pshape(x)[0] else ()
        inputs[path] = ShardSpec(dims=(keep,) + ((),) * (nd - 1)) if nd else replicated(0)
    shape = ctx.pshape(node) if ctx.is_tensor(node) else ()
    out = ShardSpec(dims=((lead if shape and shape[0] == ctx.pshape(x)[0] else ()),) + ((),) * (len(shape) - 1)) \
        if shape else replicated(0)
    if not isinstance(node.meta.get("val"), torch.Tensor):
        return fallback(ctx, "a per-sample op with several outputs")
    return Choice(out=out, inputs=inputs,
                  notes=(f"per sample: rows over {','.join(lead)}",) if lead and out.dims[0] else ())
