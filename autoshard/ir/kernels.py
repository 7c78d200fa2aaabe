"""Kernels as typed objects: how one heavy op runs on one mesh.

A kernel object is frozen, serialisable data, in the spirit of PyTorch's
``ParallelStyle``. It declares

* the specs it needs (:attr:`Kernel.in_specs`, by argument path) and the spec of
  its output (:attr:`Kernel.out_spec`);
* the mesh axes it needs process groups for (:meth:`Kernel.groups`);
* the collectives it issues, computed from local shapes (:meth:`Kernel.comms`):
  the one source for the plan, the cost model and the ledger test;
* the arguments its runtime takes (:meth:`Kernel.call_args`): which operands of the
  op, which process groups, which options. The runtime registers one implementation
  per kernel class (:func:`autoshard.runtime.parallel_ops.bind`), which the rewrite
  calls in place of the op.

A policy returns one inside its :class:`~autoshard.policies.base.Choice`; the
rewrite binds it without knowing which it is, ``shard()`` asks it for its groups.
Nothing here imports ``torch.distributed`` or the runtime: the IR names what a
kernel needs, the runtime says how it runs.

Example:
    >>> from autoshard.ir.mesh import Mesh
    >>> from autoshard.ir.spec import ShardSpec
    >>> k = RowLinear(axes=("tp",), x=(0,), w=(1,), b=None, n_dim=0,
    ...               in_specs=(((0,), ShardSpec(dims=((), ("tp",)))),), out_spec=ShardSpec(dims=((), ())))
    >>> io = KernelIO(in_shapes={(0,): (8, 16)}, out_shape=(8, 32), mesh=Mesh(axes=("tp",), sizes=(2,)))
    >>> [(c.phase, c.kind, c.axes, c.numel) for c in k.comms(io)]
    [('fwd', 'all_reduce', ('tp',), 256)]
    >>> Kernel.from_dict(k.to_dict()) == k, k.groups()
    (True, (('tp',),))
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Callable, ClassVar, Mapping

from .mesh import Mesh
from .spec import ShardSpec

__all__ = ["KComm", "KernelIO", "Kernel", "KERNELS", "RowLinear", "Summa", "ThreeDLinear", "PartialHead",
           "VocabEmbedding", "DistLayerNorm", "SyncBatchNorm", "CrossEntropy", "Dropout", "AttentionDropout", "DROPOUT_MODES",
           "check_dropout_mode"]

Path = tuple


@dataclass(frozen=True)
class KComm:
    """A collective inside a kernel: ``numel`` elements of the full buffer.

    A backward collective with ``needs_grad_of`` happens only if one of those
    input paths needs a gradient; without it, whenever the node's output does."""

    phase: str
    kind: str
    axes: tuple[str, ...]
    numel: int
    needs_grad_of: tuple = ()


@dataclass(frozen=True)
class KernelIO:
    """Local shapes a kernel's collectives are computed from: each tensor input
    under the spec the kernel requires, and the output."""

    in_shapes: Mapping[Path, tuple]
    out_shape: tuple
    mesh: Mesh

    def numel(self, path: Path) -> int:
        return math.prod(self.in_shapes[path])

    @property
    def out_numel(self) -> int:
        return math.prod(self.out_shape)


GroupOf = Callable[[tuple], Any]      # axes -> process group name (or a shape-only group)
SizeOf = Callable[[tuple], int]       # axes -> group size


def _get(node, path):
    from .argpath import get_arg

    return get_arg(node, path)


def _enc(v):
    if isinstance(v, ShardSpec):
        return {"spec": v.to_dict()}
    if isinstance(v, (tuple, list)):
        return [_enc(x) for x in v]
    return v


def _dec(v):
    if isinstance(v, dict) and "spec" in v:
        return ShardSpec.from_dict(v["spec"])
    if isinstance(v, list):
        return tuple(_dec(x) for x in v)
    return v


