"""Pointwise ops: elementwise math and broadcasts, in-place writes, casts and
copies, dropout. Ops tagged ``torch.Tag.pointwise`` reach :func:`pointwise` (or
:func:`inplace` when they write into their first argument) without a
registration of their own (:func:`autoshard.policies.generic.rule_for`).
"""

from __future__ import annotations

import operator

import torch
from torch import fx

from autoshard.ir.errors import ShardingError
from autoshard.ir.kernels import Dropout
from autoshard.ir.spec import ShardSpec

from ..base import Choice, RuleContext
from .common import read_split, register, tensor_args

aten = torch.ops.aten

__all__ = ["dropout", "identity_like", "inplace", "is_pointwise_write", "pointwise", "type_as", "writes_first_arg"]


_LINEAR_IN_PARTIAL = {aten.neg.default, aten.clone.default, aten.alias.default, aten.contiguous.default,
                      aten.to.dtype, aten.to.dtype_layout, aten._to_copy.default, aten.dropout.default}


def _partial_passes(target, part_paths, targs) -> bool:
    """Whether the op is linear in its partial operand(s), so the partial sum can wait."""
    if target in _LINEAR_IN_PARTIAL:
        return True
    if target in (aten.mul.Tensor, aten.mul.Scalar):
        return len(part_paths) == 1
    if target in (aten.div.Tensor, aten.div.Scalar):
        return part_paths == [(0,)]
    if target in (aten.add.Tensor, aten.sub.Tensor):
        return len(targs) == 2 and len(part_paths) == 2
    return False


@register(aten.__and__.Tensor, aten.__or__.Tensor, aten.where.self, aten.where.ScalarOther, aten.where.ScalarSelf,
          aten.where.Scalar, aten.masked_fill.Scalar, aten.masked_fill.Tensor, aten.pow.Tensor_Scalar,
          aten.gelu.default, aten.silu.default, aten.relu.default, aten.tanh.default, aten.sigmoid.default,
          aten.rsqrt.default, aten.lift_fresh_copy.default, aten.floor_divide.default, aten.remainder.Scalar,
          aten.remainder.Tensor)
def pointwise(ctx: RuleContext) -> Choice:
    """Elementwise ops (and broadcasts): each output dim takes the split of the first
    input that is not broadcast there, every input is brought to it; a partial sum
    passes only through ops linear in it (``neg``, ``mul`` by one partial operand,
    ``add`` of two partials, casts). A batch index used as data raises."""
    node = ctx.node
    out_shape = ctx.pshape(node)
    n = len(out_shape)
    targs = tensor_args(ctx)
    dims: list[tuple] = [()] * n
    segs = [1] * n
    # each output dim takes the split of the first input that is not broadcast there
    for order in (False, True):              # fixed values first, free parameters last
        for path, a in targs:
            if ctx.is_free_param(a) != order:
                continue
            s, sh = ctx.spec(a), ctx.pshape(a)
            off = n - len(sh)
            for d, axes in enumerate(s.dims):
                j = d + off
                taken = {x for dd in dims for x in dd}
                # an axis already splitting another output dim stays there (the other input moves)
                if axes and not dims[j] and sh[d] == out_shape[j] and not set(axes) & taken:
                    dims[j], segs[j] = axes, s.segments[d]
    used = {x for d in dims for x in d}
    partials = {tuple(ctx.spec(a).partial) for _, a in targs if ctx.spec(a).partial}
    out_partial: tuple = ()
    if partials:
        p = next(iter(partials))
        part_paths = [path for path, a in targs if ctx.spec(a).partial]
        if len(partials) == 1 and not (set(p) & used) and _partial_passes(node.target, part_paths, targs):
            out_partial = p
    batch_index = [a for _, a in targs if ctx.is_batch_index(a)]
    if batch_index and ctx.batch_axes and node.target not in (aten.add.Tensor,) :
        raise ShardingError("a batch index (arange over the batch size) is used as data; "
                            "with the batch split its local values would differ from the dense ones",
                            node=node)
    inputs = {}
    for path, a in targs:
        s, sh = ctx.spec(a), ctx.pshape(a)
        off = n - len(sh)
        req = tuple(dims[d + off] if sh[d] == out_shape[d + off] else () for d in range(len(sh)))
        rseg = tuple(segs[d + off] if req[d] else 1 for d in range(len(sh)))
        inputs[path] = ShardSpec(dims=req, segments=rseg, partial=out_partial if s.partial else ())
    return Choice(out=ShardSpec(dims=tuple(dims), segments=tuple(segs), partial=out_partial), inputs=inputs,
                  patches=_whole_sizes(ctx))


def _whole_sizes(ctx: RuleContext) -> dict:
    """A symbolic size used as a value (not a shape) must be the dense one: read by
    ``sym_size`` from a split dim it is this rank's part, so it is multiplied back
    (Gemma-3's check that the image tokens, a sum over the whole batch, number
    ``batch × tokens per image``); docs/design.md, "Shared ops"."""
    patches = {}
    for i, a in enumerate(ctx.node.args):
        if isinstance(a, fx.Node) and isinstance(a.meta.get("val"), torch.SymInt) and (read := read_split(ctx, a)):
            patches[(i,)] = {"mul": [[0, ctx.mesh.size(read)]]}
    return patches


