"""Matmuls between activations (attention's ``QKᵀ`` and ``PV``, ``baddbmm``).
A Linear (a matmul with a parameter operand) is the mode's own rule
(:meth:`autoshard.policies.base.Policy.linear`).
"""

from __future__ import annotations

import torch

from autoshard.ir.spec import ShardSpec

from ..base import Choice, RuleContext
from .common import fallback, register

aten = torch.ops.aten

__all__ = ["baddbmm", "matmul"]


@register(aten.matmul.default, aten.bmm.default, aten.mm.default)
def matmul(ctx: RuleContext) -> Choice:
    """``matmul`` / ``bmm`` / ``mm`` between activations (attention's ``QKᵀ`` and ``PV``):
    batch dims keep their split; a contracted dim split alike on both sides gives a
    partial sum over its axes; a vector operand falls back."""
    a, b = ctx.node.args[:2]
    sa, sb = ctx.spec(a), ctx.spec(b)
    if sa.ndim < 2 or sb.ndim < 2:
        return fallback(ctx, "matmul with a vector operand")
    out_shape = ctx.pshape(ctx.node)
    n = len(out_shape)
    bd = [()] * (n - 2)
    for s, sh in ((sa, ctx.pshape(a)), (sb, ctx.pshape(b))):
        off = (n - 2) - (len(sh) - 2)
        for d in range(len(sh) - 2):
            if s.dims[d] and sh[d] == out_shape[d + off] and not bd[d + off]:
                bd[d + off] = s.dims[d]
    ka, kb = sa.dims[-1], sb.dims[-2]
    part: tuple = ()
    if ka and ka == kb:
        part, kk = ka, ka
    else:
        kk = ()

    def req(s, sh, last2):
        off = (n - 2) - (len(sh) - 2)
        dd = tuple(bd[d + off] if sh[d] == out_shape[d + off] else () for d in range(len(sh) - 2)) + last2
        return ShardSpec(dims=dd)

    ra = req(sa, ctx.pshape(a), (sa.dims[-2] if not set(sa.dims[-2]) & set(sb.dims[-1]) else (), kk))
    rb = req(sb, ctx.pshape(b), (kk, sb.dims[-1] if not set(sb.dims[-1]) & set(ra.dims[-2]) else ()))
    out = ShardSpec(dims=tuple(bd) + (ra.dims[-2], rb.dims[-1]), partial=part)
    return Choice(out=out, inputs={(0,): ra, (1,): rb})


@register(aten.baddbmm.default)
def baddbmm(ctx: RuleContext) -> Choice:
    """``beta·input + alpha·(b1 @ b2)``: the batched matmul's layout; ``input``
    (broadcast) follows it. A partial product cannot take ``input`` once per rank."""
    node = ctx.node
    inp, b1, b2 = node.args[:3]
    mm = matmul(_Shifted(ctx, (b1, b2)))
    if mm.fallback or mm.out.partial:
        return fallback(ctx, "baddbmm with a contracted split")
    out = mm.out
    n = out.ndim
    sh = ctx.pshape(inp)
    off = n - len(sh)
    oshape = ctx.pshape(node)
    req = ShardSpec(dims=tuple(out.dims[d + off] if sh[d] == oshape[d + off] else () for d in range(len(sh))))
    return Choice(out=out, inputs={(0,): req, (1,): mm.inputs[(0,)], (2,): mm.inputs[(1,)]})


class _Shifted:
    """A view of ``ctx`` whose node arguments are ``args`` (to reuse a rule on a sub-expression)."""

    def __init__(self, ctx, args):
        self._ctx = ctx
        self.node = _ArgsView(ctx.node, args)

    def __getattr__(self, k):
        return getattr(self._ctx, k)


class _ArgsView:
    def __init__(self, node, args):
        self._node, self.args, self.kwargs = node, tuple(args), {}

    def __getattr__(self, k):
        return getattr(self._node, k)
