"""The vocabulary-parallel kernels: the embedding whose rows are split, and the
cross-entropy over logits split along the vocabulary and/or the batch."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .. import collectives as C
from .common import autocast_on

__all__ = ["vocab_embedding", "cross_entropy"]


def vocab_embedding(w, ids, *, group: str, padding_idx: int = -1, reduce: bool = True,
                    scatter_dim: int | None = None):
    """Lookup in this rank's vocabulary range; other rows are zero; all-reduce
    (``reduce=False``: the partial sum, reduced later by the plan; ``scatter_dim``:
    reduce-scattered on that dim, the sequence of 1d-sp)."""
    v_loc = w.shape[0]
    lo = C.rank_in(group, ids) * v_loc           # a tensor under torch.compile: one graph on every rank
    inside = (ids >= lo) & (ids < lo + v_loc)
    local = torch.where(inside, ids - lo, torch.zeros_like(ids))
    # the padding row gets no gradient, as in the dense lookup; it lives on one rank
    if isinstance(lo, int):
        pad = padding_idx - lo if padding_idx is not None and lo <= padding_idx < lo + v_loc else None
        out = F.embedding(local, w, padding_idx=pad)
    else:           # the rank is not known while tracing: the padding tokens' rows stop the gradient
        out = F.embedding(local, w)
        if padding_idx is not None and padding_idx >= 0:
            out = torch.where((ids == padding_idx).unsqueeze(-1), out.detach(), out)
    out = out * inside.unsqueeze(-1).to(w.dtype)
    if scatter_dim is not None:
        return C.reduce_scatter_to(out, scatter_dim, group)
    return C.reduce_from(out, group) if reduce else out


class _VocabParallelCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, group: str, ignore_index: int):
        v_loc = logits.shape[-1]
        lo = C.rank_in(group, target) * v_loc      # a tensor under torch.compile: one graph on every rank
        lmax = C.all_reduce_max(logits.detach().max(dim=-1).values, group)
        shifted = logits - lmax.unsqueeze(-1)
        exp = shifted.exp()
        sumexp = C.all_reduce(exp.sum(-1), group, "sum")
        inside = (target >= lo) & (target < lo + v_loc)
        idx = torch.where(inside, target - lo, torch.zeros_like(target))
        picked = shifted.gather(-1, idx.unsqueeze(-1)).squeeze(-1) * inside.to(logits.dtype)
        picked = C.all_reduce(picked, group, "sum")
        valid = (target != ignore_index).to(logits.dtype)
        loss = (sumexp.log() - picked) * valid
        ctx.save_for_backward(exp / sumexp.unsqueeze(-1), idx, inside, valid)
        return loss

    @staticmethod
    def backward(ctx, g):
        soft, idx, inside, valid = ctx.saved_tensors
        gv = (g * valid).unsqueeze(-1)
        d = soft * gv
        d.scatter_add_(-1, idx.unsqueeze(-1), -(inside.to(d.dtype).unsqueeze(-1) * gv))
        return d, None, None, None


def cross_entropy(logits, target, weight=None, *, vocab_group: str | None, batch_group: str | None,
                  ignore_index: int = -100, reduction: int = 1, smoothing: float | None = None,
                  class_dim: int | None = None):
    """Token cross-entropy of a batch split over ``batch_group`` with logits possibly
    split on the classes over ``vocab_group``: a mean (``reduction=1``) or sum (2) is
    global and identical on every rank; ``reduction=0`` gives each local token's loss.
    ``weight`` (class weights, whole), ``smoothing`` (label smoothing) and ``class_dim``
    (1: spatial targets) follow ``torch.nn.functional.cross_entropy``; given any of
    them (even as defaults) the general path runs (:func:`_ce_general`).
    Under autocast it runs in float32, as autocast runs ``cross_entropy_loss``."""
    if autocast_on(logits):
        logits = logits.float()
    if smoothing is not None or class_dim is not None or weight is not None or reduction == 0:
        return _ce_general(logits, target, weight, vocab_group, batch_group, ignore_index, reduction,
                           smoothing or 0.0, -1 if class_dim is None else class_dim)
    if logits.dim() > 2:        # tokens kept apart (autoshard.ir.tokens.token_cross_entropy)
        logits, target = logits.reshape(-1, logits.shape[-1]), target.reshape(-1)
    if vocab_group is not None:
        tok = _VocabParallelCE.apply(logits, target, vocab_group, ignore_index)
    else:
        tok = F.cross_entropy(logits, target, reduction="none", ignore_index=ignore_index)
    total = tok.sum()
    count = (target != ignore_index).sum().to(logits.dtype)
    if batch_group is not None:
        total = C.reduce_from(total, batch_group)
        count = C.all_reduce_nograd(count, batch_group)
    return total / count if reduction == 1 else total


def _ce_general(logits, target, weight, vocab_group, batch_group, ignore_index: int, reduction: int,
                smoothing: float, class_dim: int):
    """Each token's ``(1-ε)·w[y]·(lse - l_y) + ε/C·Σ_c w_c·(lse - l_c)`` (0 where ignored),
    as ``cross_entropy_loss`` computes it, from per-token sums over the classes: over a
    class split they are partial and all-reduced together (one call, backward identity:
    every rank holds the same loss). Classes whose logit is ``-inf`` (a padded vocabulary,
    :mod:`autoshard.passes.pad`) take no part in the smoothing term, so ``C`` counts the
    finite ones. A mean divides the global sum by the global ``Σ w[y]`` of the tokens kept."""
    shape = target.shape
    if class_dim != -1 and class_dim != logits.dim() - 1:
        logits = logits.movedim(class_dim, -1)
    v_loc = logits.shape[-1]
    logits, target = logits.reshape(-1, v_loc), target.reshape(-1)
    valid = target != ignore_index
    safe = torch.where(valid, target, torch.zeros_like(target))
    if vocab_group is not None:
        lo = C.rank_in(vocab_group, target) * v_loc
        lmax = C.all_reduce_max(logits.detach().max(dim=-1).values, vocab_group)
    else:
        lo, lmax = 0, logits.detach().max(dim=-1).values
    shifted = logits - lmax.unsqueeze(-1)
    inside = (safe >= lo) & (safe < lo + v_loc)
    idx = torch.where(inside, safe - lo, torch.zeros_like(safe))
    picked = shifted.gather(-1, idx.unsqueeze(-1)).squeeze(-1) * inside.to(logits.dtype)
    sums = [shifted.exp().sum(-1), picked]
    if smoothing:
        fin = torch.isfinite(shifted)
        cols = torch.arange(v_loc, device=logits.device) + lo
        wl = weight.to(logits.dtype).index_select(0, cols) if weight is not None \
            else torch.ones(v_loc, dtype=logits.dtype, device=logits.device)
        wf = torch.where(fin, wl, torch.zeros_like(wl))
        sums += [(torch.where(fin, shifted, torch.zeros_like(shifted)) * wf).sum(-1), wf.sum(-1),
                 fin.to(logits.dtype).sum(-1)]
    s = torch.stack(sums, -1)
    if vocab_group is not None:
        s = C.reduce_from(s, vocab_group)
    lse = s[:, 0].log()
    wy = weight.to(logits.dtype)[safe] if weight is not None else torch.ones_like(lse)
    tok = wy * (lse - s[:, 1])
    if smoothing:
        tok = (1 - smoothing) * tok + smoothing / s[:, 4] * (lse * s[:, 3] - s[:, 2])
    keep = valid.to(logits.dtype)
    tok = tok * keep
    if reduction == 0:
        return tok.reshape(shape)
    total = tok.sum()
    denom = (wy * keep).sum()
    if batch_group is not None:
        total = C.reduce_from(total, batch_group)
        denom = C.all_reduce_nograd(denom, batch_group)
    return total / denom if reduction == 1 else total