def inplace(ctx: RuleContext) -> Choice:
    """An op that writes into its first argument (``copy_``, ``masked_fill_``, ...):
    the written tensor keeps its layout (a re-laid-out copy would take the write
    and lose it), and every other tensor argument is brought to that layout."""
    node = ctx.node
    dst = node.args[0]
    s = ctx.spec(dst)
    if s.partial and _fresh(dst, node):
        # a new tensor only this write reads (a bias added to a row-parallel product in
        # place): sum it first, the write then goes into the summed copy
        s = s.with_partial(())
    elif s.partial:
        raise ShardingError("an in-place write into a partial sum that other nodes also read cannot be made exact",
                            node=node)
    out_shape = ctx.pshape(dst)
    n = len(out_shape)
    inputs = {(0,): s}
    for path, a in tensor_args(ctx)[1:]:
        sh = ctx.pshape(a)
        off = n - len(sh)
        inputs[path] = ShardSpec(dims=tuple(s.dims[d + off] if sh[d] == out_shape[d + off] else ()
                                            for d in range(len(sh))),
                                 segments=tuple(s.segments[d + off] if sh[d] == out_shape[d + off] else 1
                                                for d in range(len(sh))))
    return Choice(out=s, inputs=inputs)


def _fresh(dst, node: fx.Node) -> bool:
    """Whether ``dst`` is a new tensor (an op's result, no view of another) that
    ``node`` alone reads."""
    if not isinstance(dst, fx.Node) or dst.op != "call_function" or list(dst.users) != [node]:
        return False
    t = dst.target
    if t is operator.getitem:                    # an element of a multi-output op: fresh as the op's results
        t = dst.args[0].target if isinstance(dst.args[0], fx.Node) else None
    if isinstance(t, torch._ops.OpOverload):
        return not any(r.alias_info is not None for r in t._schema.returns)
    return callable(t)      # our own graph functions (grouped_linear) return new tensors


def writes_first_arg(t) -> bool:
    """Whether ATen op ``t`` writes into its first argument (``copy_``, ``masked_fill_``).

    >>> writes_first_arg(torch.ops.aten.add_.Tensor), writes_first_arg(torch.ops.aten.add.Tensor)
    (True, False)"""
    if not isinstance(t, torch._ops.OpOverload) or not t._schema.arguments:
        return False
    info = t._schema.arguments[0].alias_info
    return bool(info is not None and info.is_write)


_FUNCTIONAL_POINTWISE = {"aten::masked_fill", "aten::fill", "aten::zero", "aten::clamp"}


def is_pointwise_write(t) -> bool:
    """Whether ATen op ``t`` writes elementwise into its first argument (``copy_``,
    ``add_``, ``masked_fill_``): :func:`inplace` plans it.

    >>> is_pointwise_write(torch.ops.aten.mul_.Tensor), is_pointwise_write(torch.ops.aten.mul.Tensor)
    (True, False)"""
    return writes_first_arg(t) and (t == aten.copy_.default or torch.Tag.pointwise in t.tags
                                    or t._schema.name.rstrip("_") in _FUNCTIONAL_POINTWISE)


@register(aten.alias.default, aten.contiguous.default, aten.clone.default, aten.detach.default, aten.to.dtype,
          aten.to.dtype_layout, aten._to_copy.default, aten.to.device)
def identity_like(ctx: RuleContext) -> Choice:
    """Casts, copies and aliases: the output has the input's layout. A free parameter cast
    for one elementwise op (Cohere's per-head q/k norm: ``weight.to(float32) * x``, the
    weight ``[heads, head_dim]``) takes the split of that op's other input where the two
    line up, as the elementwise rule would give the parameter itself, not held whole."""
    a = ctx.node.args[0]
    s = ctx.spec(a)
    if ctx.is_free_param(a):
        s = _split_for_user(ctx, s)
    return Choice(out=s, inputs={(0,): s})


def _split_for_user(ctx: RuleContext, s: ShardSpec) -> ShardSpec:
    """``s`` with each whole dim given the split of the sole user's other input at the
    same (right-aligned) position and size; ``s`` when that user is not elementwise or its
    other inputs are not laid out yet."""
    users = list(ctx.node.users)
    if len(users) != 1 or users[0].target not in (aten.mul.Tensor, aten.add.Tensor):
        return s
    mine = ctx.pshape(ctx.node)
    dims = list(s.dims)
    rows = set(ctx.batch_axes) | {"cp", "dp"}          # a weight splits over the model's axes only
    for b in users[0].args:
        if not isinstance(b, fx.Node) or b is ctx.node or not ctx.is_tensor(b) or ctx.spec(b) is None:
            continue
        sb, shb = ctx.spec(b), ctx.pshape(b)
        for d in range(1, min(len(mine), len(shb)) + 1):
            axes = sb.dims[-d]
            taken = {x for dd in dims for x in dd}
            if axes and not dims[-d] and shb[-d] == mine[-d] and not set(axes) & (taken | rows):
                dims[-d] = axes
    return ShardSpec(dims=tuple(dims), segments=s.segments, partial=s.partial)


@register(aten.type_as.default)
def type_as(ctx: RuleContext) -> Choice:
    """``type_as(x, other)``: ``x``'s values and shape in ``other``'s dtype; ``other``
    gives only its dtype, so its layout is taken as it is."""
    x, other = ctx.node.args[:2]
    s = ctx.spec(x)
    return Choice(out=s, inputs={(0,): s, (1,): ctx.spec(other)})


@register(aten.dropout.default)
def dropout(ctx: RuleContext) -> Choice:
    """Dropout keeps the layout; in train mode with p > 0 it runs the
    :class:`~autoshard.ir.kernels.Dropout` kernel (rank-consistent masks, no collective).
    A partial value passes: the mask is the same on every rank of its partial axes."""
    x, p, train = ctx.node.args[:3]
    s = ctx.spec(x)
    if not train or p == 0:
        return Choice(out=s, inputs={(0,): s})
    s = s.with_partial(())      # masks are drawn for whole values: a partial sum is reduced first
    return Choice.run(Dropout(p=float(p), mode=ctx.dropout, in_specs=(((0,), s),), out_spec=s),
                      notes=(f"dropout p={p:g}, {ctx.dropout} masks",))
