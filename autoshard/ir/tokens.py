"""Ops over tokens kept in their ``[batch, sequence, ...]`` shape, for graphs whose
sequence is split (context parallelism): the dense model flattens tokens into one
dim before a per-token op, a merge of a whole batch dim with a split sequence dim
that no block layout describes. :mod:`autoshard.passes.token_fold` rewrites those
flattens into these ops, which compute the same values without the merge. A
convolution along the sequence written as a padded convolution and a slice (a causal
one: both ends padded, the first ``S`` outputs kept) becomes :func:`sequence_conv`,
whose output has the sequence's length, so a split sequence keeps its split through it
(the halo rows at each block's edges are exchanged: :mod:`autoshard.runtime.parallel_ops`).

>>> import torch
>>> x, t = torch.randn(2, 3, 5), torch.tensor([[0, 1, -100], [4, 2, 3]])
>>> ref = torch.nn.functional.cross_entropy(x.view(-1, 5), t.view(-1))
>>> bool(torch.equal(token_cross_entropy(x, t), ref))
True
"""

from __future__ import annotations

import torch

__all__ = ["token_cross_entropy", "sequence_conv"]


def token_cross_entropy(logits: torch.Tensor, target: torch.Tensor, weight=None, reduction: int = 1,
                        ignore_index: int = -100, label_smoothing: float = 0.0) -> torch.Tensor:
    """``aten.cross_entropy_loss`` of ``logits`` ``[..., classes]`` flattened to rows
    against ``target`` ``[...]`` flattened alike (the arguments of that op, in its order)."""
    return torch.ops.aten.cross_entropy_loss(logits.reshape(-1, logits.shape[-1]), target.reshape(-1), weight,
                                             reduction, ignore_index, label_smoothing)


def sequence_conv(x: torch.Tensor, weight: torch.Tensor, bias, left: int, right: int, dilation: int = 1,
                  groups: int = 1) -> torch.Tensor:
    """A 1-D convolution (stride 1) along the last dim of ``x`` ``[batch, channels, time]`` with
    ``left`` zeros before it and ``right`` after, ``left + right = dilation·(kernel - 1)``: the
    output is as long as ``x`` (``left = dilation·(kernel - 1)``: a causal convolution).

    >>> x, w = torch.randn(2, 4, 9), torch.randn(4, 1, 3)
    >>> ref = torch.nn.functional.conv1d(x, w, None, 1, 2, 1, 4)[..., :9]     # padded both ends, first 9 kept
    >>> bool(torch.equal(sequence_conv(x, w, None, 2, 0, 1, 4), ref))
    True
    """
    pad = max(left, right)
    y = torch.ops.aten.conv1d(x, weight, bias, [1], [pad], [dilation], groups)
    start = pad - left
    return y[..., start:start + x.shape[-1]]