@dataclass(frozen=True, kw_only=True)
class Kernel:
    """Base of every kernel object (see the module docstring)."""

    in_specs: tuple = ()              # ((arg path, ShardSpec), ...) the kernel needs
    out_spec: Any = None              # ShardSpec of its output

    name: ClassVar[str] = ""          # short label for tables
    # its collectives of one phase and kind run two at a time, in flight together
    # (parallel_ops.paired_collectives): the cost model charges the longer of each pair in
    # full and the shorter for what Cluster.pair_overlap does not hide
    paired: ClassVar[bool] = False

    def groups(self) -> tuple[tuple[str, ...], ...]:
        """Mesh axes this kernel needs a process group over, one tuple per group."""
        raise NotImplementedError

    def comms(self, io: KernelIO) -> tuple[KComm, ...]:
        """The collectives one call issues, from local shapes (one training step)."""
        return ()

    def call_args(self, node, group: GroupOf, size: SizeOf) -> tuple[tuple, dict]:
        """``(args, kwargs)`` of this kernel's runtime implementation computing
        ``node`` (an fx node or anything with its ``args`` / ``kwargs``); ``group``
        names the process group of a tuple of axes, ``size`` its size."""
        raise NotImplementedError

    @property
    def inputs(self) -> dict:
        return dict(self.in_specs)

    def to_dict(self) -> dict:
        return {"type": type(self).__name__, **{f.name: _enc(getattr(self, f.name)) for f in dataclasses.fields(self)}}

    @staticmethod
    def from_dict(d: Mapping) -> "Kernel":
        cls = KERNELS[d["type"]]
        return cls(**{k: _dec(v) for k, v in d.items() if k != "type"})

    def __str__(self) -> str:
        return self.name


@dataclass(frozen=True, kw_only=True)
class _Linear(Kernel):
    """A Linear-like kernel: where its input, weight and (optional) bias sit."""

    x: Path
    w: Path
    b: Path | None

    def operands(self, node) -> tuple:
        return _get(node, self.x), _get(node, self.w), (_get(node, self.b) if self.b else None)


@dataclass(frozen=True, kw_only=True)
class _SumsOutput(Kernel):
    """A kernel whose local results are partial sums of its output, all-reduced
    over ``axes`` in forward (backward: identity)."""

    axes: tuple[str, ...]

    def groups(self):
        return (self.axes,)

    def comms(self, io):
        return (KComm("fwd", "all_reduce", self.axes, io.out_numel),)


@dataclass(frozen=True, kw_only=True)
class RowLinear(_SumsOutput, _Linear):
    """1D row-parallel Linear: local partial product, all-reduce over ``axes``, bias.
    With ``scatter_dim`` (1d-sp) the product is reduce-scattered on that dim (the
    sequence) instead: forward reduce-scatter, backward all-gather."""

    n_dim: int
    scatter_dim: int | None = None
    name: ClassVar[str] = "row_linear"

    def comms(self, io):
        if self.scatter_dim is None:
            return super().comms(io)
        whole = io.out_numel * io.mesh.size(self.axes)
        return (KComm("fwd", "reduce_scatter", self.axes, whole), KComm("bwd", "all_gather", self.axes, whole))

    def call_args(self, node, group, size):
        return self.operands(node), {"group": group(self.axes), "n_dim": self.n_dim,
                                                         "scatter_dim": self.scatter_dim}


