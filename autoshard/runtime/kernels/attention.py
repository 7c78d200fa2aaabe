"""The attention kernels: attention with dropout on its probabilities, ring attention
over a sequence split across the cp ranks (:func:`ring_work` counts its scores), and
the convolution over a split sequence."""

from __future__ import annotations

import contextlib
import math

import torch
import torch.nn.functional as F

from .. import collectives as C
from .common import may_overlap, to_wire, wire_dtype
from .dropout import dropout

__all__ = ["attention_dropout", "ring_attention", "ring_work", "sequence_conv"]


def attention_dropout(q, k, v, attn_mask=None, *, is_causal: bool, scale, enable_gqa: bool, p: float, dense: bool,
                      blocks, segments):
    """``scaled_dot_product_attention`` with dropout, by its math path (the one the
    dense op takes on CPU), the probabilities dropped out by :func:`dropout`."""
    L, S = q.shape[-2], k.shape[-2]
    factor = 1 / math.sqrt(q.shape[-1]) if scale is None else scale
    if enable_gqa:
        k, v = _expand_kv(k, q.shape[-3]), _expand_kv(v, q.shape[-3])
    attn = (q * math.sqrt(factor)) @ (k * math.sqrt(factor)).transpose(-2, -1)
    if is_causal:
        keep = torch.ones(L, S, dtype=torch.bool, device=q.device).tril()
        attn = attn.masked_fill(~keep, float("-inf"))
    attn = _masked(attn, attn_mask)
    # the math path's safe softmax: a row masked everywhere (left padding) is 0, not NaN
    attn = dropout(torch.ops.aten._safe_softmax.default(attn, -1), p=p, dense=dense, blocks=blocks, segments=segments)
    return attn @ v


def _masked(scores, mask):
    """``scores`` under an attention ``mask``: a bool mask keeps its True entries (the rest
    ``-inf``), a float mask is added; None leaves them as they are."""
    if mask is None:
        return scores
    return scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask


def _expand_kv(k, heads: int):
    """``k`` with its heads (dim -3) repeated to ``heads`` (grouped-query attention)."""
    return k if k.shape[-3] == heads else k.repeat_interleave(heads // k.shape[-3], dim=-3)


def _fold_kv(dk, heads: int):
    """The gradient of :func:`_expand_kv`: summed back onto ``heads`` kv heads."""
    if dk.shape[1] == heads:
        return dk
    b, h, s, d = dk.shape
    return dk.view(b, heads, h // heads, s, d).sum(2)


_RING_WORK: list[dict] = []


@contextlib.contextmanager
def ring_work():
    """Count the attention scores :func:`ring_attention` computes on this rank (forward),
    in ``box["scores"]``: the blocks a mask hides entirely are skipped, so with a causal
    mask the balanced order gives every rank the same count and the contiguous one does not.

        with ring_work() as box:
            loss = sharded(**batch).loss
        box["scores"]
    """
    box = {"scores": 0}
    _RING_WORK.append(box)
    try:
        yield box
    finally:
        _RING_WORK.remove(box)


def _visible(mask, R: int, p: int, hq: int, hk: int):
    """``vis[a][c]``: whether the rank's query chunk ``a`` (of ``R``) may see key chunk ``c``
    (of ``R·p``, the whole sequence's) anywhere under ``mask``; None: every block is computed
    (no mask, the shape-only trace, or a mask off the CPU: reading it would stop the host
    until the device caught up, every layer, forward and backward; a hidden block computed
    contributes exactly nothing)."""
    if mask is None or mask.device.type != "cpu":
        return None
    m = mask if mask.dtype == torch.bool else mask != float("-inf")
    m = m.unflatten(-2, (R, hq)) if m.shape[-2] != 1 else m.unsqueeze(-3)
    m = m.unflatten(-1, (R * p, hk)).any(-1).any(-2)            # [..., R or 1, R·p]
    m = m.reshape(-1, m.shape[-2], m.shape[-1]).any(0).expand(R, R * p)
    return m.tolist()


def _sub_blocks(group: str, R: int, j: int, vis):
    """``(a, b, c)`` for each score block to compute while rank ``j``'s block is held: query
    chunk ``a``, the block's key chunk ``b`` (chunk ``c`` of the sequence), unless the mask hides it."""
    return [(a, b, c) for a in range(R) for b, c in enumerate(C.held_chunks(group, j)) if vis is None or vis[a][c]]


def _sub_mask(mask, a: int, c: int, hq: int, hk: int):
    """Rows of query chunk ``a`` and columns of key chunk ``c`` of ``mask`` (None stays None)."""
    if mask is None:
        return None
    rows = mask if mask.shape[-2] == 1 else mask[..., a * hq:(a + 1) * hq, :]
    return rows[..., c * hk:(c + 1) * hk]


def _shift(x, group: str, tag: int, overlap: bool):
    """Start one ring step of ``x``; the function returned waits for the received tensor.
    Blocking (the graph op) when the step cannot overlap compute (shape-only trace, compile)."""
    if overlap:
        return C.ring_shift_start(x, group, tag)
    got = C.ring_shift(x, group)
    return lambda: got


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, mask, group: str, scale: float):
        heads, kv_heads = q.shape[1], k.shape[1]
        ctx.group, ctx.scale, ctx.kv_heads = group, scale, kv_heads
        if q.device.type == "meta":
            # the shape-only trace (passes/trace.py) reads only what is saved, and a forward's own
            # ops save nothing: the p·R² blocks are not walked, the results are their shapes
            # (contiguous, as the merge's torch.where makes them; docs/design.md, "Pricing the search")
            out, lse = torch.empty(q.shape, dtype=q.dtype, device="meta"), \
                torch.empty(q.shape[:-1] + (1,), dtype=torch.promote_types(q.dtype, torch.float32), device="meta")
            ctx.save_for_backward(q, k, v, out, lse, *(() if mask is None else (mask,)))
            return out
        r, p = C.group_rank_size(group)
        R = len(C.held_chunks(group, r))
        hq, hk = q.shape[-2] // R, k.shape[-2] // R
        vis = _visible(mask, R, p, hq, hk)
        overlap = may_overlap(q)
        # running max, sum and output in float32 at least (bf16 under autocast), as the dense kernels accumulate
        acc = torch.promote_types(q.dtype, torch.float32)
        m = torch.full(q.shape[:-1] + (1,), float("-inf"), dtype=acc, device=q.device)
        l = torch.zeros_like(m)
        o = torch.zeros(q.shape, dtype=acc, device=q.device)
        kv = torch.stack([k, v])
        for step in range(p):
            j = (r - step) % p                  # the block held now started on rank j
            nxt = _shift(kv, group, 0, overlap) if step < p - 1 else None
            for a, b, c in _sub_blocks(group, R, j, vis):
                rows, cols = slice(a * hq, (a + 1) * hq), slice(b * hk, (b + 1) * hk)
                kj, vj = _expand_kv(kv[0][..., cols, :], heads), _expand_kv(kv[1][..., cols, :], heads)
                s = _masked((q[..., rows, :] @ kj.transpose(-2, -1)).to(acc) * scale, _sub_mask(mask, a, c, hq, hk))
                for box in _RING_WORK:
                    box["scores"] += s.numel()
                m_old = m[..., rows, :]
                m_new = torch.maximum(m_old, s.amax(-1, keepdim=True))
                base = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)
                e = torch.exp(s - base)
                alpha = torch.exp(m_old - base)
                l[..., rows, :] = l[..., rows, :] * alpha + e.sum(-1, keepdim=True)
                o[..., rows, :] = o[..., rows, :] * alpha + (e.to(vj.dtype) @ vj).to(acc)
                m[..., rows, :] = m_new
            if nxt is not None:
                kv = nxt()
        base = torch.where(torch.isinf(m), torch.zeros_like(m), m)
        # a row no key may see (a padding query under a causal mask) is 0, as the dense op's
        # safe softmax makes it; its log-sum-exp +inf makes its probabilities 0 in backward
        seen = l > 0
        out = torch.where(seen, o / torch.where(seen, l, torch.ones_like(l)), torch.zeros_like(o)).to(q.dtype)
        lse = torch.where(seen, base + torch.log(torch.where(seen, l, torch.ones_like(l))), torch.full_like(l, float("inf")))
        ctx.save_for_backward(q, k, v, out, lse, *(() if mask is None else (mask,)))
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, *mask = ctx.saved_tensors
        mask = mask[0] if mask else None
        group, scale = ctx.group, ctx.scale
        r, p = C.group_rank_size(group)
        R = len(C.held_chunks(group, r))
        heads = q.shape[1]
        hq, hk = q.shape[-2] // R, k.shape[-2] // R
        vis = _visible(mask, R, p, hq, hk)
        overlap = may_overlap(q)
        dout = dout.contiguous()
        acc = lse.dtype         # the forward's accumulation dtype (float32 at least)
        delta = (dout.to(acc) * out.to(acc)).sum(-1, keepdim=True)
        dq = torch.zeros(q.shape, dtype=acc, device=q.device)
        # a float mask with a gradient (T5's learned position bias): d(bias) = d(scores)
        dmask = torch.zeros_like(mask) if mask is not None and ctx.needs_input_grad[3] else None
        kv = torch.stack([k, v])
        partial = None          # the held block's dk/dv from the ranks that held it before, on its way
        for step in range(p):
            j = (r - step) % p
            nxt = _shift(kv, group, 0, overlap) if step < p - 1 else None
            d = torch.zeros_like(kv)            # this rank's dk, dv of block j
            for a, b, c in _sub_blocks(group, R, j, vis):
                rows, cols = slice(a * hq, (a + 1) * hq), slice(b * hk, (b + 1) * hk)
                qa, da = q[..., rows, :], dout[..., rows, :]
                kj, vj = _expand_kv(kv[0][..., cols, :], heads), _expand_kv(kv[1][..., cols, :], heads)
                prob = torch.exp(_masked((qa @ kj.transpose(-2, -1)).to(acc) * scale, _sub_mask(mask, a, c, hq, hk))
                                 - lse[..., rows, :])
                d[1][..., cols, :] += _fold_kv(prob.to(da.dtype).transpose(-2, -1) @ da, ctx.kv_heads)
                dscores = prob * ((da @ vj.transpose(-2, -1)).to(acc) - delta[..., rows, :])
                if dmask is not None:   # summed over the dims the mask broadcasts on (none: as is)
                    sub = _sub_mask(dmask, a, c, hq, hk)
                    wide = [x for x in range(dscores.dim()) if sub.shape[x] == 1 and dscores.shape[x] != 1]
                    sub += dscores.sum(wide, keepdim=True) if wide else dscores
                ds = (dscores * scale).to(q.dtype)
                dq[..., rows, :] += ds @ kj
                d[0][..., cols, :] += _fold_kv(ds.transpose(-2, -1) @ qa, ctx.kv_heads)
            if partial is not None:
                d += partial()
            # block j's sums move on with the block (after the last step: home, to rank j)
            partial = _shift(d, group, 1, overlap) if p > 1 else (lambda d=d: d)
            if nxt is not None:
                kv = nxt()
        home = partial()
        return dq.to(q.dtype), home[0], home[1], dmask, None, None


