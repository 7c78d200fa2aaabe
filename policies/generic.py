"""Mode-independent rules: pointwise, views, reductions, indexing, attention,
norms and the loss. They follow whatever layout arrives; heavy Linear and
embedding choices live in the mode modules.

Every rule takes the propagate pass's context ``ctx`` and returns a
:class:`~autoshard.policies.base.Choice`, or raises
:class:`~autoshard.policies.base.NeedReplicate` when an input split cannot pass
(the pass then gathers that input, or re-plans the Linear that produced it).
"""

from __future__ import annotations

import math
import operator

import torch
from torch import fx

from autoshard.ir.errors import ShardingError
from autoshard.ir.plan import Step
from autoshard.ir.spec import ShardSpec, replicated
from autoshard.ir.tokens import sequence_conv, token_cross_entropy

from autoshard.ir.kernels import (AttentionDropout, CrossEntropy, DistLayerNorm, Dropout, RingAttention, SequenceConv,
                                  SyncBatchNorm)

from .base import Choice, NeedReplicate, RuleContext, SymbolicSizes

aten = torch.ops.aten

__all__ = ["PER_SAMPLE", "RULES", "TRIM_META", "rule_for", "view_groups", "writes_first_arg"]

#: node.meta key :mod:`autoshard.passes.pad` sets on the slice that cuts a padded
#: vocabulary back to its size (the slice then gathers instead of re-planning the head)
TRIM_META = "autoshard_pad_trim"


def _tensor_args(ctx):
    """(path, node) for every tensor-valued fx.Node among args (lists flattened one level)."""
    out = []
    for i, a in enumerate(ctx.node.args):
        if isinstance(a, fx.Node) and ctx.is_tensor(a):
            out.append(((i,), a))
        elif isinstance(a, (list, tuple)):
            for j, b in enumerate(a):
                if isinstance(b, fx.Node) and ctx.is_tensor(b):
                    out.append(((i, j), b))
    for k, a in ctx.node.kwargs.items():
        if isinstance(a, fx.Node) and ctx.is_tensor(a):
            out.append((("kw", k), a))
    return out


# ------------------------------------------------------------------ pointwise
_LINEAR_IN_PARTIAL = {aten.neg.default, aten.clone.default, aten.alias.default, aten.contiguous.default,
                      aten.to.dtype, aten.to.dtype_layout, aten._to_copy.default, aten.dropout.default}


def _partial_passes(target, part_paths, targs) -> bool:
    """Whether the op is linear in its partial operand(s), so the partial sum can wait."""
    if target in _LINEAR_IN_PARTIAL:
        return True
    if target in (aten.mul.Tensor, aten.mul.Scalar):
        return len(part_paths) == 1
    if target in (aten.div.Tensor, aten.div.Scalar):
        return part_paths == [(0,)]
    if target in (aten.add.Tensor, aten.sub.Tensor):
        return len(targs) == 2 and len(part_paths) == 2
    return False


def pointwise(ctx: RuleContext) -> Choice:
    """Elementwise ops (and broadcasts): each output dim takes the split of the first
    input that is not broadcast there, every input is brought to it; a partial sum
    passes only through ops linear in it (``neg``, ``mul`` by one partial operand,
    ``add`` of two partials, casts). A batch index used as data raises."""
    node = ctx.node
    out_shape = ctx.pshape(node)
    n = len(out_shape)
    targs = _tensor_args(ctx)
    dims: list[tuple] = [()] * n
    segs = [1] * n
    # each output dim takes the split of the first input that is not broadcast there
    for order in (False, True):              # fixed values first, free parameters last
        for path, a in targs:
            if ctx.is_free_param(a) != order:
                continue
            s, sh = ctx.spec(a), ctx.pshape(a)
            off = n - len(sh)
            for d, axes in enumerate(s.dims):
                j = d + off
                taken = {x for dd in dims for x in dd}
                # an axis already splitting another output dim stays there (the other input moves)
                if axes and not dims[j] and sh[d] == out_shape[j] and not set(axes) & taken:
                    dims[j], segs[j] = axes, s.segments[d]
    used = {x for d in dims for x in d}
    partials = {tuple(ctx.spec(a).partial) for _, a in targs if ctx.spec(a).partial}
    out_partial: tuple = ()
    if partials:
        p = next(iter(partials))
        part_paths = [path for path, a in targs if ctx.spec(a).partial]
        if len(partials) == 1 and not (set(p) & used) and _partial_passes(node.target, part_paths, targs):
            out_partial = p
    batch_index = [a for _, a in targs if ctx.is_batch_index(a)]
    if batch_index and ctx.batch_axes and node.target not in (aten.add.Tensor,) :
        raise ShardingError("a batch index (arange over the batch size) is used as data; "
                            "with the batch split its local values would differ from the dense ones",
                            node=node)
    inputs = {}
    for path, a in targs:
        s, sh = ctx.spec(a), ctx.pshape(a)
        off = n - len(sh)
        req = tuple(dims[d + off] if sh[d] == out_shape[d + off] else () for d in range(len(sh)))
        rseg = tuple(segs[d + off] if req[d] else 1 for d in range(len(sh)))
        inputs[path] = ShardSpec(dims=req, segments=rseg, partial=out_partial if s.partial else ())
    return Choice(out=ShardSpec(dims=tuple(dims), segments=tuple(segs), partial=out_partial), inputs=inputs)


def inplace(ctx: RuleContext) -> Choice:
    """An op that writes into its first argument (``copy_``, ``masked_fill_``, ...):
    the written tensor keeps its layout (a re-laid-out copy would take the write
    and lose it), and every other tensor argument is brought to that layout."""
    node = ctx.node
    dst = node.args[0]
    s = ctx.spec(dst)
    if s.partial and _fresh(dst, node):
        # a new tensor only this write reads (a bias added to a row-parallel product in
        # place): sum it first, the write then goes into the summed copy
        s = s.with_partial(())
    elif s.partial:
        raise ShardingError("an in-place write into a partial sum that other nodes also read cannot be made exact",
                            node=node)
    out_shape = ctx.pshape(dst)
    n = len(out_shape)
    inputs = {(0,): s}
    for path, a in _tensor_args(ctx)[1:]:
        sh = ctx.pshape(a)
        off = n - len(sh)
        inputs[path] = ShardSpec(dims=tuple(s.dims[d + off] if sh[d] == out_shape[d + off] else ()
                                            for d in range(len(sh))),
                                 segments=tuple(s.segments[d + off] if sh[d] == out_shape[d + off] else 1
                                                for d in range(len(sh))))
    return Choice(out=s, inputs=inputs)


def _fresh(dst, node: fx.Node) -> bool:
    """Whether ``dst`` is a new tensor (an op's result, no view of another) that
    ``node`` alone reads."""
    if not isinstance(dst, fx.Node) or dst.op != "call_function" or list(dst.users) != [node]:
        return False
    t = dst.target
    if t is operator.getitem:                    # an element of a multi-output op: fresh as the op's results
        t = dst.args[0].target if isinstance(dst.args[0], fx.Node) else None
    if isinstance(t, torch._ops.OpOverload):
        return not any(r.alias_info is not None for r in t._schema.returns)
    return callable(t)      # our own graph functions (grouped_linear) return new tensors


def writes_first_arg(t) -> bool:
    """Whether ATen op ``t`` writes into its first argument (``copy_``, ``masked_fill_``).

    >>> writes_first_arg(torch.ops.aten.add_.Tensor), writes_first_arg(torch.ops.aten.add.Tensor)
    (True, False)"""
    if not isinstance(t, torch._ops.OpOverload) or not t._schema.arguments:
        return False
    info = t._schema.arguments[0].alias_info
    return bool(info is not None and info.is_write)


def _scalar(ctx: RuleContext) -> Choice | None:
    """For an op on a 0-dim value (a dim argument then names the value itself): every
    input summed and whole, the output whole; None when the first input has dims."""
    targs = _tensor_args(ctx)
    if not targs or ctx.spec(targs[0][1]).ndim:
        return None
    v = ctx.node.meta.get("val")
    out = replicated(v.dim()) if isinstance(v, torch.Tensor) else None
    return Choice(out=out, inputs={p: replicated(ctx.spec(a).ndim) for p, a in targs})