@dataclass(frozen=True, kw_only=True)
class Summa(_Linear):
    """SUMMA Linear on a ``row × col`` grid: all-gather X over ``col`` and W over
    ``row``; backward reduce-scatters dX over ``col`` and dW over ``row`` (with
    ``rows_whole``, X's rows not split over ``row``, dW's block is kept instead)."""

    row: tuple[str, ...]
    col: tuple[str, ...]
    n_dim: int
    k_dim: int
    offs: Path | None = None          # a grouped (per-expert) Linear: its group offsets
    impl: str = ""                    # ... and the grouped matmul it runs (autoshard.ir.grouped)
    rows_whole: bool = False          # X's rows whole over ``row`` (a static batch kept whole)
    name: ClassVar[str] = "summa"
    paired: ClassVar[bool] = True

    def groups(self):
        return (self.row, self.col)

    def comms(self, io):
        xg = io.numel(self.x) * io.mesh.size(self.col)           # gathered: N_loc·k
        wg = io.numel(self.w) * io.mesh.size(self.row)           # ... and k·n/q
        C, R, xp, wp = self.col, self.row, self.x, self.w
        return (KComm("fwd", "all_gather", C, xg), KComm("fwd", "all_gather", R, wg),
                KComm("bwd", "all_gather", R, wg, (xp,)), KComm("bwd", "all_gather", C, xg, (wp,)),
                KComm("bwd", "reduce_scatter", C, xg, (xp,))) + \
            (() if self.rows_whole else (KComm("bwd", "reduce_scatter", R, wg, (wp,)),))

    def call_args(self, node, group, size):
        kw = {"row": group(self.row), "col": group(self.col), "n_dim": self.n_dim, "k_dim": self.k_dim}
        if self.rows_whole:
            kw["rows_whole"] = True
        if self.offs is not None:
            kw.update(offs=_get(node, self.offs), impl=self.impl)
        return self.operands(node), kw


@dataclass(frozen=True, kw_only=True)
class ThreeDLinear(_Linear):
    """3D Linear (the 3D paper's schedule, docs/design.md, "3d"): gather X over
    ``b_axes`` and W over ``a``, reduce-scatter the product over ``c``; rows on ``row_dim``."""

    a: tuple[str, ...]
    b_axes: tuple[str, ...]
    c: tuple[str, ...]
    row_dim: int
    n_dim: int
    segments: int = 1
    name: ClassVar[str] = "three_d"
    paired: ClassVar[bool] = True

    def groups(self):
        return (self.a, self.b_axes, self.c)

    def comms(self, io):
        q = io.mesh.size(self.c)
        x_loc, w_loc, y_loc = io.numel(self.x), io.numel(self.w), io.out_numel
        xp, wp = self.x, self.w
        return (KComm("fwd", "all_gather", self.b_axes, x_loc * q), KComm("fwd", "all_gather", self.a, w_loc * q),
                KComm("fwd", "reduce_scatter", self.c, y_loc * q),
                KComm("bwd", "all_gather", self.c, y_loc * q, (xp, wp)),
                KComm("bwd", "reduce_scatter", self.b_axes, x_loc * q, (xp,)),
                KComm("bwd", "reduce_scatter", self.a, w_loc * q, (wp,)))

    def call_args(self, node, group, size):
        return self.operands(node), {
            "a": group(self.a), "b": group(self.b_axes), "c": group(self.c), "row_dim": self.row_dim,
            "n_dim": self.n_dim, "segments": self.segments}


@dataclass(frozen=True, kw_only=True)
class PartialHead(_Linear):
    """``x · Eᵀ`` for a table split on hidden over ``col`` (a tied head): partial
    sums reduce-scattered on the vocabulary."""

    col: tuple[str, ...]
    name: ClassVar[str] = "partial_head"

    def groups(self):
        return (self.col,)

    def comms(self, io):
        full = io.out_numel * io.mesh.size(self.col)
        return (KComm("fwd", "reduce_scatter", self.col, full),
                KComm("bwd", "all_gather", self.col, full, (self.x, self.w)))

    def call_args(self, node, group, size):
        return self.operands(node), {"col": group(self.col)}


@dataclass(frozen=True, kw_only=True)
class VocabEmbedding(_SumsOutput):
    """Lookup in this rank's vocabulary range of a table split on rows over
    ``axes``; other rows read zero; all-reduce. With ``reduce=False`` the output
    stays partial over ``axes`` (its spec says so) and the plan reduces it where a
    consumer needs it whole: lookups summed first (token + position embeddings)
    then cost one all-reduce together. With ``scatter_dim`` (1d-sp) the sum is
    reduce-scattered on that dim instead (backward: all-gather)."""

    reduce: bool = True
    scatter_dim: int | None = None      # 1d-sp: reduce-scattered on this dim (the sequence)
    name: ClassVar[str] = "vocab_embedding"

    def comms(self, io):
        if self.scatter_dim is not None:
            whole = io.out_numel * io.mesh.size(self.axes)
            return (KComm("fwd", "reduce_scatter", self.axes, whole), KComm("bwd", "all_gather", self.axes, whole))
        return super().comms(io) if self.reduce else ()

    def call_args(self, node, group, size):
        pad = node.args[2] if len(node.args) > 2 else node.kwargs.get("padding_idx", -1)
        return (node.args[0], node.args[1]), \
            {"group": group(self.axes), "padding_idx": pad if pad is not None and pad >= 0 else None,
             "reduce": self.reduce, "scatter_dim": self.scatter_dim}


