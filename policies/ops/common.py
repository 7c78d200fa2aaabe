"""The registry every op family files its rules into, and what the families share.

A rule is registered where it is written, by the ATen overloads it serves
(``@register(aten.add.Tensor, ...)``, as DTensor's ``register_op_strategy``);
:func:`autoshard.policies.generic.rule_for` looks the node's target up in
:data:`RULES` (one dict lookup per node). Every rule takes the propagate pass's
context ``ctx`` and returns a :class:`~autoshard.policies.base.Choice`, or raises
:class:`~autoshard.policies.base.NeedReplicate` when an input split cannot pass (the
pass then gathers that input, or re-plans the Linear that produced it). An op with
no rule goes to :func:`all_replicated_or_fallback`.

>>> from autoshard.policies import generic   # imports every family
>>> RULES[torch.ops.aten.view.default].__name__, PACKET_RULES[torch.ops.aten.max_pool2d].__name__
('reshape', 'per_sample')
"""

from __future__ import annotations

import operator

import torch
from torch import fx

from autoshard.ir.errors import ShardingError
from autoshard.ir.plan import Step
from autoshard.ir.spec import ShardSpec, replicated

from ..base import Choice, RuleContext, SymbolicSizes

aten = torch.ops.aten

__all__ = ["PACKET_RULES", "RULES", "all_replicated_or_fallback", "batch_rows", "buffer_layout", "fallback",
           "need_unsplit", "read_split", "register", "scalar_choice", "tensor_args", "without_dim"]


#: ATen overload (or graph function: ``operator.getitem``, :func:`~autoshard.ir.tokens.sequence_conv`)
#: -> the rule that plans it; filled by :func:`register` where each rule is written
RULES: dict = {}
#: ATen overload packet -> the rule that plans every overload of it (the per-sample ops)
PACKET_RULES: dict = {}


def register(*targets, packets=()):
    """A decorator filing a rule under the ATen overloads it serves (``targets``) and the
    overload packets whose every overload it serves (``packets``).

    Raises:
        ValueError: a target or packet already has a rule (two rules for one op).

    >>> @register(torch.ops.aten.erfinv.default)
    ... def erfinv(ctx):
    ...     "A rule."
    >>> RULES.pop(torch.ops.aten.erfinv.default).__name__
    'erfinv'
    """
    def add(rule):
        for table, keys in ((RULES, targets), (PACKET_RULES, packets)):
            for t in keys:
                if t in table:
                    raise ValueError(f"{t} already has the rule {table[t].__name__}; "
                                     f"{rule.__name__} cannot take it too")
                table[t] = rule
        return rule
    return add


def tensor_args(ctx):
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


def scalar_choice(ctx: RuleContext) -> Choice | None:
    """For an op on a 0-dim value (a dim argument then names the value itself): every
    input summed and whole, the output whole; None when the first input has dims."""
    targs = tensor_args(ctx)
    if not targs or ctx.spec(targs[0][1]).ndim:
        return None
    v = ctx.node.meta.get("val")
    out = replicated(v.dim()) if isinstance(v, torch.Tensor) else None
    return Choice(out=out, inputs={p: replicated(ctx.spec(a).ndim) for p, a in targs})


def need_unsplit(s: ShardSpec, dims) -> ShardSpec:
    """``s`` with ``dims`` whole (an op along them: ``softmax``, ``cat``, ``pad``).

    >>> need_unsplit(ShardSpec(dims=(("tp",), ("dp",))), [0])
    [R, S(dp)]"""
    out = s
    for d in dims:
        if d < out.ndim and out.dims[d]:        # a 0-dim value's "dim 0" is the value itself
            out = out.with_dim(d, ())
    return out


def without_dim(s: ShardSpec, d: int) -> ShardSpec:
    """``s`` with dim ``d`` removed (an op that drops it: ``select``, ``max.dim``)."""
    return ShardSpec(dims=s.dims[:d] + s.dims[d + 1:], segments=s.segments[:d] + s.segments[d + 1:],
                     partial=s.partial)


def batch_rows(ctx, a, s: ShardSpec) -> ShardSpec | None:
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


def all_replicated_or_fallback(ctx: RuleContext, reason: str = "") -> Choice:
    """Unknown op: local when every input is replicated; otherwise :func:`fallback`
    (every split gathered, the batch's included: an op with no rule is not known to
    treat samples one by one)."""
    targs = tensor_args(ctx)
    specs = [ctx.spec(a) for _, a in targs]
    if all(s.is_replicated for s in specs):
        out = ctx.default_out_spec(ctx.node)
        if any(s.ndim and SymbolicSizes.is_rows(ctx.pshape(a)[0]) for s, (_, a) in zip(specs, targs)):
            # an input holds the whole batch (gathered): the op computes every row on every
            # rank (Falcon-H1's Mamba-2 einsums in 2d), not this rank's rows
            out = tuple(replicated(o.ndim) if isinstance(o, ShardSpec) else o for o in out) \
                if isinstance(out, tuple) else (replicated(out.ndim) if isinstance(out, ShardSpec) else out)
        return Choice(out=out)
    return fallback(ctx, reason or f"no rule for {ctx.node.target}")


def fallback(ctx, reason: str) -> Choice:
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
    for path, a in tensor_args(ctx):
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


def buffer_layout(ctx, buf: fx.Node) -> ShardSpec | None:
    """The layout of the ``new_empty`` buffer ``buf`` (planned, or still ahead of the walk):
    each dim of the size and position of a split dim of its source takes that split (the
    heads a rank writes), a batch-sized dim the batch axes; None where the source is not
    laid out yet, has another rank or no split, or the batch split would be taken twice."""
    x = buf.args[0]
    s = ctx.spec(x)
    shape = ctx.pshape(buf)
    if s is None or s.ndim != len(shape) or not any(s.dims):
        return None
    ins = ctx.pshape(x)
    dims = tuple(s.dims[d] if s.dims[d] and ins[d] == v else (ctx.batch_axes if ctx.batch_axes and v == ctx.BATCH
                                                              else ()) for d, v in enumerate(shape))
    segs = tuple(s.segments[d] if s.dims[d] and ins[d] == v else 1 for d, v in enumerate(shape))
    taken = [a for d in dims for a in d]
    if len(taken) != len(set(taken)):       # the batch split taken twice (x's rows split over other axes)
        return None
    return ShardSpec(dims=dims, segments=segs)


def read_split(ctx, size) -> tuple:
    """The mesh axes a symbolic size is read split over: ``sym_size(x, d)`` reads ``x``'s
    local dim ``d``, split as ``x``'s spec splits it; ``()`` for a size read from a whole
    dim or computed otherwise (a placeholder's spec may still be provisional, whole, when
    the walk reaches the reshape: the generate cache, pinned by a later layer). A product
    of such reads and literals (``bsz * num_heads``: ``nn.MultiheadAttention``'s head view)
    carries its split factor too: the axes of its factors."""
    if isinstance(size, fx.Node) and size.target in (operator.mul, operator.floordiv):
        # a floordiv by a literal keeps the factor (the local size divides as the whole one)
        factors = size.args if size.target is operator.mul else size.args[:1]
        if size.target is operator.floordiv and not isinstance(size.args[1], int):
            return ()
        axes = tuple(a for f in factors for a in read_split(ctx, f))
        return axes if len(set(axes)) == len(axes) else ()
    if not (isinstance(size, fx.Node) and size.target is aten.sym_size.int):
        return ()
    spec = ctx.spec(size.args[0])
    return spec.dims[size.args[1] % spec.ndim] if spec is not None and spec.ndim else ()


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