def identity_like(ctx: RuleContext) -> Choice:
    """Casts, copies and aliases: the output has the input's layout."""
    a = ctx.node.args[0]
    s = ctx.spec(a)
    return Choice(out=s, inputs={(0,): s})


# ---------------------------------------------------------------------- views
def view_groups(ins: tuple[int, ...], outs: tuple[int, ...]) -> list[tuple[list[int], list[int]]]:
    """Pair input dims with output dims of equal product (size-1 dims alone).

    >>> view_groups((2, 3, 4), (6, 4))
    [([0, 1], [0]), ([2], [1])]
    >>> view_groups((2, 12), (2, 1, 3, 4))
    [([0], [0]), ([], [1]), ([1], [2, 3])]
    """
    groups = []
    i = j = 0
    while i < len(ins) or j < len(outs):
        if i < len(ins) and ins[i] == 1 and (j >= len(outs) or outs[j] != 1):
            groups.append(([i], []))
            i += 1
            continue
        if j < len(outs) and outs[j] == 1 and (i >= len(ins) or ins[i] != 1):
            groups.append(([], [j]))
            j += 1
            continue
        gi, go = [i], [j]
        pi, po = ins[i], outs[j]
        i += 1
        j += 1
        while pi != po:
            if pi < po:
                pi *= ins[i]
                gi.append(i)
                i += 1
            else:
                po *= outs[j]
                go.append(j)
                j += 1
        groups.append((gi, go))
    return groups


def _divisible(size: int, count: int) -> bool:
    """Literal sizes must divide; symbolic ones (batch) are checked when the module runs."""
    return SymbolicSizes.is_symbolic(size) or size % count == 0


def _view_out_spec(ctx, in_spec: ShardSpec, ins, outs) -> tuple[ShardSpec, dict]:
    """Output spec of a reshape and, per output dim, its shard count."""
    dims = [()] * len(outs)
    segs = [1] * len(outs)
    if math.prod(ins) != math.prod(outs):
        # sizes the probe cannot pair (a batch cut by a literal: ``[b, 5] -> [5, b//5·5]``,
        # found by the OpInfo check): no split may pass it
        split = [d for d in range(len(ins)) if in_spec.dims[d]]
        if split:
            raise NeedReplicate((0,), split[0], f"reshape {SymbolicSizes.text(ins)}->{SymbolicSizes.text(outs)} "
                                                f"whose dims cannot be paired")
        return ShardSpec(dims=tuple(dims), partial=in_spec.partial), {}
    for gi, go in view_groups(tuple(ins), tuple(outs)):
        split = [d for d in gi if in_spec.dims[d]]
        if not split:
            continue
        d = split[0]
        if len(split) > 1 and d == gi[0]:
            # only the outermost dim of a merge may stay split: gather the inner one
            raise NeedReplicate((0,), split[1], f"reshape {SymbolicSizes.text(ins)}->{SymbolicSizes.text(outs)} merges "
                                                f"dim {split[1]} (split) "
                                                f"under split dim {d}")
        if len(split) > 1 or d != gi[0]:
            raise NeedReplicate((0,), d, f"reshape {SymbolicSizes.text(ins)}->{SymbolicSizes.text(outs)} would interleave "
                                         f"the split of dim {d}")
        axes, m = in_spec.dims[d], in_spec.segments[d]
        c = ctx.mesh.size(axes)
        if "cp" in axes and ctx.cp_order == "balanced":
            c *= 2      # the balanced order cuts 2·cp chunks: a view keeps them only if it divides them
        go = [o for o in go if outs[o] != 1]
        if not go:
            continue
        first = go[0]
        if len(gi) > 1 or len(go) == 1:
            if not _divisible(outs[first], c * m):
                raise NeedReplicate((0,), d, f"reshape {SymbolicSizes.text(ins)}->{SymbolicSizes.text(outs)}: dim of size {outs[first]} "
                                             f"cannot hold {m} segment(s) × {c} shards")
            dims[first], segs[first] = axes, m
        elif m > 1 and outs[first] == m and len(go) > 1 and _divisible(outs[go[1]], c):
            dims[go[1]] = axes
        elif _divisible(outs[first], c * m):
            dims[first], segs[first] = axes, m
        else:
            raise NeedReplicate((0,), d, f"reshape {SymbolicSizes.text(ins)}->{SymbolicSizes.text(outs)}: leading dim {outs[first]} "
                                         f"is not divisible by {c} shards" + (f" × {m} segments" if m > 1 else ""))
    return ShardSpec(dims=tuple(dims), segments=tuple(segs), partial=in_spec.partial), {}


def _is_seq_size(size: int) -> bool:
    """A size that is a multiple of the sequence and involves no batch (the whole
    sequence, read from an input that is not split on it)."""
    return size % SymbolicSizes.SEQ == 0 and size % SymbolicSizes.BATCH != 0


