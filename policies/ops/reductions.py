"""Reductions and ops along one dim: ``sum`` / ``mean`` / ``amax`` (a reduction
over a split dim leaves a partial sum), ``softmax``, ``cumsum`` / ``diff``, ``sort`` /
``topk`` / ``max.dim``, ``histc``.
"""

from __future__ import annotations

import torch

from autoshard.ir.plan import Step
from autoshard.ir.spec import ShardSpec, replicated

from ..base import Choice, RuleContext
from .common import need_unsplit, register, tensor_args, without_dim

aten = torch.ops.aten

__all__ = ["cumsum", "dimwise", "histc", "max_dim", "reduce_", "softmax", "sort", "topk"]


@register(aten.diff.default)
def dimwise(ctx, dim_arg: int = 1, default_dim: int = -1) -> Choice:
    """An op along one dim (``softmax``, ``diff``, ``cumsum``): that dim must be whole
    and no partial sum may pass; other splits are kept. ``dim_arg`` is the position
    of the dim argument, ``default_dim`` its default."""
    x = ctx.node.args[0]
    s = ctx.spec(x)
    d = ctx.node.args[dim_arg] if len(ctx.node.args) > dim_arg else ctx.node.kwargs.get("dim", default_dim)
    d = d % max(s.ndim, 1)
    req = need_unsplit(s, [d]).with_partial(())
    inputs = {(0,): req}
    for path, a in tensor_args(ctx)[1:]:          # diff's prepend / append
        inputs[path] = req
    return Choice(out=req, inputs=inputs)


@register(aten.softmax.int, aten._softmax.default, aten.log_softmax.int, aten._log_softmax.default)
def softmax(ctx: RuleContext) -> Choice:
    """``softmax`` / ``log_softmax``: :func:`dimwise` on the softmax dim."""
    return dimwise(ctx, 1)


@register(aten.mean.dim, aten.sum.dim_IntList, aten.amax.default, aten.mean.default, aten.sum.default)
def reduce_(ctx: RuleContext) -> Choice:
    """``sum`` / ``mean`` / ``amax``: a reduction over a split dim leaves a partial sum over
    its axes (``mean`` scaled by the split after the reduce); ``amax`` needs the dim
    whole instead."""
    node = ctx.node
    x = node.args[0]
    s = ctx.spec(x)
    n = s.ndim
    if node.target in (aten.mean.default, aten.sum.default):
        rdims, keep = list(range(n)), False
    else:
        rd = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
        # a 0-dim input reduces over nothing (its dim 0 / -1 names the value itself)
        rdims = list(range(n)) if rd is None or rd == [] or not n else \
            [d % n for d in ([rd] if isinstance(rd, int) else rd)]
        keep = node.args[2] if len(node.args) > 2 else node.kwargs.get("keepdim", False)
    split_axes = tuple(a for d in rdims for a in s.dims[d])
    if node.target == aten.amax.default:
        # a max is no sum: over a split dim it needs the dim whole, and of a partial sum
        # the sum first (found by tests/policies/test_opinfo.py)
        req = need_unsplit(s, rdims).with_partial(())
        split_axes = ()
    else:
        req = s
    dims = [req.dims[d] if d not in rdims else () for d in range(n)]
    segs = [req.segments[d] if d not in rdims else 1 for d in range(n)]
    if not keep:
        dims = [dims[d] for d in range(n) if d not in rdims]
        segs = [segs[d] for d in range(n) if d not in rdims]
    post = ()
    if split_axes and node.target in (aten.mean.dim, aten.mean.default):
        post = (Step(op="scale", factor=1.0 / ctx.mesh.size(split_axes)),)
    # mesh order for the partial axes
    part = tuple(a for a in ctx.mesh.axes if a in split_axes or a in req.partial)
    return Choice(out=ShardSpec(dims=tuple(dims), segments=tuple(segs), partial=part), inputs={(0,): req}, post=post)


@register(aten.cumsum.default)
def cumsum(ctx: RuleContext) -> Choice:
    """Linear: a partial sum passes (the group offsets of a rank's counts)."""
    ch = dimwise(ctx)
    s = ctx.spec(ctx.node.args[0])
    if not s.partial:
        return ch
    req = ch.out.with_partial(s.partial)
    return Choice(out=req, inputs={(0,): req})


@register(aten.sort.default, aten.sort.stable)
def sort(ctx: RuleContext) -> Choice:
    """A sort along a dim that is whole, or along the batch-split rows: each rank
    sorts its own rows (a rank-local order the row-order analysis follows)."""
    node = ctx.node
    x = node.args[0]
    s = ctx.spec(x).with_partial(())
    d = node.kwargs.get("dim", node.args[1] if len(node.args) > 1 and node.target == aten.sort.default else -1)
    d = d % max(s.ndim, 1)
    if d == 0 and s.dims[0] and s.dims[0] != ctx.batch_axes and len(s.dims[0]) == len(ctx.batch_axes) \
            and ctx.mesh.size(s.dims[0]) == ctx.mesh.size(ctx.batch_axes):
        s = ShardSpec(dims=(ctx.batch_axes,) + ((),) * (s.ndim - 1))   # 3d's swapped rows: re-laid as the batch
    if s.dims[d] and not (d == 0 and s.dims[0] == ctx.batch_axes):
        s = need_unsplit(s, [d])
    return Choice(out=(s, s), inputs={(0,): s}, notes=("rank-local sort of the rows",) if s.dims[d] else ())


@register(aten.topk.default)
def topk(ctx: RuleContext) -> Choice:
    """``topk``: the dim searched must be whole; values and indices keep the other splits."""
    node = ctx.node
    s = ctx.spec(node.args[0])
    d = (node.args[2] if len(node.args) > 2 else node.kwargs.get("dim", -1)) % max(s.ndim, 1)
    req = need_unsplit(s, [d]).with_partial(())
    return Choice(out=(req, req), inputs={(0,): req})


@register(aten.max.dim, aten.min.dim)
def max_dim(ctx: RuleContext) -> Choice:
    """``max.dim`` / ``min.dim`` (values and indices along one dim: attention with sinks
    subtracts the scores' max over the keys): the dim searched must be whole; values
    and indices keep the other splits (the dim dropped unless ``keepdim``)."""
    node = ctx.node
    s = ctx.spec(node.args[0])
    d = (node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", -1)) % max(s.ndim, 1)
    keep = node.args[2] if len(node.args) > 2 else node.kwargs.get("keepdim", False)
    req = need_unsplit(s, [d]).with_partial(())
    out = req if keep else without_dim(req, d)
    return Choice(out=(out, out), inputs={(0,): req})


@register(aten.histc.default)
def histc(ctx: RuleContext) -> Choice:
    """Counts of split rows are the rank's counts: a partial sum (over the batch axes)
    of the dense counts."""
    s = ctx.spec(ctx.node.args[0])
    rows = s.dims[0] if s.ndim == 1 and s.dims[0] == ctx.batch_axes and not s.partial else ()
    req = ShardSpec(dims=(rows,)) if s.ndim == 1 else replicated(s.ndim)
    part = tuple(a for a in ctx.mesh.axes if a in rows)
    return Choice(out=ShardSpec(dims=((),), partial=part), inputs={(0,): req},
                  notes=(f"the rank's counts: partial over {','.join(part)}",) if part else ())
