"""Views and reshapes: ``view`` / ``reshape`` / ``flatten`` (dims paired by equal
products), ``expand``, ``transpose`` / ``permute``, ``unsqueeze`` / ``squeeze``,
``split`` / ``chunk``, ``cat`` / ``stack`` / ``unbind``, ``pad``, ``repeat_interleave``.
"""

from __future__ import annotations

import math

import torch
from torch import fx

from autoshard.ir.spec import ShardSpec, replicated

from ..base import Choice, NeedReplicate, RuleContext, SymbolicSizes
from .common import buffer_layout, need_unsplit, read_split, register, scalar_choice, without_dim

aten = torch.ops.aten

__all__ = ["cat", "expand", "flatten", "pad", "patch_sizes", "permute", "repeat_interleave", "reshape", "split",
           "squeeze", "stack", "transpose", "unbind", "unsqueeze", "view_groups"]


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
        elif m > 1 and outs[first] == m and len(go) > 1:
            # ModernBERT's Wqkv viewed as [b, s, 3, heads, hd] with 6 heads at 4 ranks
            raise NeedReplicate((0,), d, f"reshape {SymbolicSizes.text(ins)}->{SymbolicSizes.text(outs)}: its {m} "
                                         f"fused blocks' dim of size {outs[go[1]]} (heads) is not divisible by "
                                         f"{c} shards")
        else:
            raise NeedReplicate((0,), d, f"reshape {SymbolicSizes.text(ins)}->{SymbolicSizes.text(outs)}: leading dim {outs[first]} "
                                         f"is not divisible by {c} shards" + (f" × {m} segments" if m > 1 else ""))
    return ShardSpec(dims=tuple(dims), segments=tuple(segs), partial=in_spec.partial), {}


def _is_seq_size(size: int) -> bool:
    """A size that is a multiple of the sequence and involves no batch (the whole
    sequence, read from an input that is not split on it)."""
    return size % SymbolicSizes.SEQ == 0 and size % SymbolicSizes.BATCH != 0


