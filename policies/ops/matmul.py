"""Matmul and Linear: matmuls between activations (attention's ``QKᵀ`` and ``PV``,
``baddbmm``), and what every mode's Linear rule
(:meth:`autoshard.policies.base.Policy.linear`) reads: where the input, weight and
bias of a Linear-like ATen op sit (no HF names), the group offsets of a grouped
Linear, and the tied LM head's partial product.

>>> from torch import fx
>>> g = fx.Graph()
>>> b, x, w = g.placeholder("b"), g.placeholder("x"), g.placeholder("w")
>>> linear_operands(g.call_function(torch.ops.aten.addmm.default, (b, x, w)))   # GPT-2 Conv1D: w is [k, n]
((1,), (2,), (0,), 1, 0)
>>> linear_operands(g.call_function(torch.ops.aten.linear.default, (x, w)))     # nn.Linear: w is [n, k]
((0,), (1,), None, 0, 1)
"""

from __future__ import annotations

import torch

from autoshard.ir.grouped import grouped_linear, grouped_weight_dims
from autoshard.ir.kernels import PartialHead
from autoshard.ir.spec import ShardSpec

from ..base import Choice, RuleContext
from .common import fallback, register

aten = torch.ops.aten

__all__ = ["baddbmm", "grouped_offs_spec", "linear_operands", "matmul", "rows_whole", "tied_head_choice"]


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


# ---------------------------------------------------- what a mode's Linear reads
def linear_operands(node):
    """``(x_path, w_path, b_path | None, n_dim, k_dim)`` of a linear node, where the
    weight's ``n_dim`` is its output features and ``k_dim`` its input features.

    ``aten.linear(x, w[n,k], b)``; ``aten.addmm(b, x, w[k,n])`` (GPT-2 Conv1D);
    ``aten.mm/matmul(x, w[k,n])``; :func:`~autoshard.ir.grouped.grouped_linear` ``(x, w[E,n,k]
    or w[E,k,n], offs)``, a Linear per expert (its weight is 3-D)."""
    t = node.target
    if t is grouped_linear:
        return (0,), (1,), None, *grouped_weight_dims(node)
    if t == aten.linear.default:
        b = (2,) if len(node.args) > 2 and node.args[2] is not None else None
        return (0,), (1,), b, 0, 1
    if t == aten.addmm.default:
        return (1,), (2,), (0,), 1, 0
    return (0,), (1,), None, 1, 0


def grouped_offs_spec(mesh, rows_axes) -> ShardSpec:
    """The group offsets a grouped Linear needs: for rows split over ``rows_axes``,
    this rank's counts (a partial sum over those axes of the dense offsets, as the
    ``histc`` rule gives them); whole rows need the dense offsets."""
    return ShardSpec(dims=((),), partial=tuple(a for a in mesh.axes if a in rows_axes))


def rows_whole(rows, row_axes) -> bool:
    """Whether a SUMMA Linear's input rows (the split axes of the dims before its
    features) use none of the grid's ``row_axes``: every rank of the row group then
    holds all the rows (a static batch kept whole), so dW is not summed over them.
    Rows split over some of the axes but not all fit neither schedule.

    >>> rows_whole(((), ()), ("row",)), rows_whole((("row",), ()), ("row",))
    (True, False)
    """
    used = {a for d in rows for a in d} & set(row_axes)
    if used and used != set(row_axes):
        raise ValueError(f"the input rows are split over {sorted(used)}, part of the SUMMA row axes "
                         f"{list(row_axes)}: all of them or none")
    return not used


def tied_head_choice(ctx: RuleContext, xp, wp, bp, rows, rseg, col: tuple[str, ...], ws: ShardSpec,
                     q: int) -> Choice:
    """A Linear that reuses an embedding table split on hidden over ``col``
    (tied LM head): ``x·Eᵀ`` is partial over ``col`` and reduce-scattered on vocab.

    ``rows``/``rseg`` give the token dims' layout of ``x``; the output keeps them
    and splits the vocabulary over ``col``."""
    xreq = ShardSpec(dims=rows + (col,), segments=rseg + (1,))
    ins = [(xp, xreq), (wp, ws)]
    if bp:
        ins.append((bp, ShardSpec(dims=(col,))))
    out = ShardSpec(dims=rows + (col,), segments=rseg + (1,))
    label = ",".join(col)
    return Choice.run(PartialHead(col=col, x=xp, w=wp, b=bp, in_specs=tuple(ins), out_spec=out),
                      weight=f"tied table [vocab, hidden/{q} over {label}]",
                      notes=(f"x·Eᵀ partial over {label}, reduce-scattered on vocab",))