def ring_attention(q, k, v, mask, *, group: str, scale: float | None = None):
    """Attention of this rank's queries over the keys and values of every rank of
    ``group``, each rank holding one block of the sequence (its rank's contiguous block,
    or chunks r and 2p-1-r in the balanced order, :func:`~autoshard.runtime.collectives.is_balanced`);
    ``mask`` has this rank's query rows and every key column. Exact: the blocks' partial
    softmax results are merged through their log-sum-exp; a block the mask hides entirely
    is not computed, and the next block travels while this one is (asynchronous send/recv)."""
    if scale is None:
        scale = q.shape[-1] ** -0.5
    # under autocast in its compute dtype, as autocast runs scaled_dot_product_attention: the
    # key/value blocks travel at half the bytes (rotary embeddings leave q and k in float32)
    wire = wire_dtype(q)
    q, k, v = (to_wire(t, wire) for t in (q, k, v))
    return _RingAttention.apply(q, k, v, mask, group, float(scale))


def sequence_conv(x, w, b, *, group: str, left: int, right: int, dilation: int = 1, groups: int = 1):
    """:func:`autoshard.ir.tokens.sequence_conv` of this rank's blocks of the sequence (the last
    dim of ``x``, split over ``group``: one block, or chunks r and 2p-1-r in the balanced order).
    The ``right`` first and ``left`` last rows of every block are all-gathered (one call,
    in sequence order: the group's own order); each block is convolved with the ``left``
    rows before it and the ``right`` after it (zeros at the sequence's ends). Backward:
    autograd, the edge rows' gradients reduce-scattered back to their blocks."""
    r, p = C.group_rank_size(group)
    index = C.held_chunks(group, r)           # the chunks this rank's blocks are, in the sequence
    R = len(index)
    n, h = x.shape[-1] // R, left + right
    if n < max(left, right):
        raise ValueError(f"a convolution over the sequence reaches {left} rows back and {right} ahead, past the "
                         f"{n} rows of a cp block: use a sequence of at least {max(left, right) * R * p} tokens")
    blocks = [x[..., a * n:(a + 1) * n] for a in range(R)]
    edges = torch.cat([torch.cat([blk[..., :right], blk[..., n - left:]], -1) for blk in blocks], -1)
    every = C.gather_partial(edges, edges.dim() - 1, group)        # [..., R·p·h]: each block's edges in order
    last = R * p - 1
    outs = []
    for a, g in enumerate(index):
        before = every[..., (g - 1) * h + right:g * h] if g > 0 else x.new_zeros(x.shape[:-1] + (left,))
        after = every[..., (g + 1) * h:(g + 1) * h + right] if g < last else x.new_zeros(x.shape[:-1] + (right,))
        outs.append(F.conv1d(torch.cat([before, blocks[a], after], -1), w, b, 1, 0, dilation, groups))
    return torch.cat(outs, -1) if R > 1 else outs[0]
