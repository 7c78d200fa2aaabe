"""``x @ W.T`` with a 2-D parameter ``W`` becomes ``aten.linear(x, W)``.

Some models multiply by a transposed weight in Python instead of calling
``nn.Linear`` (Falcon's ``FalconLinear``: ``hidden @ self.weight.T``). The export
then holds ``matmul(x, numpy_T(W))``: the parameter reaches the matmul through a
view, annotation does not see a Linear, and the planner keeps the weight whole
on every rank, exactly but not in parallel. This pass rewrites
``matmul`` / ``mm`` of a transpose (``numpy_T``, ``t``, ``transpose(0, 1)``,
``permute([1, 0])``) of a 2-D parameter into ``aten.linear`` with the parameter as
a direct operand, which computes the same values (``linear`` without bias is
``matmul(x, W.t())``), so every Linear rule applies.

    >>> import torch, transformers
    >>> from autoshard.passes.capture import capture
    >>> cfg = transformers.FalconConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
    ...     vocab_size=64, bias=False, new_decoder_architecture=False, alibi=False)
    >>> cap = capture(transformers.FalconForCausalLM(cfg))
    >>> g = fold_transposed_weights(cap).module.graph
    >>> before = sum(n.target == torch.ops.aten.numpy_T.default for n in cap.module.graph.nodes)
    >>> before, sum(n.target == torch.ops.aten.linear.default for n in g.nodes)
    (4, 5)
"""

from __future__ import annotations

import torch
from torch import fx

from .capture import Captured, fold_nodes

aten = torch.ops.aten

__all__ = ["fold_transposed_weights"]

_MATMUL = (aten.matmul.default, aten.mm.default)


def _transposed_param(w, params: set[str]) -> fx.Node | None:
    """The 2-D parameter ``w`` is the transpose of, if it is one."""
    if not isinstance(w, fx.Node) or w.op != "call_function" or len(w.users) != 1:
        return None
    p = w.args[0] if w.args else None
    if not (isinstance(p, fx.Node) and p.op == "get_attr" and p.target in params and p.meta["val"].dim() == 2):
        return None
    t, a = w.target, w.args[1:]
    if t in (aten.numpy_T.default, aten.t.default) \
            or (t == aten.transpose.int and {x % 2 for x in a} == {0, 1}) \
            or (t == aten.permute.default and [x % 2 for x in a[0]] == [1, 0]):
        return p
    return None


def fold_transposed_weights(cap: Captured) -> Captured:
    """``cap`` with every ``x @ W.T`` of a parameter ``W`` as ``aten.linear(x, W)``;
    the same ``cap`` where there is none. ``cap`` itself is not changed: the result
    holds a copy of the graph module sharing every parameter."""
    gm = cap.module
    params = {n for n, _ in gm.named_parameters(remove_duplicate=False)}

    def foldable(n):
        return n.op == "call_function" and n.target in _MATMUL and len(n.args) == 2 and not n.kwargs \
            and _transposed_param(n.args[1], params) is not None \
            and isinstance(n.args[0], fx.Node) and n.args[0].meta["val"].dim() >= 2

    return fold_nodes(cap, foldable, lambda n: (aten.linear.default, (n.args[0], _transposed_param(n.args[1], params))))
