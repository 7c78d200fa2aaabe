"""Ops over tokens kept in their ``[batch, sequence, ...]`` shape, for graphs whose
sequence is split (context parallelism): the dense model flattens tokens into one
dim before a per-token op, a merge of a whole batch dim with a split sequence dim
that no block layout describes. :mod:`autoshard.passes.token_fold` rewrites those
flattens into these ops, which compute the same values without the merge.

>>> import torch
>>> x, t = torch.randn(2, 3, 5), torch.tensor([[0, 1, -100], [4, 2, 3]])
>>> ref = torch.nn.functional.cross_entropy(x.view(-1, 5), t.view(-1))
>>> bool(torch.equal(token_cross_entropy(x, t), ref))
True
"""

from __future__ import annotations

import torch

__all__ = ["token_cross_entropy"]


def token_cross_entropy(logits: torch.Tensor, target: torch.Tensor, weight=None, reduction: int = 1,
                        ignore_index: int = -100, label_smoothing: float = 0.0) -> torch.Tensor:
    """``aten.cross_entropy_loss`` of ``logits`` ``[..., classes]`` flattened to rows
    against ``target`` ``[...]`` flattened alike (the arguments of that op, in its order)."""
    return torch.ops.aten.cross_entropy_loss(logits.reshape(-1, logits.shape[-1]), target.reshape(-1), weight,
                                             reduction, ignore_index, label_smoothing)