def _patch_sizes(ctx, out_spec: ShardSpec, sizes, path) -> dict:
    """Literal sizes at split positions become local: ``{path: {"at": [[pos, local], ...]}}``
    (positions, never values: a -1 entry is left alone). A symbolic entry is read at run
    time from an input: local already where the split is the batch split (the batch
    input is split), else the whole size, divided at run time: ``"div": [[pos, n], ...]``
    (1d-sp's sequence split)."""
    if not isinstance(sizes, (list, tuple)):
        return {}
    at, div = [], []
    for j, axes in enumerate(out_spec.dims):
        if not axes or j >= len(sizes):
            continue
        if isinstance(sizes[j], int) and sizes[j] != -1:
            at.append([j, sizes[j] // ctx.mesh.size(axes)])
        elif isinstance(sizes[j], fx.Node) and not set(axes) <= set(ctx.batch_axes) and \
                _is_seq_size(ctx.pshape(ctx.node)[j]):
            div.append([j, ctx.mesh.size(axes)])
    patch = ({"at": at} if at else {}) | ({"div": div} if div else {})
    return {path: patch} if patch else {}


def reshape(ctx: RuleContext) -> Choice:
    """``view`` / ``reshape``: dims are paired by equal products (:func:`view_groups`); the
    outermost dim of a merged group may stay split, and literal sizes at split
    positions are patched to local sizes (by position, never by value)."""
    x = ctx.node.args[0]
    s = ctx.spec(x)
    out, _ = _view_out_spec(ctx, s, ctx.pshape(x), ctx.pshape(ctx.node))
    return Choice(out=out, inputs={(0,): s}, patches=_patch_sizes(ctx, out, ctx.node.args[1], (1,)))


def flatten(ctx: RuleContext) -> Choice:
    """``flatten(x, start, end)``: a reshape whose sizes are implied (nothing to patch)."""
    x = ctx.node.args[0]
    s = ctx.spec(x)
    out, _ = _view_out_spec(ctx, s, ctx.pshape(x), ctx.pshape(ctx.node))
    return Choice(out=out, inputs={(0,): s})


def expand(ctx: RuleContext) -> Choice:
    """``expand``: kept dims keep their split (their literal sizes patched); a new dim of
    batch size is split over the batch axes."""
    x = ctx.node.args[0]
    s = ctx.spec(x)
    ins, outs = ctx.pshape(x), ctx.pshape(ctx.node)
    off = len(outs) - len(ins)
    dims, segs = [()] * len(outs), [1] * len(outs)
    for j in range(len(outs)):
        d = j - off
        if d >= 0 and ins[d] == outs[j]:
            dims[j], segs[j] = s.dims[d], s.segments[d]
        elif outs[j] == ctx.BATCH and ctx.batch_axes:
            dims[j] = ctx.batch_axes
    out = ShardSpec(dims=tuple(dims), segments=tuple(segs), partial=s.partial)
    # only the dims that were split in the input need their literal patched
    keep = ShardSpec(dims=tuple(dims[j] if (j - off >= 0 and ins[j - off] == outs[j]) else ()
                                for j in range(len(outs))))
    return Choice(out=out, inputs={(0,): s}, patches=_patch_sizes(ctx, keep, ctx.node.args[1], (1,)))


def _permuted(s: ShardSpec, perm) -> ShardSpec:
    return ShardSpec(dims=tuple(s.dims[p] for p in perm), segments=tuple(s.segments[p] for p in perm),
                     partial=s.partial)


def transpose(ctx: RuleContext) -> Choice:
    """``transpose`` / ``t`` / ``numpy_T`` (``x.T``): the spec's dims swapped (reversed) alike."""
    if (sc := _scalar(ctx)) is not None:
        return sc
    x = ctx.node.args[0]
    s = ctx.spec(x)
    n = s.ndim
    if ctx.node.target in (aten.t.default, aten.numpy_T.default):
        perm = list(range(n))[::-1]
    else:
        a, b = (d % n for d in ctx.node.args[1:3])
        perm = list(range(n))
        perm[a], perm[b] = perm[b], perm[a]
    return Choice(out=_permuted(s, perm), inputs={(0,): s})


def permute(ctx: RuleContext) -> Choice:
    """``permute``: the spec's dims permuted alike."""
    x = ctx.node.args[0]
    s = ctx.spec(x)
    perm = [d % s.ndim for d in ctx.node.args[1]]
    return Choice(out=_permuted(s, perm), inputs={(0,): s})


def unsqueeze(ctx: RuleContext) -> Choice:
    """``unsqueeze``: a whole dim inserted."""
    x = ctx.node.args[0]
    s = ctx.spec(x)
    d = ctx.node.args[1] % (s.ndim + 1)
    dims, segs = list(s.dims), list(s.segments)
    dims.insert(d, ())
    segs.insert(d, 1)
    return Choice(out=ShardSpec(dims=tuple(dims), segments=tuple(segs), partial=s.partial), inputs={(0,): s})


def squeeze(ctx: RuleContext) -> Choice:
    """``squeeze``: the size-1 dims dropped from the spec."""
    if (sc := _scalar(ctx)) is not None:
        return sc
    x = ctx.node.args[0]
    s = ctx.spec(x)
    ins = ctx.pshape(x)
    if len(ctx.node.args) > 1:
        ds = ctx.node.args[1]
        ds = [ds] if isinstance(ds, int) else list(ds)
        ds = {d % len(ins) for d in ds if ins[d % len(ins)] == 1}
    else:
        ds = {d for d, v in enumerate(ins) if v == 1}
    keep = [d for d in range(len(ins)) if d not in ds]
    return Choice(out=ShardSpec(dims=tuple(s.dims[d] for d in keep), segments=tuple(s.segments[d] for d in keep),
                                partial=s.partial), inputs={(0,): s})


# --------------------------------------------------------- dim-wise / indexing
def _need_unsplit(s: ShardSpec, dims) -> ShardSpec:
    out = s
    for d in dims:
        if d < out.ndim and out.dims[d]:        # a 0-dim value's "dim 0" is the value itself
            out = out.with_dim(d, ())
    return out


def _without_dim(s: ShardSpec, d: int) -> ShardSpec:
    """``s`` with dim ``d`` removed (an op that drops it: ``select``, ``max.dim``)."""
    return ShardSpec(dims=s.dims[:d] + s.dims[d + 1:], segments=s.segments[:d] + s.segments[d + 1:],
                     partial=s.partial)


def dimwise(ctx, dim_arg: int = 1, default_dim: int = -1) -> Choice:
    """An op along one dim (``softmax``, ``diff``, ``cumsum``): that dim must be whole
    and no partial sum may pass; other splits are kept. ``dim_arg`` is the position
    of the dim argument, ``default_dim`` its default."""
    x = ctx.node.args[0]
    s = ctx.spec(x)
    d = ctx.node.args[dim_arg] if len(ctx.node.args) > dim_arg else ctx.node.kwargs.get("dim", default_dim)
    d = d % max(s.ndim, 1)
    req = _need_unsplit(s, [d]).with_partial(())
    inputs = {(0,): req}
    for path, a in _tensor_args(ctx)[1:]:          # diff's prepend / append
        inputs[path] = req
    return Choice(out=req, inputs=inputs)


def softmax(ctx: RuleContext) -> Choice:
    """``softmax`` / ``log_softmax``: :func:`dimwise` on the softmax dim."""
    return dimwise(ctx, 1)


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
        req = _need_unsplit(s, [d]).with_partial(())
        return Choice(out=req, inputs={(0,): req}, notes=("padded vocabulary trimmed",))
    m, axes = s.segments[d], s.dims[d]
    seg = size // m
    b = 0 if start is None else (start + size if isinstance(start, int) and start < 0 else start)
    e = size if end is None else (end + size if isinstance(end, int) and end < 0 else end)
    if isinstance(b, int) and isinstance(e, int):
        e = min(e, size)
        c = ctx.mesh.size(axes)
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


def select(ctx: RuleContext) -> Choice:
    """``select(x, d, i)``: dim ``d`` must be whole; it is dropped from the spec."""
    x = ctx.node.args[0]
    s = ctx.spec(x)
    d = ctx.node.args[1] % s.ndim
    req = _need_unsplit(s, [d])
    return Choice(out=_without_dim(req, d), inputs={(0,): req})


def unbind(ctx: RuleContext) -> Choice:
    """``unbind(x, d)`` (a tensor listed along one dim: LLaVA's image features per
    sample): dim ``d`` must be whole; every piece keeps the other splits."""
    node = ctx.node
    s = ctx.spec(node.args[0])
    d = (node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)) % max(s.ndim, 1)
    req = _need_unsplit(s, [d])
    return Choice(out=tuple(_without_dim(req, d) for _ in node.meta["val"]), inputs={(0,): req})


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


def split(ctx: RuleContext) -> Choice:
    """``split`` / ``chunk``: a whole dim passes; a split dim passes only when it is cut
    into exactly its fused segments (GPT-2's ``c_attn`` into q, k, v), each piece
    then split alike and the split sizes patched to local ones."""
    node = ctx.node
    x = node.args[0]
    s = ctx.spec(x)
    d = (node.args[2] if len(node.args) > 2 else node.kwargs.get("dim", 0)) % s.ndim
    outs = node.meta["val"]
    k = len(outs)
    if not s.dims[d]:
        return Choice(out=tuple(s for _ in outs), inputs={(0,): s})
    m, axes = s.segments[d], s.dims[d]
    sizes = [ctx.pshape_of_val(v)[d] for v in outs]
    if m == k and len(set(sizes)) == 1:
        each = s.with_dim(d, axes, 1)
        if node.target == aten.chunk.default:       # a count of chunks, not a size: stays
            return Choice(out=tuple(each for _ in outs), inputs={(0,): s})
        c = ctx.mesh.size(axes)
        arg = node.args[1]
        patch = arg // c if isinstance(arg, int) else {"at": [[j, v // c] for j, v in enumerate(arg)]}
        return Choice(out=tuple(each for _ in outs), inputs={(0,): s}, patches={(1,): patch})
    raise NeedReplicate((0,), d, f"split of dim {d} into {k} parts does not match its {m} segment(s)")


def getitem(ctx: RuleContext) -> Choice:
    """``operator.getitem`` on a multi-output node: the spec of that output."""
    src, i = ctx.node.args
    specs = ctx.spec(src)
    if not isinstance(specs, tuple):
        return Choice(out=None)
    return Choice(out=specs[i])


def cat(ctx: RuleContext) -> Choice:
    """``cat``: the concatenated dim whole, every input in the first split input's layout."""
    node = ctx.node
    tensors = node.args[0]
    d = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)
    specs = [ctx.spec(t) for t in tensors]
    n = ctx.pshape(node).__len__()
    d = d % n
    base = next((s for s in specs if not s.is_replicated), specs[0])
    req = _need_unsplit(base, [d]).with_partial(())
    return Choice(out=req, inputs={(0, j): req for j in range(len(tensors))})