@dataclass(frozen=True, kw_only=True)
class DistLayerNorm(Kernel):
    """LayerNorm over a hidden dim split over ``axes``: Σx and Σ(x-μ)² all-reduced
    both ways."""

    axes: tuple[str, ...]
    name: ClassVar[str] = "dist_layer_norm"

    def groups(self):
        return (self.axes,)

    def comms(self, io):
        shape = io.in_shapes[(0,)]
        rows = math.prod(shape) // shape[-1]
        # the statistics are of x alone: a frozen (or absent) weight and bias change nothing,
        # and with x a constant the backward all-reduces never run, whatever w and b need
        needs = ((0,),)
        return (KComm("fwd", "all_reduce", self.axes, rows), KComm("fwd", "all_reduce", self.axes, rows),
                KComm("bwd", "all_reduce", self.axes, rows, needs), KComm("bwd", "all_reduce", self.axes, rows, needs))

    def call_args(self, node, group, size):
        a = list(node.args) + [None] * 5
        return (a[0], a[1], a[2], a[3], a[4] if a[4] is not None else 1e-5), \
            {"group": group(self.axes), "count": size(self.axes)}


@dataclass(frozen=True, kw_only=True)
class SyncBatchNorm(Kernel):
    """``batch_norm`` in training with the batch rows split over ``axes`` (docs/design.md,
    "The batch contract"), as ``torch.nn.SyncBatchNorm``: each rank's per-channel mean and
    sum of squared deviations are all-gathered over ``axes`` in one call (backward: their
    gradients reduce-scattered home) and combined into the global batch's figures, the
    same on every rank; the running statistics are updated from them."""

    axes: tuple[str, ...]
    name: ClassVar[str] = "sync_batch_norm"

    def groups(self):
        return (self.axes,)

    def comms(self, io):
        shape = io.in_shapes[(0,)]
        stats = 2 * (shape[1] if len(shape) > 1 else 1) * io.mesh.size(self.axes)     # gathered: [p, 2, C]
        return (KComm("fwd", "all_gather", self.axes, stats),
                KComm("bwd", "reduce_scatter", self.axes, stats, ((0,),)))

    def call_args(self, node, group, size):
        a = list(node.args) + [None] * 9
        return (a[0], a[1], a[2], a[3], a[4]), {"momentum": a[6], "eps": a[7], "group": group(self.axes)}


