"""``squeeze()`` without dims becomes ``squeeze.dims`` of the dims of size 1 in the capture.

``x.squeeze()`` drops every dim of size 1 *at run time*. Export proves the graph for
a batch and a sequence of at least 2, so in the capture it drops only the dims that
are 1 there (MBart's ``shift_tokens_right``: ``gather(1, eos).squeeze()`` on ``[batch, 1]``).
On a rank whose share of a split dim is one row, the bare ``squeeze`` would drop that dim
too (``[]`` where the plan expects ``[1]``); naming the dims keeps the capture's meaning
on every rank (docs/design.md, "Pipeline").

    >>> import torch
    >>> from autoshard.passes.capture import capture
    >>> class M(torch.nn.Module):
    ...     def forward(self, input_ids):
    ...         return input_ids.gather(1, input_ids[:, :1]).squeeze()
    >>> cap = capture(M(), example_inputs={"input_ids": torch.zeros(3, 5, dtype=torch.long)})
    >>> g = fold_bare_squeezes(cap).module.graph
    >>> [n.args[1] for n in g.nodes if n.target == torch.ops.aten.squeeze.dims]
    [[1]]
"""

from __future__ import annotations

import torch
from torch import fx

from .capture import Captured, fold_nodes

__all__ = ["fold_bare_squeezes"]

aten = torch.ops.aten


def _bare(n: fx.Node) -> bool:
    return n.op == "call_function" and n.target == aten.squeeze.default and \
        isinstance(n.args[0], fx.Node) and isinstance(n.args[0].meta.get("val"), torch.Tensor)


def _named(n: fx.Node) -> tuple:
    shape = n.args[0].meta["val"].shape       # a symbolic size (batch, sequence) is never 1 here
    return aten.squeeze.dims, (n.args[0], [d for d, v in enumerate(shape) if type(v) is int and v == 1])


def fold_bare_squeezes(cap: Captured) -> Captured:
    """``cap`` with every ``squeeze()`` naming the dims it drops in the capture (``cap``
    itself where there is none; ``cap`` is not changed)."""
    return fold_nodes(cap, _bare, _named)
