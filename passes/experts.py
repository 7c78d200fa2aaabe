"""Grouped (per-expert) matmuls with a parameter operand become Linear-like nodes.

A mixture-of-experts layer exported by Hugging Face runs its experts as one
grouped matmul: the routed tokens, sorted by expert, times a 3-D weight
``[E, k, n]`` whose group ``e`` multiplies the rows ``offs[e-1]:offs[e]``
(``aten._grouped_mm``, or transformers' ``grouped_mm_fallback`` custom op on
CPU). The weight reaches the op through a ``transpose`` of the stored parameter
(``[E, n, k]``, the ``nn.Linear`` layout per expert), so the planner, which
splits a parameter where it is consumed, would see a view and leave the
experts whole.

This pass folds ``op(x, transpose(P, -2, -1), offs)`` (or ``op(x, P, offs)``)
into :func:`~autoshard.ir.grouped.grouped_linear` ``(x, P, offs, transposed, impl)`` with the
parameter as a direct operand. Annotation then counts it as a ``linear`` (it
appears in the plan table like any Linear), and the Linear rules split its
output features (column) or its input features (row) per expert, as for a
dense MLP: Megatron-style expert tensor parallelism. The graph computes the
same values: ``grouped_linear`` calls the op it replaced.

    >>> import transformers
    >>> from autoshard.passes.capture import capture
    >>> cfg = transformers.MixtralConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
    ...     num_attention_heads=4, num_key_value_heads=4, vocab_size=64, num_local_experts=4)
    >>> cap = fold_grouped_weights(capture(transformers.MixtralForCausalLM(cfg)))
    >>> sorted(n.args[1].target for n in cap.module.graph.nodes if n.target is grouped_linear)
    ['model.layers.0.mlp.experts.down_proj', 'model.layers.0.mlp.experts.gate_up_proj']
"""

from __future__ import annotations

import torch
from torch import fx

from autoshard.ir.grouped import grouped_linear, grouped_ops

import dataclasses

from .capture import Captured, copy_sharing, fold_nodes

aten = torch.ops.aten

__all__ = ["fold_grouped_weights", "count_on_floats"]


def _param_operand(w, params: set[str]) -> tuple[fx.Node, bool] | None:
    """The parameter behind ``w`` and whether ``w`` is its transpose over the last two dims."""
    if isinstance(w, fx.Node) and w.op == "get_attr" and w.target in params:
        return w, False
    if isinstance(w, fx.Node) and w.target == aten.transpose.int and len(w.args) == 3:
        p, a, b = w.args
        if isinstance(p, fx.Node) and p.op == "get_attr" and p.target in params and \
                {a % 3, b % 3} == {1, 2} and p.meta["val"].dim() == 3:
            return p, True
    return None


def fold_grouped_weights(cap: Captured) -> Captured:
    """``cap`` with every grouped matmul whose weight is a parameter (or its transpose)
    rewritten as :func:`grouped_linear`; the same ``cap`` where there is none. ``cap``
    itself is not changed: the result holds a copy of the graph module sharing
    every parameter."""
    ops = {v: k for k, v in grouped_ops().items()}
    gm = cap.module
    params = {n for n, _ in gm.named_parameters(remove_duplicate=False)}

    def foldable(n):
        return n.op == "call_function" and n.target in ops and len(n.args) >= 3 and \
            n.args[2] is not None and _param_operand(n.args[1], params) is not None and \
            not n.args[3:] and not n.kwargs.get("bias") and n.kwargs.get("out_dtype") is None

    def fold(n):
        p, transposed = _param_operand(n.args[1], params)
        return grouped_linear, (n.args[0], p, n.args[2], transposed, ops[n.target])

    return fold_nodes(cap, foldable, fold)


def _integer_histc(n: fx.Node) -> bool:
    v = n.args[0].meta.get("val") if n.target is aten.histc.default and isinstance(n.args[0], fx.Node) else None
    return isinstance(v, torch.Tensor) and not v.is_floating_point()


def count_on_floats(cap: Captured) -> Captured:
    """``cap`` with every ``histc`` of integers given its input cast to float first.

    Transformers' MoE routing counts tokens per expert with ``histc`` on integers when
    the device is not a CPU, floats on a CPU; a model captured on the meta device (a
    plan, a new input signature, a generation step) takes the integer branch, which
    the CPU kernel refuses. Exact for counts below 2**24. The same ``cap`` where there
    is none; ``cap`` itself is not changed."""
    if not any(_integer_histc(n) for n in cap.module.graph.nodes):
        return cap
    new = copy_sharing(cap.module)
    g = new.graph
    for n in list(g.nodes):
        if _integer_histc(n):
            with g.inserting_before(n):
                f = g.call_function(aten._to_copy.default, (n.args[0],), {"dtype": torch.float32})
            f.meta["val"] = n.args[0].meta["val"].float()
            n.args = (f,) + tuple(n.args[1:])
    g.lint()
    new.recompile()
    return dataclasses.replace(cap, module=new)