@dataclass(frozen=True, kw_only=True)
class CrossEntropy(Kernel):
    """Token cross-entropy, vocab-parallel over ``vocab_axes`` when the logits are split;
    a mean (or sum) is global over a batch split over ``batch_axes``: the tokens' sum and
    their weight (count) all-reduced. ``smoothing`` (label smoothing), ``weighted`` (class
    weights, the op's third argument), ``reduction=0`` (per-token losses, split as the
    target) and ``class_dim`` (1 for spatial targets ``[N, C, ...]``) take the general
    path: one all-reduce over ``vocab_axes`` of each token's sums instead of two."""

    vocab_axes: tuple[str, ...]
    batch_axes: tuple[str, ...]
    ignore_index: int = -100
    reduction: int = 1
    smoothing: float = 0.0
    weighted: bool = False
    class_dim: int = -1
    name: ClassVar[str] = "cross_entropy"

    @property
    def general(self) -> bool:
        """Whether the general path runs (anything but a plain mean / sum over class-last logits)."""
        return bool(self.smoothing or self.weighted or self.reduction == 0 or self.class_dim != -1)

    def groups(self):
        return tuple(a for a in (self.vocab_axes, self.batch_axes) if a)

    def comms(self, io):
        n = io.numel((1,))
        if self.general:
            out = [KComm("fwd", "all_reduce", self.vocab_axes, n),
                   KComm("fwd", "all_reduce", self.vocab_axes, n * (5 if self.smoothing else 2))] \
                if self.vocab_axes else []
        else:
            out = [KComm("fwd", "all_reduce", self.vocab_axes, n)] * 3 if self.vocab_axes else []
        if self.batch_axes and self.reduction:
            out += [KComm("fwd", "all_reduce", self.batch_axes, 1)] * 2
        return tuple(out)

    def call_args(self, node, group, size):
        G = lambda axes: group(axes) if axes else None  # noqa: E731
        kw = {"vocab_group": G(self.vocab_axes), "batch_group": G(self.batch_axes),
              "ignore_index": self.ignore_index, "reduction": self.reduction}
        if not self.general:
            return (node.args[0], node.args[1]), kw
        w = (node.args[2] if len(node.args) > 2 else node.kwargs.get("weight")) if self.weighted else None
        return (node.args[0], node.args[1], w), kw | {"smoothing": self.smoothing, "class_dim": self.class_dim}


DROPOUT_MODES = ("sharded", "dense")


def check_dropout_mode(mode: str) -> str:
    """``mode`` if it is one of :data:`DROPOUT_MODES`, else a ConfigError naming them."""
    if mode not in DROPOUT_MODES:
        from .errors import ConfigError

        raise ConfigError(f"dropout={mode!r}; valid: {', '.join(repr(m) for m in DROPOUT_MODES)}")
    return mode


@dataclass(frozen=True, kw_only=True)
class Dropout(Kernel):
    """Dropout in train mode on a value laid out as its input spec, with masks that
    stay consistent across ranks (no collective).

    ``mode="sharded"``: each call takes one draw from the default generator (the
    same on every rank) and seeds a generator per block with it and the block's
    coordinates: ranks that hold the same block (replicas) draw the same mask,
    different blocks independent ones. ``mode="dense"``: the mask of the whole
    (global) tensor is drawn from the default generator, as the dense model draws
    it, and each rank keeps its block: a sharded run equals a dense run seeded alike.
    """

    p: float
    mode: str = "sharded"
    name: ClassVar[str] = "dropout"

    @property
    def layout(self) -> ShardSpec:
        return self.in_specs[0][1]

    def groups(self):
        return tuple(a for a in self.layout.dims if a)

    def _blocks(self, group):
        return tuple(group(a) if a else None for a in self.layout.dims)

    def call_args(self, node, group, size):
        return (node.args[0],), {"p": self.p, "dense": self.mode == "dense", **self._where(group)}

    def _where(self, group) -> dict:
        """The layout as plain data (fx writes call arguments as code): per dim the
        group whose rank is the block index, and the segment counts."""
        return {"blocks": self._blocks(group), "segments": self.layout.segments}


def _sdpa_operands(node) -> tuple[tuple, list, dict]:
    """``(q, k, v, mask)`` of a ``scaled_dot_product_attention`` node (the mask positional
    or ``attn_mask=``), its positional arguments padded with None to 8, and its kwargs."""
    a = list(node.args) + [None] * 8
    kw = dict(node.kwargs)
    return (a[0], a[1], a[2], a[3] if a[3] is not None else kw.get("attn_mask")), a, kw


@dataclass(frozen=True, kw_only=True)
class AttentionDropout(Dropout):
    """``scaled_dot_product_attention`` with ``dropout_p > 0`` in train mode: the
    attention probabilities ``[batch, heads, q, k]`` are computed (the math path,
    as the dense op runs on CPU) and dropped out as :class:`Dropout` does, laid out
    on batch and heads as the query."""

    name: ClassVar[str] = "attention_dropout"

    @property
    def layout(self) -> ShardSpec:
        q = self.in_specs[0][1]
        return ShardSpec(dims=(q.dims[0], q.dims[1], (), ()))

    def call_args(self, node, group, size):
        operands, a, kw = _sdpa_operands(node)
        return operands, {
            "is_causal": bool(a[5] if a[5] is not None else kw.get("is_causal", False)),
            "scale": a[6] if a[6] is not None else kw.get("scale"),
            "enable_gqa": bool(a[7] if a[7] is not None else kw.get("enable_gqa", False)),
            "p": self.p, "dense": self.mode == "dense", **self._where(group)}


