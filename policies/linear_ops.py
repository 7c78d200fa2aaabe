"""Where the input, weight and bias of a Linear-like ATen op sit (no HF names).

>>> import torch
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
from autoshard.ir.spec import ShardSpec

aten = torch.ops.aten

__all__ = ["grouped_offs_spec", "linear_operands", "rows_whole"]


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