def patch_sizes(ctx, out_spec: ShardSpec, sizes, path, literal_spec: ShardSpec | None = None) -> dict:
    """Literal sizes at split positions become local: ``{path: {"at": [[pos, local], ...]}}``
    (positions, never values: a -1 entry is left alone). A symbolic entry is read at run
    time from a tensor: ``sym_size(x, d)`` of a dim split over other axes than this one
    reads a local size that is not this dim's, so it is divided (``"div": [[pos, n], ...]``)
    or multiplied (``"mul"``: the batch read from the split attention mask for a reshape
    whose batch is whole, Falcon-H1's Mamba-2 chunks in 2d) to this dim's local size
    (docs/design.md, "Shared ops"). Another symbolic entry (read from a whole
    dim): local already where the split is the batch split (the batch input is split),
    else the whole size, divided at run time (1d-sp's sequence split). ``literal_spec``:
    the dims whose other entries are patched (default ``out_spec``'s)."""
    if not isinstance(sizes, (list, tuple)):
        return {}
    at, div, mul = [], [], []
    for j, axes in enumerate((literal_spec or out_spec).dims):
        if j >= len(sizes):
            continue
        if read := read_split(ctx, sizes[j]):
            have, want = ctx.mesh.size(read), ctx.mesh.size(out_spec.dims[j])
            if tuple(read) != tuple(out_spec.dims[j]) and have != want:
                (div if want > have else mul).append([j, max(have, want) // min(have, want)])
        elif not axes:
            continue
        elif isinstance(sizes[j], int) and sizes[j] != -1:
            at.append([j, sizes[j] // ctx.mesh.size(axes)])
        elif isinstance(sizes[j], fx.Node) and not set(axes) <= set(ctx.batch_axes) and \
                _is_seq_size(ctx.pshape(ctx.node)[j]):
            div.append([j, ctx.mesh.size(axes)])
    patch = ({"at": at} if at else {}) | ({"div": div} if div else {}) | ({"mul": mul} if mul else {})
    return {path: patch} if patch else {}


@register(aten.view.default, aten.reshape.default, aten._unsafe_view.default)
def reshape(ctx: RuleContext) -> Choice:
    """``view`` / ``reshape``: dims are paired by equal products (:func:`view_groups`); the
    outermost dim of a merged group may stay split, and literal sizes at split
    positions are patched to local sizes (by position, never by value)."""
    x = ctx.node.args[0]
    s = ctx.spec(x)
    out, _ = _view_out_spec(ctx, s, ctx.pshape(x), ctx.pshape(ctx.node))
    return Choice(out=out, inputs={(0,): s}, patches=patch_sizes(ctx, out, ctx.node.args[1], (1,)))


@register(aten.flatten.using_ints)
def flatten(ctx: RuleContext) -> Choice:
    """``flatten(x, start, end)``: a reshape whose sizes are implied (nothing to patch)."""
    x = ctx.node.args[0]
    s = ctx.spec(x)
    out, _ = _view_out_spec(ctx, s, ctx.pshape(x), ctx.pshape(ctx.node))
    return Choice(out=out, inputs={(0,): s})


@register(aten.expand.default)
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
    written, spread = _written_buffer(ctx), set()
    for j in range(len(outs)):
        d = j - off
        if written is not None and d >= 0 and ins[d] == 1 and outs[j] > 1 and not dims[j] and written.dims[j] \
                and not set(written.dims[j]) & {a for dd in dims for a in dd}:
            # a size-1 dim broadcast into a buffer split along it: each rank expands to its own
            # block (DeepSeek-V3's rope key over the local heads); backward sums the input's
            # gradient over the ranks (the copy_to grad_needs puts on a replicated input)
            dims[j] = written.dims[j]
            spread.add(j)
    out = ShardSpec(dims=tuple(dims), segments=tuple(segs), partial=s.partial)
    # only the dims that were split in the input (or broadcast into a split) need their literal patched
    keep = ShardSpec(dims=tuple(dims[j] if (j - off >= 0 and ins[j - off] == outs[j]) or j in spread else ()
                                for j in range(len(outs))))
    return Choice(out=out, inputs={(0,): s}, patches=patch_sizes(ctx, out, ctx.node.args[1], (1,), keep))


def _written_buffer(ctx) -> ShardSpec | None:
    """The layout of the buffer this node's one use writes it into, when that is a
    ``copy_`` into a slice (along other dims) of a ``new_empty`` buffer laid out by
    :func:`~.common.buffer_layout` (its source is planned before this node); None otherwise."""
    users = [u for u in ctx.node.users if u.target != aten._assert_tensor_metadata.default]
    if len(users) != 1 or users[0].target != aten.copy_.default or users[0].args[1] is not ctx.node:
        return None
    dst = users[0].args[0]
    while isinstance(dst, fx.Node) and dst.target == aten.slice.Tensor:
        dst = dst.args[0]
    if not isinstance(dst, fx.Node) or dst.target != aten.new_empty.default or \
            len(ctx.pshape(dst)) != len(ctx.pshape(ctx.node)):
        return None
    return buffer_layout(ctx, dst)


def _permuted(s: ShardSpec, perm) -> ShardSpec:
    return ShardSpec(dims=tuple(s.dims[p] for p in perm), segments=tuple(s.segments[p] for p in perm),
                     partial=s.partial)


@register(aten.transpose.int, aten.t.default, aten.numpy_T.default)
def transpose(ctx: RuleContext) -> Choice:
    """``transpose`` / ``t`` / ``numpy_T`` (``x.T``): the spec's dims swapped (reversed) alike."""
    if (sc := scalar_choice(ctx)) is not None:
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


@register(aten.permute.default)
def permute(ctx: RuleContext) -> Choice:
    """``permute``: the spec's dims permuted alike."""
    x = ctx.node.args[0]
    s = ctx.spec(x)
    perm = [d % s.ndim for d in ctx.node.args[1]]
    return Choice(out=_permuted(s, perm), inputs={(0,): s})


@register(aten.unsqueeze.default)
def unsqueeze(ctx: RuleContext) -> Choice:
    """``unsqueeze``: a whole dim inserted."""
    x = ctx.node.args[0]
    s = ctx.spec(x)
    d = ctx.node.args[1] % (s.ndim + 1)
    dims, segs = list(s.dims), list(s.segments)
    dims.insert(d, ())
    segs.insert(d, 1)
    return Choice(out=ShardSpec(dims=tuple(dims), segments=tuple(segs), partial=s.partial), inputs={(0,): s})


@register(aten.squeeze.dim, aten.squeeze.dims, aten.squeeze.default)
def squeeze(ctx: RuleContext) -> Choice:
    """``squeeze``: the size-1 dims dropped from the spec."""
    if (sc := scalar_choice(ctx)) is not None:
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


@register(aten.split.Tensor, aten.split_with_sizes.default, aten.chunk.default)
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


@register(aten.cat.default)
def cat(ctx: RuleContext) -> Choice:
    """``cat``: the concatenated dim whole, every input in the first split input's layout."""
    node = ctx.node
    tensors = node.args[0]
    d = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)
    specs = [ctx.spec(t) for t in tensors]
    n = ctx.pshape(node).__len__()
    d = d % n
    base = next((s for s in specs if not s.is_replicated), specs[0])
    req = need_unsplit(base, [d]).with_partial(())
    return Choice(out=req, inputs={(0, j): req for j in range(len(tensors))})


@register(aten.stack.default)
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


@register(aten.unbind.int)
def unbind(ctx: RuleContext) -> Choice:
    """``unbind(x, d)`` (a tensor listed along one dim: LLaVA's image features per
    sample): dim ``d`` must be whole; every piece keeps the other splits."""
    node = ctx.node
    s = ctx.spec(node.args[0])
    d = (node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)) % max(s.ndim, 1)
    req = need_unsplit(s, [d])
    return Choice(out=tuple(without_dim(req, d) for _ in node.meta["val"]), inputs={(0,): req})


@register(aten.pad.default)
def pad(ctx: RuleContext) -> Choice:
    """``pad``: the padded (trailing) dims must be whole."""
    x = ctx.node.args[0]
    s = ctx.spec(x)
    npad = len(ctx.node.args[1]) // 2
    req = need_unsplit(s, range(s.ndim - npad, s.ndim)).with_partial(())
    return Choice(out=req, inputs={(0,): req})


@register(aten.repeat_interleave.self_int)
def repeat_interleave(ctx: RuleContext) -> Choice:
    """``x.repeat_interleave(k)`` of a 1-D tensor (or on dim 0): each row becomes ``k``
    rows in place, so a block of rows stays the matching block."""
    node = ctx.node
    s = ctx.spec(node.args[0])
    d = node.args[2] if len(node.args) > 2 else node.kwargs.get("dim")
    if s.ndim == 1 or d in (0, -s.ndim):
        req = need_unsplit(s, range(1, s.ndim)).with_partial(())
        return Choice(out=req, inputs={(0,): req})
    req = replicated(s.ndim) if d is None else need_unsplit(s, [d % s.ndim]).with_partial(())
    return Choice(out=req if d is not None else replicated(1), inputs={(0,): req})