@dataclass(frozen=True, kw_only=True)
class RingAttention(Kernel):
    """``scaled_dot_product_attention`` with queries, keys and values split on the
    sequence over ``axes`` (context parallelism): the key/value blocks travel around the
    ring of ``axes`` (one ``send_recv`` of both per step), each rank's queries attend
    to every block as it passes, and the partial results are merged through their
    log-sum-exp (flash attention's running max and sum). Backward sends the blocks
    around again and, one step behind each, its key/value gradient sums, which arrive
    home after the last step. A mask keeps the rows of the local queries and every key
    column; a block the mask hides entirely is skipped (with the balanced order of the
    cp group every rank skips as many under a causal mask)."""

    axes: tuple[str, ...]
    name: ClassVar[str] = "ring_attention"

    def groups(self):
        return (self.axes,)

    def comms(self, io):
        p = io.mesh.size(self.axes)
        if p <= 1:
            return ()
        kv = 2 * io.numel((1,))             # k and v, one buffer per step
        step = KComm("fwd", "send_recv", self.axes, kv)
        back = KComm("bwd", "send_recv", self.axes, kv)
        # backward: each step sends the block on (p - 1) and its dk/dv sums after it (p: the last goes home)
        return (step,) * (p - 1) + (back, back) * (p - 1) + (back,)

    def call_args(self, node, group, size):
        operands, a, kw = _sdpa_operands(node)
        return operands, {"group": group(self.axes), "scale": a[6] if a[6] is not None else kw.get("scale")}


@dataclass(frozen=True, kw_only=True)
class SequenceConv(Kernel):
    """:func:`autoshard.ir.tokens.sequence_conv` with its time dim split over ``axes``
    (context parallelism): each rank convolves its own blocks, the ``left`` rows before
    each block and the ``right`` rows after it (its halo) taken from the blocks that hold
    them. Every block's edge rows are all-gathered over ``axes`` in one call (backward:
    their gradients reduce-scattered home), ``chunks`` blocks per rank (2 in the balanced
    order)."""

    axes: tuple[str, ...]
    left: int
    right: int
    chunks: int = 1
    name: ClassVar[str] = "sequence_conv"

    @property
    def halo(self) -> int:
        """The most rows past a block's edge one output reads (a block must be at least as long)."""
        return max(self.left, self.right)

    def groups(self):
        return (self.axes,)

    def comms(self, io):
        p = io.mesh.size(self.axes)
        shape = io.in_shapes[(0,)]
        edges = math.prod(shape[:-1]) * self.chunks * (self.left + self.right) * p     # gathered
        return (KComm("fwd", "all_gather", self.axes, edges),
                KComm("bwd", "reduce_scatter", self.axes, edges, ((0,),)))

    def call_args(self, node, group, size):
        a = list(node.args) + [1, 1][len(node.args) - 5:]
        return (a[0], a[1], a[2]), {"group": group(self.axes), "left": self.left, "right": self.right,
                                    "dilation": a[5], "groups": a[6]}


KERNELS: dict[str, type[Kernel]] = {c.__name__: c for c in (
    RowLinear, Summa, ThreeDLinear, PartialHead, VocabEmbedding, DistLayerNorm, SyncBatchNorm, CrossEntropy,
    Dropout, AttentionDropout, RingAttention, SequenceConv)}


def register_kernel(cls: type[Kernel]) -> type[Kernel]:
    """Make a kernel class known to plan deserialisation (use as a class decorator
    in the module that defines a new mode's kernel)."""
    KERNELS[cls.__name__] = cls
    return cls


__all__.append("register_kernel")
