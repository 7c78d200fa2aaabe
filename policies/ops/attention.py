"""Attention: ``scaled_dot_product_attention``, its heads split, its sequence
whole or (context parallelism) split over ``cp`` with ring or gathered keys and values.
"""

from __future__ import annotations

import torch
from torch import fx

from autoshard.ir.kernels import AttentionDropout, RingAttention
from autoshard.ir.spec import ShardSpec

from ..base import Choice, NeedReplicate, RuleContext
from .common import fallback, register

aten = torch.ops.aten

__all__ = ["sdpa"]


@register(aten.scaled_dot_product_attention.default)
def sdpa(ctx: RuleContext) -> Choice:
    """``scaled_dot_product_attention``: batch and heads keep their split, sequence and
    head dim whole; with fewer kv heads (GQA) the kv heads stay split when the head
    split divides them and are replicated otherwise. A mask follows the batch and
    head split it broadcasts over. In train mode with dropout the
    :class:`~autoshard.ir.kernels.AttentionDropout` kernel draws rank-consistent masks."""
    node = ctx.node
    q, k, v = node.args[:3]
    sq = ctx.spec(q)
    if sq.ndim != 4 or ctx.spec(k).ndim != 4:       # [batch, seq, dim] without heads (found by the OpInfo check)
        return fallback(ctx, "attention on inputs without a heads dim")
    args = list(node.args) + [None] * 4
    dropout_p = args[4] if args[4] is not None else node.kwargs.get("dropout_p", 0.0)
    mask = args[3] if isinstance(args[3], fx.Node) else node.kwargs.get("attn_mask")
    # context parallelism: queries keep their sequence split, keys and values are
    # gathered whole (backward reduce-scatters their gradients), the mask keeps the rows
    # of the local queries (docs/design.md, "Context parallelism")
    cp = ("cp",) if "cp" in ctx.mesh.axes and sq.dims[2] == ("cp",) else ()
    if cp and not isinstance(mask, fx.Node) and (node.kwargs.get("is_causal") or (len(node.args) > 5 and node.args[5])):
        raise NeedReplicate((0,), 2, "causal attention without a mask tensor cannot take its queries split on "
                                     "the sequence (the causal offset of a block is not in the op)")
    base = ShardSpec(dims=(sq.dims[0], sq.dims[1], cp, ()))
    whole_seq = ShardSpec(dims=(sq.dims[0], sq.dims[1], (), ()))
    qs, ks = ctx.pshape(q), ctx.pshape(k)
    inputs = {(0,): base}
    kv_req = whole_seq
    if ks[1] != qs[1]:                 # enable_gqa: fewer kv heads
        kv_req = ShardSpec(dims=(sq.dims[0], (), (), ())) if sq.dims[1] else whole_seq
        if sq.dims[1] and ks[1] % ctx.mesh.size(sq.dims[1]) == 0 and (qs[1] // ks[1]) >= 1:
            kv_req = whole_seq
    inputs[(1,)] = kv_req
    inputs[(2,)] = kv_req
    if isinstance(mask, fx.Node):
        ms = ctx.pshape(mask)
        off = 4 - len(ms)
        md = tuple(base.dims[d + off] if d + off < 3 and ms[d] == qs[d + off] else () for d in range(len(ms)))
        inputs[(3,) if isinstance(args[3], fx.Node) else ("kw", "attn_mask")] = ShardSpec(dims=md)
    if dropout_p and ctx.training:
        k = AttentionDropout(p=float(dropout_p), mode=ctx.dropout, in_specs=tuple(inputs.items()), out_spec=base)
        return Choice.run(k, notes=(f"attention dropout p={dropout_p:g}, {ctx.dropout} masks"
                                    + (", keys and values gathered over cp" if cp else ""),))
    if cp and ctx.cp_attention == "ring":
        # the keys and values stay split: their blocks travel around the cp ring
        ring = ShardSpec(dims=kv_req.dims[:2] + (cp, ()))
        inputs[(1,)] = inputs[(2,)] = ring
        k = RingAttention(axes=cp, in_specs=tuple(inputs.items()), out_spec=base)
        return Choice.run(k, notes=("ring attention over cp: key/value blocks sent around the ring, "
                                    "merged through their log-sum-exp",))
    return Choice(out=base, inputs=inputs, notes=("keys and values gathered over cp",) if cp else ())
