"""Classify graph nodes by what they compute, from ATen ops and operand kinds only.

Kinds: ``linear`` (``aten.linear`` / ``addmm`` / ``mm`` / ``matmul`` with a
parameter operand, and the per-expert :func:`~autoshard.passes.experts.grouped_linear`), ``norm`` (``layer_norm``, ``rms_norm``, or the inline RMSNorm
pattern ``pow → mean → add → rsqrt → mul``, counted at its ``mean``),
``attention`` (``scaled_dot_product_attention`` or the eager
``softmax(Q·Kᵀ)·V`` pattern, counted at the softmax), ``embedding``, ``loss``,
``pointwise``, ``view``, ``reduction``, ``other``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import fx

from autoshard.ir.grouped import grouped_linear

__all__ = ["Annotation", "annotate", "module_path", "param_names"]

aten = torch.ops.aten

LINEAR_OPS = {aten.linear.default, aten.addmm.default, aten.mm.default, aten.matmul.default}
NORM_OPS = {aten.layer_norm.default, aten.native_layer_norm.default}
if hasattr(aten, "rms_norm"):
    NORM_OPS.add(aten.rms_norm.default)
ATTN_OPS = {aten.scaled_dot_product_attention.default}
SOFTMAX_OPS = {aten.softmax.int, aten._softmax.default}
LOSS_OPS = {aten.cross_entropy_loss.default, aten.mse_loss.default, aten.nll_loss.default,
            aten.binary_cross_entropy_with_logits.default}
VIEW_OPS = {aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.expand.default,
            aten.unsqueeze.default, aten.squeeze.dim, aten.squeeze.dims, aten.squeeze.default,
            aten.transpose.int, aten.permute.default, aten.t.default, aten.flatten.using_ints,
            aten.alias.default, aten.contiguous.default, aten.clone.default}
REDUCTION_OPS = {aten.mean.dim, aten.sum.dim_IntList, aten.amax.default, aten.mean.default, aten.sum.default}


@dataclass(frozen=True)
class Annotation:
    kind: str
    module: str
    weight: str | None = None       # get_attr target of the parameter operand (linear / embedding / norm)


def module_path(node: fx.Node) -> str:
    stack = node.meta.get("nn_module_stack") or {}
    if not stack:
        return ""
    path = list(stack.values())[-1][0]
    return "" if path.startswith("_empty") else path


def param_names(gm: fx.GraphModule) -> set[str]:
    return {n for n, _ in gm.named_parameters(remove_duplicate=False)}


def _is_param(arg, params: set[str]) -> bool:
    return isinstance(arg, fx.Node) and arg.op == "get_attr" and arg.target in params


def _linear_weight(node: fx.Node, params: set[str]) -> str | None:
    if node.target is grouped_linear:
        w = node.args[1]
    elif node.target in (aten.linear.default,):
        w = node.args[1]
    elif node.target == aten.addmm.default:
        w = node.args[2]
    else:       # mm / matmul: x @ W only; W @ x (Mamba's dt_proj.weight @ x) is a plain matmul
        w = node.args[1]
    return w.target if _is_param(w, params) else None


def _is_rms_mean(node: fx.Node) -> bool:
    """``mean(pow(x, 2), [-1], keepdim)`` followed by ``add(eps) → rsqrt``."""
    if node.target != aten.mean.dim:
        return False
    src = node.args[0]
    if not (isinstance(src, fx.Node) and src.target == aten.pow.Tensor_Scalar and src.args[1] == 2):
        return False
    for u in node.users:
        if u.target in (aten.add.Tensor, aten.add.Scalar) and any(v.target == aten.rsqrt.default for v in u.users):
            return True
    return False


def _is_eager_attention(node: fx.Node) -> bool:
    if node.target not in SOFTMAX_OPS:
        return False
    src = node.args[0]
    seen = 0
    while isinstance(src, fx.Node) and seen < 6:
        if src.target in (aten.matmul.default, aten.bmm.default):
            return True
        src = src.args[0] if src.args else None
        seen += 1
    return False


def annotate(gm: fx.GraphModule) -> dict[str, Annotation]:
    """Annotation of every node by name.

    Example:
        >>> from transformers import LlamaConfig, LlamaForCausalLM
        >>> from autoshard.passes.capture import capture
        >>> cfg = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        ...                   num_attention_heads=4, num_key_value_heads=2, vocab_size=64)
        >>> ann = annotate(capture(LlamaForCausalLM(cfg)).module)
        >>> sorted({a.kind for a in ann.values()} & {"linear", "norm", "attention", "embedding", "loss"})
        ['attention', 'embedding', 'linear', 'loss', 'norm']
    """
    params = param_names(gm)
    out: dict[str, Annotation] = {}
    for node in gm.graph.nodes:
        mod = module_path(node)
        t = node.target
        kind, weight = "other", None
        if node.op == "call_function":
            if (t in LINEAR_OPS or t is grouped_linear) and _linear_weight(node, params):
                kind, weight = "linear", _linear_weight(node, params)
            elif t in NORM_OPS:
                kind = "norm"
                w = node.args[2] if len(node.args) > 2 else None
                weight = w.target if _is_param(w, params) else None
            elif _is_rms_mean(node):
                kind = "norm"
            elif t in ATTN_OPS or _is_eager_attention(node):
                kind = "attention"
            elif t == aten.embedding.default:
                kind, weight = "embedding", node.args[0].target if _is_param(node.args[0], params) else None
            elif t in LOSS_OPS:
                kind = "loss"
            elif t in VIEW_OPS:
                kind = "view"
            elif t in REDUCTION_OPS:
                kind = "reduction"
            elif isinstance(t, torch._ops.OpOverload) and torch.Tag.pointwise in t.tags:
                kind = "pointwise"
        out[node.name] = Annotation(kind, mod, weight)
    return out
