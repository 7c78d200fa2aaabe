"""The per-expert Linear the graph runs after :mod:`autoshard.passes.experts`.

``grouped_linear(x, w, offs, transposed, impl)`` is the grouped matmul it
replaced (``aten._grouped_mm`` or transformers' ``grouped_mm_fallback``) with the
parameter as a direct operand: rows ``offs[e-1]:offs[e]`` of ``x`` times expert
``e``'s weight. On a rank the weight is that rank's block of every expert; the
groups (token counts per expert) are whole.

    >>> import transformers.integrations.moe       # registers transformers::grouped_mm_fallback
    >>> x, w = torch.ones(3, 2), torch.arange(8.).view(2, 2, 2)       # 2 experts, [E, n, k]
    >>> grouped_linear(x, w, torch.tensor([1, 3]), True, "transformers")
    tensor([[ 1.,  5.],
            [ 9., 13.],
            [ 9., 13.]])
"""

from __future__ import annotations

import torch

__all__ = ["grouped_linear", "grouped_ops", "grouped_weight_dims"]


def grouped_ops() -> dict:
    """Grouped-matmul ops by name, read at call time (transformers registers its
    op when its MoE code is imported): ``op(x[S, k], w[E, k, n], offs[E]) -> [S, n]``."""
    ops = {}
    if hasattr(torch.ops.aten, "_grouped_mm"):
        ops["aten"] = torch.ops.aten._grouped_mm.default
    try:
        ops["transformers"] = torch.ops.transformers.grouped_mm_fallback.default
    except (AttributeError, RuntimeError):      # transformers' MoE code not imported
        pass
    return ops


def grouped_linear(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor, transposed: bool, impl: str) -> torch.Tensor:
    """``impl``'s grouped matmul of ``x`` with ``w`` (``[E, n, k]`` when ``transposed``,
    the stored per-expert ``nn.Linear`` layout, else ``[E, k, n]``) over the groups ``offs``."""
    return grouped_ops()[impl](x, w.transpose(-2, -1) if transposed else w, offs)


def grouped_weight_dims(node) -> tuple[int, int]:
    """``(n_dim, k_dim)`` of a ``grouped_linear`` node's 3-D weight: output and input features."""
    return (1, 2) if node.args[3] else (2, 1)
