"""Indexing and scatter: ``slice`` / ``select``, advanced indexing, ``gather``,
``index_put`` / ``index_copy`` (a KV cache's update), ``scatter_add``,
``masked_scatter``.
"""

from __future__ import annotations

import torch
from torch import fx

from autoshard.ir.spec import ShardSpec, replicated

from ..base import Choice, NeedReplicate, RuleContext
from .common import all_replicated_or_fallback, batch_rows, need_unsplit, register, scalar_choice, without_dim
from .pointwise import identity_like

aten = torch.ops.aten

__all__ = ["TRIM_META", "gather_op", "index_copy", "index_put", "index_tensor", "masked_scatter", "scatter_add",
           "select", "slice_"]


#: node.meta key :mod:`autoshard.passes.pad` sets on the slice that cuts a padded
#: vocabulary back to its size (the slice then gathers instead of re-planning the head)
TRIM_META = "autoshard_pad_trim"


@register(aten.slice.Tensor)
def slice_(ctx: RuleContext) -> Choice:
    """A full slice keeps any split. On a split dim, a step-1 slice of whole
    segments (a piece of a fused projection) keeps the split with local bounds, and
    a strided slice ``[b::k]`` (``b < k``) keeps it where every rank's block is a
    multiple of ``k`` long; any other slice of a split dim needs it whole."""
    x = ctx.node.args[0]
    s = ctx.spec(x)
    args = list(ctx.node.args) + [None] * 5
    d = (args[1] or 0) % s.ndim
    start, end, step = args[2], args[3], args[4] or 1
    size = ctx.pshape(x)[d]
    full = (start in (None, 0)) and (end is None or (isinstance(end, int) and end >= size)) and step == 1
    if full or not s.dims[d]:
        return Choice(out=s, inputs={(0,): s})
    if ctx.node.meta.get(TRIM_META):      # a padded vocabulary cut back for a user-visible value: gather it
        req = need_unsplit(s, [d]).with_partial(())
        return Choice(out=req, inputs={(0,): req}, notes=("padded vocabulary trimmed",))
    m, axes = s.segments[d], s.dims[d]
    seg = size // m
    b = 0 if start is None else (start + size if isinstance(start, int) and start < 0 else start)
    e = size if end is None else (end + size if isinstance(end, int) and end < 0 else end)
    if isinstance(b, int) and isinstance(e, int):
        e = min(e, size)
        c = ctx.mesh.size(axes)
        if s.widths and s.widths[d]:
            return _unequal_blocks_slice(s, d, b, e, step, size, c)
        if step > 1 and 0 <= b < step and e == size and seg % c == 0 and (seg // c) % step == 0:
            # every rank's block (per segment) starts at a multiple of the step, so the local
            # strided slice takes that block's share of the dense one: an interleaved pair
            # (gpt-oss's gate_up[..., ::2] and [..., 1::2]) splits as its source does
            return Choice(out=s, inputs={(0,): s}, notes=(f"every {step}th from {b}, per rank's block",))
        if step == 1 and m > 1 and b % seg == 0 and e % seg == 0 and e > b:
            out = s.with_dim(d, axes, (e - b) // seg)
            return Choice(out=out, inputs={(0,): s}, patches={(2,): b // c, (3,): e // c},
                          notes=(f"segments {b // seg}..{e // seg - 1} of {m}",))
    raise NeedReplicate((0,), d, f"slice [{start}:{end}:{step}] of split dim {d} "
                                 f"({m} segment(s)) does not cover whole segments")


def _unequal_blocks_slice(s: ShardSpec, d: int, b: int, e: int, step: int, size: int, c: int) -> Choice:
    """A step-1 slice ``[b:e]`` of whole fused blocks of unequal widths (Phi-3's q, k or v
    of ``qkv_proj``): each rank holds its part of every block, so the local slice is
    ``[b/c:e/c]`` (every block divides ``c``) and the pieces keep their split."""
    cuts = s.cuts(d, size, c)
    starts = [lo for lo, _ in cuts] + [size]
    if step != 1 or e <= b or b not in starts or e not in starts:
        raise NeedReplicate((0,), d, f"slice [{b}:{e}:{step}] of split dim {d} (fused blocks of widths "
                                     f"{s.widths[d]}) does not cover whole blocks")
    i, j = starts.index(b), starts.index(e)
    out = s.with_dim(d, s.dims[d], j - i, s.widths[d][i:j])
    return Choice(out=out, inputs={(0,): s}, patches={(2,): b // c, (3,): e // c},
                  notes=(f"blocks {i}..{j - 1} of widths {s.widths[d]}",))


@register(aten.select.int)
def select(ctx: RuleContext) -> Choice:
    """``select(x, d, i)``: dim ``d`` must be whole; it is dropped from the spec."""
    x = ctx.node.args[0]
    s = ctx.spec(x)
    d = ctx.node.args[1] % s.ndim
    req = need_unsplit(s, [d])
    return Choice(out=without_dim(req, d), inputs={(0,): req})


@register(aten.index.Tensor)
def index_tensor(ctx: RuleContext) -> Choice:
    """``x[..., i0, i1, ...]`` with index tensors (``None`` = the whole dim).

    Indexed dims must be whole, except a dim split over the batch axes indexed
    by a batch index (``arange`` over the local batch, broadcast): its local
    values are local rows, so the local gather equals the matching block of the
    dense one. Dims not indexed keep their split. As in NumPy, the broadcast
    index block sits where the indexed dims were when they are adjacent, and in
    front otherwise."""
    node = ctx.node
    x, idx = node.args
    s = ctx.spec(x)
    taken = [d for d, i in enumerate(idx) if i is not None]
    if not taken:
        return identity_like(ctx)
    if taken[0] == 0 and ctx.row_fact(node).local_gather and s.dims[0] and ctx.row_fact(x).order is None:
        rows = ctx.spec(idx[0]).dims[0] if ctx.spec(idx[0]).ndim else ()
        if rows and rows != s.dims[0] and ctx.mesh.size(rows) == ctx.mesh.size(s.dims[0]):
            # x's rows split over other axes (3d's swapped layout): re-lay them as the index's
            s = ShardSpec(dims=(rows,) + tuple(tuple(a for a in d if a not in rows) for d in s.dims[1:]),
                          partial=s.partial)
    for d in taken:
        # positions among the rank's own rows, split as x's rows are (the same local order)
        local = d == 0 and ctx.row_fact(node).local_gather and ctx.spec(idx[0]).dims[:1] == (s.dims[0],)
        if s.dims[d] and not (s.dims[d] == ctx.batch_axes and (ctx.is_batch_index(idx[d]) or local)):
            raise NeedReplicate((0,), d, f"dim {d} is split and indexed by a value other than a batch index")
    kept = [d for d in range(s.ndim) if d not in taken]
    out_shape = ctx.pshape(node)
    nb = len(out_shape) - len(kept)
    adjacent = taken == list(range(taken[0], taken[-1] + 1))
    at = sum(1 for d in kept if d < taken[0]) if adjacent else 0
    bshape = out_shape[at:at + nb]
    bd = [()] * nb
    inputs = {(0,): s}          # a gather is linear in x: a partial sum passes (MoE's un-permuting gather)
    for j, i in enumerate(idx):
        if i is None:
            continue
        sp, sh = ctx.spec(i), ctx.pshape(i)
        off = nb - len(sh)
        for d, axes in enumerate(sp.dims):
            if axes and sh[d] == bshape[d + off] and not bd[d + off]:
                bd[d + off] = axes
        inputs[(1, j)] = sp
    used = {a for d in bd for a in d}
    if used & set(s.axes) - set(ctx.batch_axes):
        raise NeedReplicate((0,), next(d for d in kept if set(s.dims[d]) & used), "index block reuses a split axis")
    rest = [(s.dims[d], s.segments[d]) for d in kept]
    dims = [r[0] for r in rest[:at]] + bd + [r[0] for r in rest[at:]]
    segs = [r[1] for r in rest[:at]] + [1] * nb + [r[1] for r in rest[at:]]
    flat = [a for d in dims for a in d]
    if len(flat) != len(set(flat)):          # the batch split arrives through both x and the index
        raise NeedReplicate((0,), next(d for d in kept if s.dims[d]), "index block and a kept dim share a split")
    return Choice(out=ShardSpec(dims=tuple(dims), segments=tuple(segs), partial=s.partial), inputs=inputs)


@register(aten.gather.default)
def gather_op(ctx: RuleContext) -> Choice:
    """``gather(x, d, index)``: dim ``d`` of ``x`` whole; the index and the output take
    ``x``'s other splits."""
    if (sc := scalar_choice(ctx)) is not None:
        return sc
    x, d, idx = ctx.node.args[:3]
    s = ctx.spec(x)
    d = d % s.ndim
    req_x = need_unsplit(s, [d]).with_partial(())
    req_i = ShardSpec(dims=tuple(req_x.dims[j] if j != d else () for j in range(s.ndim)))
    return Choice(out=req_i, inputs={(0,): req_x, (2,): req_i})


@register(aten.index_put_.default, aten.index_put.default)
def index_put(ctx: RuleContext) -> Choice:
    """``y[i] = v`` with one index on the rows: rank-local when ``i`` is a permutation
    of the rank's own rows (a sort's indices) and ``y``, ``i``, ``v`` are split alike
    over the batch axes (:mod:`autoshard.passes.row_order`); otherwise on whole tensors."""
    node = ctx.node
    y, idx, v = node.args[:3]
    sy = ctx.spec(y)
    if ctx.row_fact(node).local_scatter and sy.dims[0] == ctx.batch_axes and ctx.batch_axes:
        req = ShardSpec(dims=(ctx.batch_axes,) + ((),) * (sy.ndim - 1))
        sv = ctx.spec(v)
        return Choice(out=req, inputs={(0,): req, (1, 0): ShardSpec(dims=(ctx.batch_axes,)),
                                       (2,): ShardSpec(dims=(ctx.batch_axes,) + ((),) * (sv.ndim - 1))},
                      notes=("scatter by positions among the rank's own rows",))
    return all_replicated_or_fallback(ctx, "index_put on split rows other than a rank-local permutation")


@register(aten.index_copy_.default, aten.index_copy.default)
def index_copy(ctx: RuleContext) -> Choice:
    """``index_copy(dst, dim, index, src)``: the rows of ``src`` written into ``dst`` at
    ``index`` along ``dim`` (a static KV cache's update). A *state input* -- a graph
    input written before it is read (:meth:`RuleContext.is_free_state`), e.g. the
    cache of a decode step -- takes the layout of what is written into it, so each
    rank holds the block of the cache its heads (and batch rows) compute. Otherwise
    ``dst`` keeps its layout and ``src`` is brought to it. ``dim`` itself stays whole
    (``index`` is global)."""
    if (sc := scalar_choice(ctx)) is not None:
        return sc
    node = ctx.node
    dst, dim, _index, src = node.args[:4]
    dim %= len(ctx.pshape(dst))
    if ctx.is_free_state(dst):
        s = ctx.spec(src)
        want = ShardSpec(dims=s.dims, segments=s.segments)
        if want.dims[dim]:
            want = want.with_dim(dim, ())
    else:
        want = ctx.spec(dst)
        if want.partial or want.dims[dim]:
            return all_replicated_or_fallback(ctx, "index_copy into a tensor split along the written dim")
    return Choice(out=want, inputs={(0,): want, (2,): replicated(1), (3,): want},
                  notes=("state input: each rank holds its block",) if ctx.is_free_state(dst) else ())


@register(aten.scatter_add_.default, aten.scatter_add.default)
def scatter_add(ctx: RuleContext) -> Choice:
    """``y.scatter_add(0, i, v)`` of rows ``i`` / ``v`` split over the batch into a fresh
    zero ``y``: the rank's sums, a partial sum over the batch axes of the dense ones."""
    node = ctx.node
    y, d, idx, v = node.args[:4]
    sy, si, sv = ctx.spec(y), ctx.spec(idx), ctx.spec(v)
    zero = isinstance(y, fx.Node) and y.target in (aten.zeros.default, aten.new_zeros.default,
                                                   aten.zeros_like.default)
    si, sv = batch_rows(ctx, idx, si) or si, batch_rows(ctx, v, sv) or sv
    rows = si.dims[0] if si.ndim and si.dims[0] == ctx.batch_axes and ctx.batch_axes else ()
    if zero and rows and sy.is_replicated and si.ndim == sv.ndim == 1 and sv.dims[0] == rows \
            and not sv.partial and d in (0, -1):
        part = tuple(a for a in ctx.mesh.axes if a in rows)
        return Choice(out=sy.with_partial(part), inputs={(0,): sy, (2,): si, (3,): sv},
                      notes=(f"the rank's sums: partial over {','.join(part)}",))
    return all_replicated_or_fallback(ctx, "scatter_add other than split rows summed into fresh zeros")


@register(aten.masked_scatter.default)
def masked_scatter(ctx: RuleContext) -> Choice:
    """``masked_scatter(x, mask, src)`` (image features written over their placeholder
    tokens): ``src``'s elements fill ``x``'s masked places in order. A split of ``x``
    passes where the mask is broadcast (size 1) along every split dim and ``src`` ends
    with those dims, split alike: each rank fills its slice of every masked place from
    its slice of ``src``. Otherwise all three whole."""
    node = ctx.node
    x, mask, src = node.args[:3]
    s = ctx.spec(x).with_partial(())
    xs, ms, ss = ctx.pshape(x), ctx.pshape(mask), ctx.pshape(src)
    split = [d for d in range(s.ndim) if s.dims[d]]
    t0 = min(split) if split else s.ndim
    tail = len(xs) - t0
    ms = (1,) * (len(xs) - len(ms)) + tuple(ms)
    if split and all(ms[d] == 1 for d in range(t0, len(xs))) and len(ss) >= tail and tuple(ss[len(ss) - tail:]) == \
            tuple(xs[t0:]):
        lead = len(ss) - tail
        sreq = ShardSpec(dims=((),) * lead + s.dims[t0:], segments=(1,) * lead + s.segments[t0:])
        return Choice(out=s, inputs={(0,): s, (1,): replicated(ctx.spec(mask).ndim), (2,): sreq})
    whole = replicated(s.ndim)
    return Choice(out=whole, inputs={(0,): whole, (1,): replicated(ctx.spec(mask).ndim),
                                     (2,): replicated(ctx.spec(src).ndim)})