def stack(ctx: RuleContext) -> Choice:
    """``stack``: every input in the first split input's layout, the new dim whole."""
    node = ctx.node
    tensors = node.args[0]
    d = node.args[1] if len(node.args) > 1 else 0
    specs = [ctx.spec(t) for t in tensors]
    base = next((s for s in specs if not s.is_replicated), specs[0]).with_partial(())
    n = base.ndim + 1
    d = d % n
    dims = list(base.dims)
    dims.insert(d, ())
    segs = list(base.segments)
    segs.insert(d, 1)
    return Choice(out=ShardSpec(dims=tuple(dims), segments=tuple(segs)), inputs={(0, j): base for j in range(len(tensors))})


def pad(ctx: RuleContext) -> Choice:
    """``pad``: the padded (trailing) dims must be whole."""
    x = ctx.node.args[0]
    s = ctx.spec(x)
    npad = len(ctx.node.args[1]) // 2
    req = _need_unsplit(s, range(s.ndim - npad, s.ndim)).with_partial(())
    return Choice(out=req, inputs={(0,): req})


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


def index_copy(ctx: RuleContext) -> Choice:
    """``index_copy(dst, dim, index, src)``: the rows of ``src`` written into ``dst`` at
    ``index`` along ``dim`` (a static KV cache's update). A *state input* -- a graph
    input written before it is read (:meth:`RuleContext.is_free_state`), e.g. the
    cache of a decode step -- takes the layout of what is written into it, so each
    rank holds the block of the cache its heads (and batch rows) compute. Otherwise
    ``dst`` keeps its layout and ``src`` is brought to it. ``dim`` itself stays whole
    (``index`` is global)."""
    if (sc := _scalar(ctx)) is not None:
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


def sort(ctx: RuleContext) -> Choice:
    """A sort along a dim that is whole, or along the batch-split rows: each rank
    sorts its own rows (a rank-local order the row-order analysis follows)."""
    node = ctx.node
    x = node.args[0]
    s = ctx.spec(x).with_partial(())
    d = node.kwargs.get("dim", node.args[1] if len(node.args) > 1 and node.target == aten.sort.default else -1)
    d = d % max(s.ndim, 1)
    if d == 0 and s.dims[0] and s.dims[0] != ctx.batch_axes and len(s.dims[0]) == len(ctx.batch_axes) \
            and ctx.mesh.size(s.dims[0]) == ctx.mesh.size(ctx.batch_axes):
        s = ShardSpec(dims=(ctx.batch_axes,) + ((),) * (s.ndim - 1))   # 3d's swapped rows: re-laid as the batch
    if s.dims[d] and not (d == 0 and s.dims[0] == ctx.batch_axes):
        s = _need_unsplit(s, [d])
    return Choice(out=(s, s), inputs={(0,): s}, notes=("rank-local sort of the rows",) if s.dims[d] else ())


def topk(ctx: RuleContext) -> Choice:
    """``topk``: the dim searched must be whole; values and indices keep the other splits."""
    node = ctx.node
    s = ctx.spec(node.args[0])
    d = (node.args[2] if len(node.args) > 2 else node.kwargs.get("dim", -1)) % max(s.ndim, 1)
    req = _need_unsplit(s, [d]).with_partial(())
    return Choice(out=(req, req), inputs={(0,): req})


