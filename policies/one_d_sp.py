"""1D tensor parallelism with sequence parallelism (Korthikanti et al., "Reducing
Activation Recomputation in Large Transformer Models").

The Megatron pairs of :class:`~autoshard.policies.one_d.OneD`, with the
activations between them split on the sequence over ``tp``: the residual stream,
norms, dropout and residual adds hold ``1/tp`` of the tokens. Found from the
graph, as 1D is:

- the vocabulary-parallel token lookup (and any other split lookup) is
  reduce-scattered on the sequence instead of all-reduced
  (:class:`~autoshard.ir.kernels.VocabEmbedding` with ``scatter_dim``);
- a column-parallel Linear reading a sequence-split input gathers it first: the
  planner's re-layout, one all-gather whose backward reduce-scatters the
  gradient (the ``gather_partial`` step), shared by the Linears reading it;
- a row-parallel Linear reduce-scatters its product on the sequence in place of
  the all-reduce (:class:`~autoshard.ir.kernels.RowLinear` with ``scatter_dim``);
  where its output has no sequence dim of its own (tokens flattened, GPT-2's
  Conv1D), it all-reduces and the stream takes its slice.

Everything else (norms, dropout, pointwise ops) follows the generic rules, which
keep the sequence split. The sequence must divide ``tp``. The layout is drawn in
docs/design.md, "1d-sp".

>>> from autoshard.policies import make_policy
>>> p = make_policy("1d-sp", 4)
>>> p.mesh, p.seq_split()
(Mesh(axes=('tp',), sizes=(4,)), 4)
"""

from __future__ import annotations

import dataclasses

import torch

from autoshard.ir.argpath import get_arg
from autoshard.ir.kernels import RowLinear, VocabEmbedding
from autoshard.ir.spec import ShardSpec

from .base import Choice, RuleContext, SymbolicSizes
from .ops.matmul import linear_operands
from .one_d import OneD

__all__ = ["OneDSP"]

aten = torch.ops.aten


class OneDSP(OneD):
    """1D tensor parallelism with the activations between the Megatron pairs split on
    the sequence over ``tp`` (same mesh and weight splits as :class:`OneD`).

    >>> p = OneDSP(OneDSP.make_mesh(2))
    >>> p.label(p.mesh), p.seq_split(), p.dim_splits()[0]["vocab_size"]
    ('1d-sp [2]', 2, 2)
    """

    name = "1d-sp"
    order = 1
    size_unit = "tp sizes"
    fuse_low_rank = False       # each row product is reduce-scattered on the sequence
    composes_with_cp = False
    composes_with_cp_why = ("its lookups already reduce-scatter the sequence over tp, and the cp split would "
                            "have to sit outside that split (not a local cut); mode='1d' with cp splits the "
                            "activations on the sequence through the blocks as well")

    def seq_split(self) -> int:
        """The TP size (times ``cp``): a call's sequence length must be a multiple of it."""
        return self.mesh.size(self.tp_axes) * self.cp

    def seq_split_why(self) -> str:
        """What cuts the sequence: tp, between the blocks' Linears."""
        return f"1d-sp cuts it into tp={self.mesh.size(self.tp_axes)} blocks between the blocks' Linears"

    # ------------------------------------------------------------------ linear
    def linear(self, ctx: RuleContext) -> Choice:
        """The 1D rule on the input as gathered from its sequence split; a row-parallel
        product is reduce-scattered on the sequence instead of all-reduced."""
        node = ctx.node
        sx = ctx.spec(get_arg(node, linear_operands(node)[0]))
        tp = self.tp_axes
        if any(d == tp for d in sx.dims[:-1]):
            # a sequence-split input: gathered first (its re-layout), then the 1D rule
            sx = ShardSpec(dims=tuple(() if d == tp else d for d in sx.dims),
                           segments=tuple(1 if d == tp else g for d, g in zip(sx.dims, sx.segments)))
        choice = self._linear(ctx, sx)
        seq = _seq_dim(ctx.pshape(node))
        if isinstance(choice.kernel, RowLinear) and seq is not None:
            # reduce-scatter the row product on the sequence in place of the all-reduce
            k = choice.kernel
            k = dataclasses.replace(k, scatter_dim=seq, out_spec=k.out_spec.with_dim(seq, tp))
            return choice.replace(out=k.out_spec, kernel=k, notes=choice.notes + ("reduce-scattered on the sequence",))
        return choice

    # --------------------------------------------------------------- embedding
    def embedding(self, ctx: RuleContext) -> Choice:
        """The 1D rule; a vocab-parallel lookup is reduce-scattered on the sequence."""
        choice = super().embedding(ctx)
        k = choice.kernel
        if not isinstance(k, VocabEmbedding):
            return choice
        seq = _seq_dim(ctx.pshape(ctx.node))
        if seq is None:
            return choice
        tp = self.tp_axes
        out = k.out_spec.with_partial(()).with_dim(seq, tp)
        kernel = VocabEmbedding(axes=tp, scatter_dim=seq, in_specs=k.in_specs, out_spec=out)
        return Choice.run(kernel, weight=choice.weight, notes=("reduce-scattered on the sequence",))


def _seq_dim(shape) -> int | None:
    """The dim of a probe shape that is the sequence (its symbol's prime)."""
    hits = [d for d, v in enumerate(shape) if v == SymbolicSizes.SEQ]
    return hits[0] if len(hits) == 1 else None
