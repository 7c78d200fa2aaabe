"""Losses: cross-entropy, vocab-parallel when the logits are split on the classes.
The embedding lookup that feeds the model is the mode's own rule
(:meth:`autoshard.policies.base.Policy.embedding`).
"""

from __future__ import annotations

import torch
from torch import fx

from autoshard.ir.kernels import CrossEntropy
from autoshard.ir.spec import ShardSpec, replicated
from autoshard.ir.tokens import token_cross_entropy

from ..base import Choice, RuleContext
from .common import fallback, register

aten = torch.ops.aten

__all__ = ["cross_entropy"]


@register(aten.cross_entropy_loss.default, token_cross_entropy)
def cross_entropy(ctx: RuleContext) -> Choice:
    """``cross_entropy_loss`` in every form (class weights, ``label_smoothing``,
    ``ignore_index``, ``reduction`` mean / sum / none, spatial targets ``[N, C, ...]``):
    the :class:`~autoshard.ir.kernels.CrossEntropy` kernel, vocab-parallel when the logits
    are split (or partial) on the classes. Each token's loss is local (per sample); a
    mean or sum takes the global sum over every axis splitting the tokens (the batch's,
    cp's sequence) and, for a mean, the global weight of the tokens kept (their count
    without weights), so the loss is the dense one on every rank (docs/design.md, "The
    batch contract"). ``reduction='none'`` keeps the tokens' split. Probability targets
    and an unbatched input go through :func:`~autoshard.policies.ops.common.fallback`."""
    node = ctx.node
    logits, target = node.args[:2]
    names = ("weight", "reduction", "ignore_index", "label_smoothing")
    args = list(node.args) + [None] * 6
    weight, reduction, ignore_index, smoothing = (args[2 + i] if args[2 + i] is not None else node.kwargs.get(k)
                                                  for i, k in enumerate(names))
    reduction = 1 if reduction is None else reduction
    ignore_index = -100 if ignore_index is None else ignore_index
    smoothing = float(smoothing or 0.0)
    sl = ctx.spec(logits)
    tokens = node.target is token_cross_entropy      # [..., V] logits, class last (passes/token_fold.py)
    floating_target = target.meta["val"].is_floating_point()
    if floating_target or sl.ndim < 2 or reduction not in (0, 1, 2) or \
            (weight is not None and ctx.pshape(weight)[0] != ctx.pshape(logits)[-1 if tokens else 1]):
        return fallback(ctx, "cross-entropy with probability targets, an unbatched input or a class weight "
                              "of another size than the classes is computed on gathered logits")
    cd = sl.ndim - 1 if tokens else 1
    vocab_axes = sl.dims[cd] if not sl.partial else (
        sl.partial if ctx.pshape(logits)[cd] % ctx.mesh.size(sl.partial) == 0 else ())
    lead = tuple(sl.dims[d] for d in range(sl.ndim) if d != cd)
    # the token sum runs over every axis splitting the token dims (the batch's, and cp's sequence)
    rows = tuple(a for a in ctx.mesh.axes if any(a in d for d in lead))
    req_l = ShardSpec(dims=lead[:cd] + (vocab_axes,) + lead[cd:])
    req_t = ShardSpec(dims=lead)
    ins = [((0,), req_l), ((1,), req_t)]
    if isinstance(weight, fx.Node):
        ins.append(((2,) if isinstance(args[2], fx.Node) else ("kw", "weight"), replicated(1)))
    k = CrossEntropy(vocab_axes=vocab_axes, batch_axes=rows, ignore_index=int(ignore_index), reduction=int(reduction),
                     smoothing=smoothing, weighted=weight is not None, class_dim=cd if cd != sl.ndim - 1 else -1,
                     in_specs=tuple(ins), out_spec=req_t if reduction == 0 else replicated(0))
    how = {0: "per-token losses keep the split", 1: "global mean", 2: "global sum"}[int(reduction)]
    extra = ", ".join(x for x in (f"label smoothing {smoothing:g}" if smoothing else "",
                                  "class weights" if weight is not None else "",
                                  "spatial targets" if cd != sl.ndim - 1 else "") if x)
    return Choice.run(k, grad_complete=frozenset({(0,)}),
                      notes=(("vocab-parallel" if vocab_axes else "local") + " cross-entropy"
                             + (f" ({extra})" if extra else "")
                             + (f", couples samples: {how} over {','.join(rows)}" if rows and reduction else "")
                             + (f", {how}" if rows and not reduction else ""),))