def max_dim(ctx: RuleContext) -> Choice:
    """``max.dim`` / ``min.dim`` (values and indices along one dim: attention with sinks
    subtracts the scores' max over the keys): the dim searched must be whole; values
    and indices keep the other splits (the dim dropped unless ``keepdim``)."""
    node = ctx.node
    s = ctx.spec(node.args[0])
    d = (node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", -1)) % max(s.ndim, 1)
    keep = node.args[2] if len(node.args) > 2 else node.kwargs.get("keepdim", False)
    req = _need_unsplit(s, [d]).with_partial(())
    out = req if keep else _without_dim(req, d)
    return Choice(out=(out, out), inputs={(0,): req})


def histc(ctx: RuleContext) -> Choice:
    """Counts of split rows are the rank's counts: a partial sum (over the batch axes)
    of the dense counts."""
    s = ctx.spec(ctx.node.args[0])
    rows = s.dims[0] if s.ndim == 1 and s.dims[0] == ctx.batch_axes and not s.partial else ()
    req = ShardSpec(dims=(rows,)) if s.ndim == 1 else replicated(s.ndim)
    part = tuple(a for a in ctx.mesh.axes if a in rows)
    return Choice(out=ShardSpec(dims=((),), partial=part), inputs={(0,): req},
                  notes=(f"the rank's counts: partial over {','.join(part)}",) if part else ())


def cumsum(ctx: RuleContext) -> Choice:
    """Linear: a partial sum passes (the group offsets of a rank's counts)."""
    ch = dimwise(ctx)
    s = ctx.spec(ctx.node.args[0])
    if not s.partial:
        return ch
    req = ch.out.with_partial(s.partial)
    return Choice(out=req, inputs={(0,): req})


def like(ctx: RuleContext) -> Choice:
    """``empty_like`` / ``zeros_like`` ...: the input's layout, fresh values."""
    s = ctx.spec(ctx.node.args[0])
    return Choice(out=s.with_partial(()), inputs={(0,): s})


def repeat_interleave(ctx: RuleContext) -> Choice:
    """``x.repeat_interleave(k)`` of a 1-D tensor (or on dim 0): each row becomes ``k``
    rows in place, so a block of rows stays the matching block."""
    node = ctx.node
    s = ctx.spec(node.args[0])
    d = node.args[2] if len(node.args) > 2 else node.kwargs.get("dim")
    if s.ndim == 1 or d in (0, -s.ndim):
        req = _need_unsplit(s, range(1, s.ndim)).with_partial(())
        return Choice(out=req, inputs={(0,): req})
    req = replicated(s.ndim) if d is None else _need_unsplit(s, [d % s.ndim]).with_partial(())
    return Choice(out=req if d is not None else replicated(1), inputs={(0,): req})


def _batch_rows(ctx, a, s: ShardSpec) -> ShardSpec | None:
    """``s`` with its rows re-laid over the batch axes when they are split over others
    of the same size (3d's swapped layout), the other dims giving those axes up; ``s``
    itself when its rows are already the batch's; ``None`` when its rows are not split."""
    ba = ctx.batch_axes
    if not ba or not s.ndim or not s.dims[0] or not SymbolicSizes.is_rows(ctx.pshape(a)[0]):
        return None
    if s.dims[0] == ba:
        return s
    if ctx.mesh.size(s.dims[0]) != ctx.mesh.size(ba):
        return None
    return ShardSpec(dims=(ba,) + tuple(tuple(x for x in d if x not in ba) for d in s.dims[1:]), partial=s.partial)


def scatter_add(ctx: RuleContext) -> Choice:
    """``y.scatter_add(0, i, v)`` of rows ``i`` / ``v`` split over the batch into a fresh
    zero ``y``: the rank's sums, a partial sum over the batch axes of the dense ones."""
    node = ctx.node
    y, d, idx, v = node.args[:4]
    sy, si, sv = ctx.spec(y), ctx.spec(idx), ctx.spec(v)
    zero = isinstance(y, fx.Node) and y.target in (aten.zeros.default, aten.new_zeros.default,
                                                   aten.zeros_like.default)
    si, sv = _batch_rows(ctx, idx, si) or si, _batch_rows(ctx, v, sv) or sv
    rows = si.dims[0] if si.ndim and si.dims[0] == ctx.batch_axes and ctx.batch_axes else ()
    if zero and rows and sy.is_replicated and si.ndim == sv.ndim == 1 and sv.dims[0] == rows \
            and not sv.partial and d in (0, -1):
        part = tuple(a for a in ctx.mesh.axes if a in rows)
        return Choice(out=sy.with_partial(part), inputs={(0,): sy, (2,): si, (3,): sv},
                      notes=(f"the rank's sums: partial over {','.join(part)}",))
    return all_replicated_or_fallback(ctx, "scatter_add other than split rows summed into fresh zeros")


def gather_op(ctx: RuleContext) -> Choice:
    """``gather(x, d, index)``: dim ``d`` of ``x`` whole; the index and the output take
    ``x``'s other splits."""
    if (sc := _scalar(ctx)) is not None:
        return sc
    x, d, idx = ctx.node.args[:3]
    s = ctx.spec(x)
    d = d % s.ndim
    req_x = _need_unsplit(s, [d]).with_partial(())
    req_i = ShardSpec(dims=tuple(req_x.dims[j] if j != d else () for j in range(s.ndim)))
    return Choice(out=req_i, inputs={(0,): req_x, (2,): req_i})


# ------------------------------------------------------------------ reductions
def reduce_(ctx: RuleContext) -> Choice:
    """``sum`` / ``mean`` / ``amax``: a reduction over a split dim leaves a partial sum over
    its axes (``mean`` scaled by the split after the reduce); ``amax`` needs the dim
    whole instead."""
    node = ctx.node
    x = node.args[0]
    s = ctx.spec(x)
    n = s.ndim
    if node.target in (aten.mean.default, aten.sum.default):
        rdims, keep = list(range(n)), False
    else:
        rd = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
        # a 0-dim input reduces over nothing (its dim 0 / -1 names the value itself)
        rdims = list(range(n)) if rd is None or rd == [] or not n else \
            [d % n for d in ([rd] if isinstance(rd, int) else rd)]
        keep = node.args[2] if len(node.args) > 2 else node.kwargs.get("keepdim", False)
    split_axes = tuple(a for d in rdims for a in s.dims[d])
    if node.target == aten.amax.default:
        # a max is no sum: over a split dim it needs the dim whole, and of a partial sum
        # the sum first (found by tests/policies/test_opinfo.py)
        req = _need_unsplit(s, rdims).with_partial(())
        split_axes = ()
    else:
        req = s
    dims = [req.dims[d] if d not in rdims else () for d in range(n)]
    segs = [req.segments[d] if d not in rdims else 1 for d in range(n)]
    if not keep:
        dims = [dims[d] for d in range(n) if d not in rdims]
        segs = [segs[d] for d in range(n) if d not in rdims]
    post = ()
    if split_axes and node.target in (aten.mean.dim, aten.mean.default):
        post = (Step(op="scale", factor=1.0 / ctx.mesh.size(split_axes)),)
    # mesh order for the partial axes
    part = tuple(a for a in ctx.mesh.axes if a in split_axes or a in req.partial)
    return Choice(out=ShardSpec(dims=tuple(dims), segments=tuple(segs), partial=part), inputs={(0,): req}, post=post)


# -------------------------------------------------------------------- matmuls
def matmul(ctx: RuleContext) -> Choice:
    """``matmul`` / ``bmm`` / ``mm`` between activations (attention's ``QKᵀ`` and ``PV``):
    batch dims keep their split; a contracted dim split alike on both sides gives a
    partial sum over its axes; a vector operand falls back."""
    a, b = ctx.node.args[:2]
    sa, sb = ctx.spec(a), ctx.spec(b)
    if sa.ndim < 2 or sb.ndim < 2:
        return _fallback(ctx, "matmul with a vector operand")
    out_shape = ctx.pshape(ctx.node)
    n = len(out_shape)
    bd = [()] * (n - 2)
    for s, sh in ((sa, ctx.pshape(a)), (sb, ctx.pshape(b))):
        off = (n - 2) - (len(sh) - 2)
        for d in range(len(sh) - 2):
            if s.dims[d] and sh[d] == out_shape[d + off] and not bd[d + off]:
                bd[d + off] = s.dims[d]
    ka, kb = sa.dims[-1], sb.dims[-2]
    part: tuple = ()
    if ka and ka == kb:
        part, kk = ka, ka
    else:
        kk = ()

    def req(s, sh, last2):
        off = (n - 2) - (len(sh) - 2)
        dd = tuple(bd[d + off] if sh[d] == out_shape[d + off] else () for d in range(len(sh) - 2)) + last2
        return ShardSpec(dims=dd)

    ra = req(sa, ctx.pshape(a), (sa.dims[-2] if not set(sa.dims[-2]) & set(sb.dims[-1]) else (), kk))
    rb = req(sb, ctx.pshape(b), (kk, sb.dims[-1] if not set(sb.dims[-1]) & set(ra.dims[-2]) else ()))
    out = ShardSpec(dims=tuple(bd) + (ra.dims[-2], rb.dims[-1]), partial=part)
    return Choice(out=out, inputs={(0,): ra, (1,): rb})


def baddbmm(ctx: RuleContext) -> Choice:
    """``beta·input + alpha·(b1 @ b2)``: the batched matmul's layout; ``input``
    (broadcast) follows it. A partial product cannot take ``input`` once per rank."""
    node = ctx.node
    inp, b1, b2 = node.args[:3]
    mm = matmul(_Shifted(ctx, (b1, b2)))
    if mm.fallback or mm.out.partial:
        return _fallback(ctx, "baddbmm with a contracted split")
    out = mm.out
    n = out.ndim
    sh = ctx.pshape(inp)
    off = n - len(sh)
    oshape = ctx.pshape(node)
    req = ShardSpec(dims=tuple(out.dims[d + off] if sh[d] == oshape[d + off] else () for d in range(len(sh))))
    return Choice(out=out, inputs={(0,): req, (1,): mm.inputs[(0,)], (2,): mm.inputs[(1,)]})


class _Shifted:
    """A view of ``ctx`` whose node arguments are ``args`` (to reuse a rule on a sub-expression)."""

    def __init__(self, ctx, args):
        self._ctx = ctx
        self.node = _ArgsView(ctx.node, args)

    def __getattr__(self, k):
        return getattr(self._ctx, k)


class _ArgsView:
    def __init__(self, node, args):
        self._node, self.args, self.kwargs = node, tuple(args), {}

    def __getattr__(self, k):
        return getattr(self._node, k)


# ------------------------------------------------------------------- attention
def sdpa(ctx: RuleContext) -> Choice:
    """``scaled_dot_product_attention``: batch and heads keep their split, sequence and
    head dim whole; with fewer kv heads (GQA) the kv heads stay split when the head
    split divides them and are replicated otherwise. A mask follows the batch and
    head split it broadcasts over. In train mode with dropout the
    :class:`~autoshard.ir.kernels.AttentionDropout` kernel draws rank-consistent masks."""
    node = ctx.node
    q, k, v = node.args[:3]
    sq = ctx.spec(q)
    if sq.ndim != 4 or ctx.spec(k).ndim != 4:       # [batch, seq, dim] without heads (found by the OpInfo check)
        return _fallback(ctx, "attention on inputs without a heads dim")
    args = list(node.args) + [None] * 4
    dropout_p = args[4] if args[4] is not None else node.kwargs.get("dropout_p", 0.0)
    mask = args[3] if isinstance(args[3], fx.Node) else node.kwargs.get("attn_mask")
    # context parallelism: queries keep their sequence split, keys and values are
    # gathered whole (backward reduce-scatters their gradients), the mask keeps the rows
    # of the local queries (docs/design.md, "Context parallelism")
    cp = ("cp",) if "cp" in ctx.mesh.axes and sq.dims[2] == ("cp",) else ()
    if cp and not isinstance(mask, fx.Node) and (node.kwargs.get("is_causal") or (len(node.args) > 5 and node.args[5])):
        raise NeedReplicate((0,), 2, "causal attention without a mask tensor cannot take its queries split on "
                                     "the sequence (the causal offset of a block is not in the op)")
    base = ShardSpec(dims=(sq.dims[0], sq.dims[1], cp, ()))
    whole_seq = ShardSpec(dims=(sq.dims[0], sq.dims[1], (), ()))
    qs, ks = ctx.pshape(q), ctx.pshape(k)
    inputs = {(0,): base}
    kv_req = whole_seq
    if ks[1] != qs[1]:                 # enable_gqa: fewer kv heads
        kv_req = ShardSpec(dims=(sq.dims[0], (), (), ())) if sq.dims[1] else whole_seq
        if sq.dims[1] and ks[1] % ctx.mesh.size(sq.dims[1]) == 0 and (qs[1] // ks[1]) >= 1:
            kv_req = whole_seq
    inputs[(1,)] = kv_req
    inputs[(2,)] = kv_req
    if isinstance(mask, fx.Node):
        ms = ctx.pshape(mask)
        off = 4 - len(ms)
        md = tuple(base.dims[d + off] if d + off < 3 and ms[d] == qs[d + off] else () for d in range(len(ms)))
        inputs[(3,) if isinstance(args[3], fx.Node) else ("kw", "attn_mask")] = ShardSpec(dims=md)
    if dropout_p and ctx.training:
        k = AttentionDropout(p=float(dropout_p), mode=ctx.dropout, in_specs=tuple(inputs.items()), out_spec=base)
        return Choice.run(k, notes=(f"attention dropout p={dropout_p:g}, {ctx.dropout} masks"
                                    + (", keys and values gathered over cp" if cp else ""),))
    if cp and ctx.cp_attention == "ring":
        # the keys and values stay split: their blocks travel around the cp ring
        ring = ShardSpec(dims=kv_req.dims[:2] + (cp, ()))
        inputs[(1,)] = inputs[(2,)] = ring
        k = RingAttention(axes=cp, in_specs=tuple(inputs.items()), out_spec=base)
        return Choice.run(k, notes=("ring attention over cp: key/value blocks sent around the ring, "
                                    "merged through their log-sum-exp",))
    return Choice(out=base, inputs=inputs, notes=("keys and values gathered over cp",) if cp else ())


def type_as(ctx: RuleContext) -> Choice:
    """``type_as(x, other)``: ``x``'s values and shape in ``other``'s dtype; ``other``
    gives only its dtype, so its layout is taken as it is."""
    x, other = ctx.node.args[:2]
    s = ctx.spec(x)
    return Choice(out=s, inputs={(0,): s, (1,): ctx.spec(other)})


def dropout(ctx: RuleContext) -> Choice:
    """Dropout keeps the layout; in train mode with p > 0 it runs the
    :class:`~autoshard.ir.kernels.Dropout` kernel (rank-consistent masks, no collective).
    A partial value passes: the mask is the same on every rank of its partial axes."""
    x, p, train = ctx.node.args[:3]
    s = ctx.spec(x)
    if not train or p == 0:
        return Choice(out=s, inputs={(0,): s})
    s = s.with_partial(())      # masks are drawn for whole values: a partial sum is reduced first
    return Choice.run(Dropout(p=float(p), mode=ctx.dropout, in_specs=(((0,), s),), out_spec=s),
                      notes=(f"dropout p={p:g}, {ctx.dropout} masks",))


# ------------------------------------------------------------------ norms/loss
def layer_norm(ctx: RuleContext) -> Choice:
    """``layer_norm``: local when the normalised dim is whole; over one split dim the
    :class:`~autoshard.ir.kernels.DistLayerNorm` kernel all-reduces the statistics over
    its axes (an all-reduce backward); the weight and bias follow the normalised dims."""
    node = ctx.node
    x = node.args[0]
    s = ctx.spec(x).with_partial(())
    nd = len(node.args[1])
    ndim = s.ndim
    normed = range(ndim - nd, ndim)
    axes = tuple(a for d in normed for a in s.dims[d])
    if nd > 1 and axes:
        s = _need_unsplit(s, normed)
        axes = ()
    inputs = {(0,): s}
    pspec = ShardSpec(dims=tuple(s.dims[d] for d in normed), segments=tuple(s.segments[d] for d in normed))
    for i in (2, 3):
        if len(node.args) > i and isinstance(node.args[i], fx.Node):
            inputs[(i,)] = pspec
    if not axes:
        return Choice(out=s, inputs=inputs)
    return Choice.run(DistLayerNorm(axes=axes, in_specs=tuple(inputs.items()), out_spec=s),
                      grad_complete=frozenset({(0,)}), notes=(f"statistics reduced over {','.join(axes)}",))


def convolution(ctx: RuleContext) -> Choice:
    """``conv1d`` / ``conv2d`` / ``conv3d`` / ``convolution`` (a vision patch embedding, an
    audio front end): each sample is convolved on its own, so the batch split stays
    (re-laid as the batch's) and the output keeps it; channels and positions are whole,
    the weight and bias whole (their gradients summed over the batch axes, as any whole
    parameter's)."""
    node = ctx.node
    x, w = node.args[:2]
    rows = _batch_rows(ctx, x, ctx.spec(x))
    # an unbatched input ([C, L] for a weight [C', C, k]) has no rows (found by the OpInfo check)
    lead = rows.dims[0] if rows and ctx.spec(x).ndim == ctx.spec(w).ndim else ()
    inputs = {}
    for path, a in _tensor_args(ctx):
        nd = ctx.spec(a).ndim
        inputs[path] = ShardSpec(dims=(lead,) + ((),) * (nd - 1)) if path == (0,) else replicated(nd)
    out = ShardSpec(dims=(lead,) + ((),) * (len(ctx.pshape(node)) - 1))
    return Choice(out=out, inputs=inputs,
                  notes=("convolution: sample by sample" + (f", rows over {','.join(lead)}" if lead else "")
                         + "; weight whole",))


def sequence_conv_rule(ctx: RuleContext) -> Choice:
    """:func:`autoshard.ir.tokens.sequence_conv` (a convolution along the sequence whose
    output keeps its length, e.g. a causal one): as :func:`convolution`, and a time dim
    split over ``cp`` keeps its split: the :class:`~autoshard.ir.kernels.SequenceConv`
    kernel exchanges the halo, the rows the kernel reaches past each block's edges."""
    node = ctx.node
    x = node.args[0]
    s = ctx.spec(x)
    rows = _batch_rows(ctx, x, s)
    lead = rows.dims[0] if rows else ()
    time = ("cp",) if s.ndim == 3 and s.dims[2] == ("cp",) and not s.partial else ()
    if not time:
        return convolution(ctx)
    spec = ShardSpec(dims=(lead, (), time))
    inputs = {(0,): spec}
    for path, a in _tensor_args(ctx):
        if path != (0,):
            inputs[path] = replicated(ctx.spec(a).ndim)
    left, right = node.args[3], node.args[4]
    if left + right == 0:           # a pointwise convolution: no row crosses a block's edge
        return Choice(out=spec, inputs=inputs, notes=("convolution along the sequence, pointwise: cp split kept",))
    k = SequenceConv(axes=time, left=left, right=right, chunks=2 if ctx.cp_order == "balanced" else 1,
                     in_specs=tuple(inputs.items()), out_spec=spec)
    return Choice.run(k, notes=(f"convolution along the cp-split sequence: halo of {left} row(s) before and "
                                f"{right} after each block, gathered over cp",))


def cross_entropy(ctx: RuleContext) -> Choice:
    """``cross_entropy_loss`` in every form (class weights, ``label_smoothing``,
    ``ignore_index``, ``reduction`` mean / sum / none, spatial targets ``[N, C, ...]``):
    the :class:`~autoshard.ir.kernels.CrossEntropy` kernel, vocab-parallel when the logits
    are split (or partial) on the classes. Each token's loss is local (per sample); a
    mean or sum takes the global sum over every axis splitting the tokens (the batch's,
    cp's sequence) and, for a mean, the global weight of the tokens kept (their count
    without weights), so the loss is the dense one on every rank (docs/design.md, "The
    batch contract"). ``reduction='none'`` keeps the tokens' split. Probability targets
    and an unbatched input go through :func:`_fallback`."""
    node = ctx.node
    logits, target = node.args[:2]
    names = ("weight", "reduction", "ignore_index", "label_smoothing")
    args = list(node.args) + [None] * 6
    weight, reduction, ignore_index, smoothing = (args[2 + i] if args[2 + i] is not None else node.kwargs.get(k)
                                                  for i, k in enumerate(names))
    reduction = 1 if reduction is None else reduction
    ignore_index = -100 if ignore_index is None else ignore_index
    smoothing = float(smoothing or 0.0)
    sl = ctx.spec(logits)
    tokens = node.target is token_cross_entropy      # [..., V] logits, class last (passes/token_fold.py)
    floating_target = target.meta["val"].is_floating_point()
    if floating_target or sl.ndim < 2 or reduction not in (0, 1, 2) or \
            (weight is not None and ctx.pshape(weight)[0] != ctx.pshape(logits)[-1 if tokens else 1]):
        return _fallback(ctx, "cross-entropy with probability targets, an unbatched input or a class weight "
                              "of another size than the classes is computed on gathered logits")
    cd = sl.ndim - 1 if tokens else 1
    vocab_axes = sl.dims[cd] if not sl.partial else (
        sl.partial if ctx.pshape(logits)[cd] % ctx.mesh.size(sl.partial) == 0 else ())
    lead = tuple(sl.dims[d] for d in range(sl.ndim) if d != cd)
    # the token sum runs over every axis splitting the token dims (the batch's, and cp's sequence)
    rows = tuple(a for a in ctx.mesh.axes if any(a in d for d in lead))
    req_l = ShardSpec(dims=lead[:cd] + (vocab_axes,) + lead[cd:])
    req_t = ShardSpec(dims=lead)
    ins = [((0,), req_l), ((1,), req_t)]
    if isinstance(weight, fx.Node):
        ins.append(((2,) if isinstance(args[2], fx.Node) else ("kw", "weight"), replicated(1)))
    k = CrossEntropy(vocab_axes=vocab_axes, batch_axes=rows, ignore_index=int(ignore_index), reduction=int(reduction),
                     smoothing=smoothing, weighted=weight is not None, class_dim=cd if cd != sl.ndim - 1 else -1,
                     in_specs=tuple(ins), out_spec=req_t if reduction == 0 else replicated(0))
    how = {0: "per-token losses keep the split", 1: "global mean", 2: "global sum"}[int(reduction)]
    extra = ", ".join(x for x in (f"label smoothing {smoothing:g}" if smoothing else "",
                                  "class weights" if weight is not None else "",
                                  "spatial targets" if cd != sl.ndim - 1 else "") if x)
    return Choice.run(k, grad_complete=frozenset({(0,)}),
                      notes=(("vocab-parallel" if vocab_axes else "local") + " cross-entropy"
                             + (f" ({extra})" if extra else "")
                             + (f", couples samples: {how} over {','.join(rows)}" if rows and reduction else "")
                             + (f", {how}" if rows and not reduction else ""),))


# ------------------------------------------------------------ creation / misc
def creation(ctx: RuleContext) -> Choice:
    """``arange`` / ``zeros`` / ``full`` ...: a size read from the batch makes that dim split
    over the batch axes (it counts local rows at run time); others are whole."""
    shape = ctx.pshape(ctx.node)
    # a size read from the local batch: the batch, or rows of it leading an arange (its
    # length comes from local sizes at run time)
    lead_rows = ctx.node.target in (aten.arange.default,) and shape and SymbolicSizes.is_rows(shape[0])
    dims = tuple(ctx.batch_axes if ctx.batch_axes and (v == ctx.BATCH or (i == 0 and lead_rows)) else ()
                 for i, v in enumerate(shape))
    return Choice(out=ShardSpec(dims=dims), inputs={p: ctx.spec(a) for p, a in _tensor_args(ctx)})


def all_replicated_or_fallback(ctx: RuleContext, reason: str = "") -> Choice:
    """Unknown op: local when every input is replicated; otherwise :func:`_fallback`
    (every split gathered, the batch's included: an op with no rule is not known to
    treat samples one by one)."""
    targs = _tensor_args(ctx)
    specs = [ctx.spec(a) for _, a in targs]
    if all(s.is_replicated for s in specs):
        return Choice(out=ctx.default_out_spec(ctx.node))
    return _fallback(ctx, reason or f"no rule for {ctx.node.target}")


def _fallback(ctx, reason: str) -> Choice:
    """The op on whole tensors (docs/design.md, "The batch contract"): every input
    gathered to replicated (batch rows, sequence and feature splits, partial sums),
    the op run on the global values, and its output's rows cut back over the batch
    axes (forward: a local slice; backward: the gradient's rows all-gathered), so the
    sizes the graph reads later from the local batch still fit. A size argument read
    from the local batch cannot be given whole values: refused, naming the node."""
    node = ctx.node
    for a in _size_args(node):
        if any(SymbolicSizes.is_rows(v) for v in ctx.pshape_of_val(_SizeOf(a))) and ctx.batch_axes:
            raise ShardingError(f"no exact rule: {reason}; its inputs would be gathered whole, but it takes "
                                f"the local batch size `{a.name}` as an argument", node=node)
    inputs = {}
    batch_split = False
    for path, a in _tensor_args(ctx):
        s = ctx.spec(a)
        batch_split |= bool(s.ndim and set(s.dims[0]) & set(ctx.batch_axes))
        inputs[path] = replicated(s.ndim)
    out = ctx.default_out_spec(node)
    post = ()
    if isinstance(out, ShardSpec) and out.ndim and out.dims[0]:
        post = (Step(op="scatter", axes=out.dims[0], dim=0),)
    elif isinstance(out, tuple):        # several outputs: no cut after the op, each stays whole
        out = tuple(replicated(o.ndim) if isinstance(o, ShardSpec) else o for o in out)
    rows = f"; batch gathered, rows re-split over {','.join(out.dims[0])}" if post and batch_split else \
        ("; batch gathered" if batch_split else "")
    return Choice(out=out, inputs=inputs, post=post, fallback=True,
                  notes=(f"fallback: {reason}; inputs gathered to replicated{rows}",))


class _SizeOf:
    """A size argument seen as a one-dim shape (for :meth:`RuleContext.pshape_of_val`)."""

    def __init__(self, a: fx.Node):
        self.shape = (a.meta["val"],)


def _size_args(node: fx.Node) -> list[fx.Node]:
    """The symbolic sizes among ``node``'s arguments (lists flattened one level)."""
    out = []
    for a in list(node.args) + list(node.kwargs.values()):
        for b in (a if isinstance(a, (list, tuple)) else (a,)):
            if isinstance(b, fx.Node) and isinstance(b.meta.get("val"), torch.SymInt):
                out.append(b)
    return out


# --------------------------------------------------------- per-sample ops
#: ATen ops (by overload packet) that compute each sample from its own row alone
#: (docs/design.md, "The batch contract"): pooling, interpolation, padding, group
#: norm, pixel shuffles. Their rule keeps the batch split of dim 0 and holds every
#: other dim whole; checked on torch's OpInfo samples (tests/policies/test_opinfo.py).
PER_SAMPLE = frozenset(getattr(aten, n) for n in (
    "upsample_nearest1d", "upsample_nearest2d", "upsample_nearest3d", "_upsample_nearest_exact1d",
    "_upsample_nearest_exact2d", "_upsample_nearest_exact3d", "upsample_linear1d", "upsample_bilinear2d",
    "upsample_bicubic2d", "upsample_trilinear3d", "_upsample_bilinear2d_aa", "_upsample_bicubic2d_aa",
    "max_pool1d", "max_pool2d", "max_pool3d", "avg_pool1d", "avg_pool2d", "avg_pool3d",
    "adaptive_avg_pool1d", "adaptive_avg_pool2d", "adaptive_avg_pool3d", "_adaptive_avg_pool2d",
    "group_norm", "pixel_shuffle", "pixel_unshuffle", "channel_shuffle", "reflection_pad1d",
    "reflection_pad2d", "reflection_pad3d", "replication_pad1d", "replication_pad2d", "replication_pad3d",
    "constant_pad_nd", "im2col", "col2im", "grid_sampler", "grid_sampler_2d") if hasattr(aten, n))


def per_sample(ctx: RuleContext) -> Choice:
    """An op of :data:`PER_SAMPLE` (or ``batch_norm`` with running statistics): each
    sample's output is computed from that sample alone, so the rows of a batch split
    stay split (re-laid as the batch's when swapped) and every tensor argument whose
    leading dim is the batch follows them; every other dim, and every other argument
    (weights, sizes), whole."""
    node = ctx.node
    targs = _tensor_args(ctx)
    x = targs[0][1] if targs else None
    rows = _batch_rows(ctx, x, ctx.spec(x)) if x is not None else None
    lead = rows.dims[0] if rows else ()
    inputs = {}
    for path, a in targs:
        nd = ctx.spec(a).ndim
        keep = lead if nd and SymbolicSizes.is_rows(ctx.pshape(a)[0]) and \
            ctx.pshape(a)[0] == ctx.pshape(x)[0] else ()
        inputs[path] = ShardSpec(dims=(keep,) + ((),) * (nd - 1)) if nd else replicated(0)
    shape = ctx.pshape(node) if ctx.is_tensor(node) else ()
    out = ShardSpec(dims=((lead if shape and shape[0] == ctx.pshape(x)[0] else ()),) + ((),) * (len(shape) - 1)) \
        if shape else replicated(0)
    if not isinstance(node.meta.get("val"), torch.Tensor):
        return _fallback(ctx, "a per-sample op with several outputs")
    return Choice(out=out, inputs=inputs,
                  notes=(f"per sample: rows over {','.join(lead)}",) if lead and out.dims[0] else ())


def batch_norm(ctx: RuleContext) -> Choice:
    """``batch_norm``. With running statistics (eval) it is per sample (:func:`per_sample`).
    In training the statistics are of the whole batch: with its rows split, the
    :class:`~autoshard.ir.kernels.SyncBatchNorm` kernel all-reduces each channel's sum and
    sum of squares over the batch axes (``SyncBatchNorm``: the same figures on every rank,
    equal to dense, and so are the running statistics it updates); the backward
    all-reduces the statistics' gradients. Channels and positions are whole, the weight,
    bias and running statistics whole (the weight's and bias's gradients summed over the
    batch axes, as any whole parameter's)."""
    node = ctx.node
    a = list(node.args) + [None] * 9
    if not a[5]:
        return per_sample(ctx)
    x = a[0]
    rows = _batch_rows(ctx, x, ctx.spec(x))
    lead = rows.dims[0] if rows else ()
    nd = ctx.spec(x).ndim
    spec = ShardSpec(dims=(lead,) + ((),) * (nd - 1))
    inputs = {(0,): spec}
    for i in (1, 2, 3, 4):
        if isinstance(a[i], fx.Node):
            inputs[(i,)] = replicated(ctx.spec(a[i]).ndim)
    if not lead:
        return Choice(out=spec, inputs=inputs)
    k = SyncBatchNorm(axes=lead, in_specs=tuple(inputs.items()), out_spec=spec)
    return Choice.run(k, notes=(f"couples samples: statistics synced over {','.join(lead)} "
                                f"(SyncBatchNorm; running statistics from the global figures)",))


def no_spec(ctx: RuleContext) -> Choice:
    """Nodes with no tensor layout (``sym_size``, metadata asserts): no spec."""
    return Choice(out=None)


_POINTWISE_EXTRA = {aten.__and__.Tensor, aten.__or__.Tensor, aten.where.self, aten.where.ScalarOther,
                    aten.where.ScalarSelf, aten.where.Scalar, aten.masked_fill.Scalar,
                    aten.masked_fill.Tensor, aten.pow.Tensor_Scalar, aten.gelu.default, aten.silu.default,
                    aten.relu.default, aten.tanh.default, aten.sigmoid.default, aten.rsqrt.default,
                    aten.lift_fresh_copy.default, aten.floor_divide.default, aten.remainder.Scalar,
                    aten.remainder.Tensor}

_FUNCTIONAL_POINTWISE = {"aten::masked_fill", "aten::fill", "aten::zero", "aten::clamp"}

RULES = {
    aten.view.default: reshape, aten.reshape.default: reshape, aten._unsafe_view.default: reshape,
    aten.flatten.using_ints: flatten,
    aten.expand.default: expand,
    aten.transpose.int: transpose, aten.t.default: transpose, aten.numpy_T.default: transpose,
    aten.permute.default: permute,
    aten.unsqueeze.default: unsqueeze, aten.squeeze.dim: squeeze, aten.squeeze.dims: squeeze,
    aten.squeeze.default: squeeze,
    aten.alias.default: identity_like, aten.contiguous.default: identity_like, aten.clone.default: identity_like,
    aten.detach.default: identity_like, aten.to.dtype: identity_like, aten.to.dtype_layout: identity_like,
    aten._to_copy.default: identity_like, aten.to.device: identity_like, aten.type_as.default: type_as,
    aten.slice.Tensor: slice_, aten.select.int: select,
    aten.split.Tensor: split, aten.split_with_sizes.default: split, aten.chunk.default: split,
    operator.getitem: getitem,
    aten.cat.default: cat, aten.stack.default: stack, aten.pad.default: pad,
    aten.index.Tensor: index_tensor, aten.gather.default: gather_op,
    aten.cumsum.default: cumsum, aten.diff.default: dimwise,
    aten.sort.default: sort, aten.sort.stable: sort, aten.topk.default: topk, aten.histc.default: histc,
    aten.max.dim: max_dim, aten.min.dim: max_dim,
    aten.unbind.int: unbind, aten.masked_scatter.default: masked_scatter,
    aten.index_put_.default: index_put, aten.index_put.default: index_put,
    aten.index_copy_.default: index_copy, aten.index_copy.default: index_copy,
    aten.empty_like.default: like, aten.zeros_like.default: like, aten.ones_like.default: like,
    aten.full_like.default: like,
    aten.repeat_interleave.self_int: repeat_interleave,
    aten.scatter_add_.default: scatter_add, aten.scatter_add.default: scatter_add,
    aten.softmax.int: softmax, aten._softmax.default: softmax, aten.log_softmax.int: softmax,
    aten._log_softmax.default: softmax,
    aten.mean.dim: reduce_, aten.sum.dim_IntList: reduce_, aten.amax.default: reduce_,
    aten.mean.default: reduce_, aten.sum.default: reduce_,
    aten.matmul.default: matmul, aten.bmm.default: matmul, aten.mm.default: matmul,
    aten.baddbmm.default: baddbmm,
    aten.scaled_dot_product_attention.default: sdpa,
    aten.layer_norm.default: layer_norm, aten.batch_norm.default: batch_norm,
    aten.conv1d.default: convolution, aten.conv2d.default: convolution, aten.conv3d.default: convolution,
    aten.conv1d.padding: convolution, aten.conv2d.padding: convolution, aten.conv3d.padding: convolution,
    aten.convolution.default: convolution, sequence_conv: sequence_conv_rule,
    aten.conv_transpose1d.default: convolution, aten.conv_transpose2d.input: convolution,
    aten.conv_transpose3d.input: convolution,
    aten.cross_entropy_loss.default: cross_entropy, token_cross_entropy: cross_entropy,
    aten.arange.default: creation, aten.arange.start: creation, aten.arange.start_step: creation,
    aten.full.default: creation, aten.zeros.default: creation, aten.ones.default: creation,
    aten.new_ones.default: creation, aten.new_zeros.default: creation, aten.new_full.default: creation,
    aten.empty.memory_format: creation, aten.scalar_tensor.default: creation, aten.new_empty.default: creation,
    aten.sym_size.int: no_spec, aten._assert_tensor_metadata.default: no_spec,
}
RULES = {k: v for k, v in RULES.items() if v is not None}


def rule_for(node: fx.Node):
    """The rule that plans ``node``: its entry in :data:`RULES`, else dropout, in-place
    writes, pointwise ops (by ``torch.Tag.pointwise``), and for anything else
    :func:`all_replicated_or_fallback`.

    >>> g = fx.Graph()
    >>> x = g.placeholder("x")
    >>> rule_for(g.call_function(aten.gelu.default, (x,))).__name__
    'pointwise'
    >>> rule_for(g.call_function(aten.view.default, (x, [2, 3]))).__name__
    'reshape'"""
    t = node.target
    if t in RULES:
        return RULES[t]
    if isinstance(t, torch._ops.OpOverload) and t.overloadpacket in PER_SAMPLE:
        return per_sample
    if t == aten.dropout.default:
        return dropout
    if writes_first_arg(t) and (t == aten.copy_.default or torch.Tag.pointwise in t.tags
                                 or t._schema.name.rstrip("_") in _FUNCTIONAL_POINTWISE):
        return inplace
    if t in _POINTWISE_EXTRA or (isinstance(t, torch._ops.OpOverload) and torch.Tag.pointwise in t.tags):
        return pointwise
    return all_replicated_or_fallback
