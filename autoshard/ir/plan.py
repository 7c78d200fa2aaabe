"""The sharding plan: frozen data that says, node by node, how the graph is split.

It prints (:meth:`ShardingPlan.table`), serialises (:meth:`to_json` /
:meth:`from_json`) and drives the rewrite; nothing in it runs a collective.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import asdict, dataclass, field
from typing import Any

from .kernels import Kernel
from .mesh import Mesh
from .spec import ShardSpec

__all__ = ["Step", "Comm", "SavedTensor", "NodePlan", "ParamPlan", "ShardingPlan", "GRAD_BUCKET_BYTES"]

# A ShardedModule all-reduces its gradients in buckets of about this many bytes per group
# and dtype, launched during backward (autoshard.runtime.overlap; DDP's default bucket size).
GRAD_BUCKET_BYTES = 25 << 20


@dataclass(frozen=True, kw_only=True)
class Step:
    """One re-layout of a value (inserted by the rewrite as a collective op).

    ``op`` is one of ``reduce_from``, ``copy_to``, ``all_reduce_both``, ``gather``,
    ``scatter``, ``reduce_scatter``, ``gather_partial``, ``scale``.
    """

    op: str
    axes: tuple[str, ...] = ()
    dim: int | None = None
    segments: int | tuple[int, ...] = 1     # a tuple: the relative widths of unequal fused blocks (ShardSpec.widths)
    factor: float | None = None

    def __post_init__(self) -> None:
        if isinstance(self.segments, list):         # read back from JSON
            object.__setattr__(self, "segments", tuple(self.segments))

    def effect(self, spec: "ShardSpec", global_shape, mesh: Mesh, elem_bytes: int,
               needs_grad: bool) -> tuple[list["Comm"], "ShardSpec"]:
        """The collectives this step issues on a value laid out as ``spec`` (one
        training step; backward ones only if the value ``needs_grad``), and the
        value's layout after it.

        >>> m = Mesh(axes=("tp",), sizes=(2,))
        >>> cs, after = Step(op="gather", axes=("tp",), dim=1).effect(
        ...     ShardSpec(dims=((), ("tp",))), (4, 8), m, 4, True)
        >>> [(c.phase, c.kind, c.buffer_bytes) for c in cs], after.is_replicated
        ([('fwd', 'all_gather', 128)], True)
        """
        loc = math.prod(spec.local_shape(global_shape, mesh))
        p = mesh.size(self.axes) if self.axes else 1
        out: list[Comm] = []

        def c(phase, kind, numel):
            out.append(Comm(phase=phase, kind=kind, axes=self.axes, group_size=p, buffer_bytes=numel * elem_bytes))

        s = spec
        if self.op == "reduce_from":
            c("fwd", "all_reduce", loc)
            s = s.with_partial(())
        elif self.op == "copy_to":
            if needs_grad:
                c("bwd", "all_reduce", loc)
        elif self.op == "all_reduce_both":
            c("fwd", "all_reduce", loc)
            if needs_grad:
                c("bwd", "all_reduce", loc)
        elif self.op in ("gather", "gather_partial"):     # gathers the inner axes of the dim's split
            c("fwd", "all_gather", loc * p)
            if self.op == "gather_partial" and needs_grad:     # its gradient arrives partial: reduce-scattered
                c("bwd", "reduce_scatter", loc * p)
            have = s.dims[self.dim]
            s = s.with_dim(self.dim, have[:len(have) - len(self.axes)], s.segments[self.dim])
        elif self.op == "scatter":         # splits further over inner axes
            if needs_grad:
                c("bwd", "all_gather", loc)
            w = self.segments if isinstance(self.segments, tuple) else ()
            s = s.with_dim(self.dim, s.dims[self.dim] + self.axes, len(w) or self.segments, w)
        elif self.op == "reduce_scatter":
            c("fwd", "reduce_scatter", loc)
            if needs_grad:
                c("bwd", "all_gather", loc)
            s = s.with_partial(()).with_dim(self.dim, self.axes)
        return out, s

    def __str__(self) -> str:
        s = f"{self.op}({','.join(self.axes)}"
        if self.dim is not None:
            s += f"; dim {self.dim}"
        if self.factor is not None:
            s += f"; ×{self.factor:g}"
        return s + ")"


@dataclass(frozen=True, kw_only=True)
class Comm:
    """One collective call predicted for one training step on one rank."""

    phase: str          # fwd | bwd
    kind: str           # all_reduce | all_gather | reduce_scatter | send_recv | all_to_all
    axes: tuple[str, ...]
    group_size: int
    buffer_bytes: int

    @property
    def bytes_per_rank(self) -> float:
        p = self.group_size
        if p <= 1:
            return 0.0
        # the ring model (autoshard.runtime.collectives.ring_bytes); a ring step sends its buffer once
        # an all-to-all's buffer is what it sends to the other ranks (autoshard.runtime.collectives.all_to_all_rows)
        f = 2 * (p - 1) / p if self.kind == "all_reduce" else 1.0 if self.kind in ("send_recv", "all_to_all") \
            else (p - 1) / p
        return f * self.buffer_bytes


@dataclass(frozen=True, kw_only=True)
class SavedTensor:
    """One tensor a node saves for backward on one rank (see :mod:`autoshard.planning.activations`).

    ``key`` names the storage (the node that allocated it, ``node#i`` for a
    tensor made inside the op, ``value>step`` for a re-layout's result): views share
    their base's key, so a storage saved by several nodes is counted once.
    ``nbytes`` is the whole storage; ``shape`` the saved view's. ``role`` is empty,
    or for an attention op, which operand the backend rule reads (``q``, ``k``,
    ``v``, ``mask``, ``out``): those are decided per device at estimate time.
    """

    key: str
    nbytes: int
    dtype: str
    shape: tuple = ()
    role: str = ""


@dataclass(frozen=True, kw_only=True)
class NodePlan:
    name: str
    op: str
    kind: str                     # linear | norm | attention | embedding | loss | other
    module: str
    out_spec: Any                 # ShardSpec | tuple[ShardSpec|None, ...] | None
    kernel: Kernel | None = None  # the kernel object the rewrite binds (autoshard.ir.kernels)
    arg_steps: tuple = ()         # ((arg path, (Step, ...)), ...)
    post: tuple = ()              # steps applied to the output
    patches: tuple = ()           # ((arg path, new value), ...)
    comms: tuple = ()             # (Comm, ...)
    global_shape: tuple = ()
    local_shape: tuple = ()
    weight: str = ""              # weight slice text for the table
    param_bytes: int = 0          # parameter bytes per rank (a ``state`` row: its block's bytes)
    notes: tuple = ()
    fallback: bool = False
    saved: tuple | None = None    # (SavedTensor, ...); None: not traced
    flops: int = 0                # a Linear's dense forward FLOPs, 2·rows·k·n (parallel_fraction)

    @property
    def comm_bytes(self) -> float:
        return sum(c.bytes_per_rank for c in self.comms)


@dataclass(frozen=True, kw_only=True)
class ParamPlan:
    name: str                     # HF name (state_dict key)
    global_shape: tuple
    spec: ShardSpec
    grad_sync: tuple[str, ...]    # axes its gradient is all-reduced over after backward
    dtype_bytes: int = 4
    is_buffer: bool = False
    aliases: tuple[str, ...] = ()  # other HF names of the same tensor (tied weights)
    dense_shape: tuple = ()       # the Hugging Face shape where the vocabulary or a width was padded (else empty)
    pad_segments: int = 1         # the padded dim is this many fused blocks, each padded at its end (GPT-2's c_attn)
    # > 0: each block holds this many copies of its one dense unit (a kv head held by the ranks whose query
    # heads read it), not zeros; their gradients are summed over the ranks holding them (docs/design.md, "Uneven widths")
    pad_copies: int = 0
    pad_unit: int = 0             # > 0: a width padded in units this wide (a head's features; 1), not the vocabulary
    # dims padded besides :attr:`pad_dim`, each with plain zeros at its end (a padded hidden size's in or out
    # features of a weight whose heads or vocabulary are padded too: docs/design.md, "Uneven widths")
    pad_extra: tuple[int, ...] = ()
    # False: ``requires_grad=False`` in the model at planning time, a constant for the backward
    # (no gradient, no gradient collective, no optimizer state; docs/design.md, frozen parameters)
    trainable: bool = True

    def local_shape(self, mesh: Mesh) -> tuple:
        return self.spec.local_shape(self.global_shape, mesh)

    @property
    def hf_shape(self) -> tuple:
        """The shape users, checkpoints and ``from_pretrained`` see: ``global_shape``
        without the vocabulary padding (:mod:`autoshard.passes.pad`)."""
        return tuple(self.dense_shape) or tuple(self.global_shape)

    @property
    def pad_dim(self) -> int | None:
        """The padded dim, or None."""
        if not self.dense_shape or tuple(self.dense_shape) == tuple(self.global_shape):
            return None
        return next((d for d, (a, b) in enumerate(zip(self.dense_shape, self.global_shape))
                     if a != b and d not in self.pad_extra), None)

    def pad(self, t):
        """A tensor of :attr:`hf_shape` grown with zeros to ``global_shape`` (each of the
        ``pad_segments`` blocks of the padded dim at its own end)."""
        if tuple(t.shape) == tuple(self.global_shape) or not self.dense_shape:
            return t
        import torch

        for e in self.pad_extra:        # plain zeros at the end (the hidden size)
            shape = list(t.shape)
            shape[e] = self.global_shape[e] - shape[e]
            t = torch.cat([t, t.new_zeros(shape)], dim=e)
        d = self.pad_dim
        if d is None:
            return t
        m = self.pad_segments
        parts = []
        for b in t.chunk(m, d) if m > 1 else (t,):
            if self.pad_copies:
                parts += [b] * self.pad_copies
                continue
            shape = list(b.shape)
            shape[d] = self.global_shape[d] // m - shape[d]
            parts += [b, b.new_zeros(shape)]
        return torch.cat(parts, dim=d)

    def trim(self, t):
        """A tensor of ``global_shape`` cut back to :attr:`hf_shape`."""
        if not self.dense_shape or tuple(t.shape) == tuple(self.dense_shape):
            return t
        for e in self.pad_extra:
            t = t.narrow(e, 0, self.dense_shape[e])
        d = self.pad_dim
        if d is None:
            return t.contiguous()
        m = self.pad_segments
        if m > 1:
            import torch

            return torch.cat([b.narrow(d, 0, self.dense_shape[d] // m) for b in t.chunk(m, d)], dim=d)
        return t.narrow(d, 0, self.dense_shape[d]).contiguous()

    def copy_group(self, mesh: Mesh) -> int:
        """How many consecutive ranks along the padded dim's axes hold copies of the same
        unit (their gradients are summed over them; :attr:`pad_copies`): 1 where a rank
        holds all of a unit's copies, or there are none.

            >>> from autoshard.ir.spec import ShardSpec
            >>> pp = ParamPlan(name="k", global_shape=(8, 4), spec=ShardSpec(dims=(("tp",), ())), grad_sync=(),
            ...                dense_shape=(4, 4), pad_segments=2, pad_copies=2)
            >>> pp.copy_group(Mesh(axes=("tp",), sizes=(4,)))
            2
        """
        d = self.pad_dim
        if not self.pad_copies or d is None or not self.spec.dims[d]:
            return 1
        ways = mesh.size(self.copy_axes(mesh))
        if ways % self.pad_segments or (self.pad_segments * self.pad_copies) % ways:
            from .errors import ShardingError

            raise ShardingError(f"{self.name}: {self.pad_segments} units held {self.pad_copies} times each cannot "
                                f"split {mesh.size(self.spec.dims[d])} ways over {self.spec.dims[d]} (each rank "
                                f"must hold copies of one unit, or a part of one copy)")
        return ways // self.pad_segments

    def copy_axes(self, mesh: Mesh) -> tuple[str, ...]:
        """The axes along which :meth:`copy_group`'s ranks lie: the padded dim's axes, or,
        where they split it into more blocks than it has copies (3d stores a kv projection's
        out features over ``(B, A)``, ``q²`` ways, its ``q`` copies over ``B``), the leading
        ones that split it into the copies: the trailing ones cut each copy into parts, and
        the ranks holding the same part of a unit's copies differ on the leading axes only.

            >>> from autoshard.ir.spec import ShardSpec
            >>> pp = ParamPlan(name="k", global_shape=(32, 64), spec=ShardSpec(dims=(("y", "x"), ("z",))),
            ...                grad_sync=(), dense_shape=(16, 64), pad_copies=2)
            >>> mesh = Mesh(axes=("x", "y", "z"), sizes=(2, 2, 2))
            >>> pp.copy_axes(mesh), pp.copy_group(mesh)
            (('y',), 2)
        """
        axes = self.spec.dims[self.pad_dim]
        slots = self.pad_segments * self.pad_copies
        if mesh.size(axes) > slots:
            lead = next((axes[:k] for k in range(1, len(axes)) if mesh.size(axes[:k]) == slots), None)
            axes = lead or axes
        return axes

    def __getstate__(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if k != "_local_bytes"}     # (local_bytes' memo)

    def local_bytes(self, mesh: Mesh) -> int:
        # remembered per mesh: the cost model asks it of every parameter several times per
        # estimate, and a search estimates hundreds of plans (docs/design.md, "Pricing the
        # search"); a copy made without __init__ (passes.walked.evolve) with another shape,
        # spec or dtype does not match the remembered inputs and computes its own
        memo = self.__dict__.get("_local_bytes")
        if memo is not None and memo[0] is mesh and memo[1] is self.spec and memo[2] is self.global_shape \
                and memo[3] == self.dtype_bytes:
            return memo[4]
        n = 1
        for s in self.local_shape(mesh):
            n *= s
        n *= self.dtype_bytes
        object.__setattr__(self, "_local_bytes", (mesh, self.spec, self.global_shape, self.dtype_bytes, n))
        return n


#: ``shard()`` warns when the parameter bytes per rank exceed this many times the
#: mode's ideal (:meth:`ShardingPlan.whole_report`)
WHOLE_LIMIT = 1.25


def _spec_to_json(s):
    if s is None:
        return None
    if isinstance(s, ShardSpec):
        return {"spec": s.to_dict()}
    return {"list": [_spec_to_json(x) for x in s]}


def _spec_from_json(d):
    if d is None:
        return None
    if "spec" in d:
        return ShardSpec.from_dict(d["spec"])
    return tuple(_spec_from_json(x) for x in d["list"])


@dataclass(frozen=True, kw_only=True)
class ShardingPlan:
    """Everything decided about one model on one mesh."""

    model: str
    mode: str
    mesh: Mesh
    tp_axes: tuple[str, ...]
    batch_axes: tuple[str, ...]
    batch_size: int
    seq_len: int
    nodes: tuple[NodePlan, ...]
    params: tuple[ParamPlan, ...]
    dp: int = 1
    # the order of the sequence's blocks over cp (docs/design.md, "Context parallelism"):
    # "balanced" (rank r: chunks r and 2·cp-1-r) or "contiguous"; read only with a cp axis
    cp_order: str = "balanced"
    cp_attention: str = "ring"          # "ring" | "gather": attention over the cp-split sequence
    # local shape of every graph value by node name (a tuple of shapes for a
    # multi-output node): what the activation-trace pass runs the rank's forward
    # with. Made by propagation; not serialised, not compared.
    local_shapes: Any = field(default=None, compare=False, repr=False)

    def __repr__(self) -> str:
        return (f"ShardingPlan(model={self.model}, mode={self.mode}, mesh={self.mesh}, nodes={len(self.nodes)}, "
                f"params={len(self.params)}, param_bytes_per_rank={self.param_bytes_per_rank:,})")

    # ------------------------------------------------------------- summaries
    def node(self, name: str) -> NodePlan:
        for n in self.nodes:
            if n.name == name:
                return n
        raise KeyError(name)

    def param(self, name: str) -> ParamPlan:
        for p in self.params:
            if p.name == name:
                return p
        raise KeyError(name)

    def params_by_name(self) -> dict[str, ParamPlan]:
        """Every name a planned tensor goes by (its own and its tied aliases) -> its ParamPlan."""
        return {n: p for p in self.params for n in (p.name, *p.aliases)}

    @property
    def param_bytes_per_rank(self) -> int:
        return sum(p.local_bytes(self.mesh) for p in self.params if not p.is_buffer)

    @property
    def min_seq_len(self) -> int:
        """The shortest sequence this plan's convolutions along a cp-split sequence take:
        each block of the sequence (``cp``, twice that in the balanced order) at least as
        long as the farthest row a kernel reaches past a block's edge (its ``halo``); 0
        when none."""
        reach = max((getattr(n.kernel, "halo", 0) for n in self.nodes if n.kernel is not None), default=0)
        return reach * self.cp_blocks if self.mesh.cp > 1 else 0

    @property
    def cp_blocks(self) -> int:
        """The blocks the sequence is cut into over cp: cp, twice that in the balanced order."""
        return self.mesh.cp * (2 if self.mesh.cp > 1 and self.cp_order == "balanced" else 1)

    @property
    def trainable_bytes_per_rank(self) -> int:
        """Bytes of the trainable parameters one rank holds."""
        return sum(p.local_bytes(self.mesh) for p in self.params if not p.is_buffer and p.trainable)

    @property
    def frozen_bytes_per_rank(self) -> int:
        """Bytes of the frozen parameters (``requires_grad=False``) one rank holds: no
        gradient and no optimizer state goes with them."""
        return sum(p.local_bytes(self.mesh) for p in self.params if not p.is_buffer and not p.trainable)

    @property
    def grad_bytes_per_rank(self) -> int:
        """Bytes of the gradients one rank holds after backward: one per trainable
        parameter, in its dtype."""
        return self.trainable_bytes_per_rank

    def grad_sync_comms(self) -> list[Comm]:
        """The gradient all-reduces of one step, one per parameter (as
        ``overlap_grad_sync(None)`` runs them), with the sums of kv-head copies
        (:meth:`copy_sync_comms`)."""
        out = []
        for p in self.params:
            if p.grad_sync and not p.is_buffer and p.trainable:
                out.append(Comm(phase="bwd", kind="all_reduce", axes=p.grad_sync,
                                group_size=self.mesh.size(p.grad_sync),
                                buffer_bytes=p.local_bytes(self.mesh)))
            out += self._copy_sync(p)
        return out

    def copy_sync_comms(self) -> list[Comm]:
        """The all-reduces summing the gradients of a unit held by several ranks (a kv head
        fewer than the tp ranks: docs/design.md, "Uneven widths"), one per parameter: they
        run in the parameter's own gradient hook, never bucketed."""
        return [c for p in self.params for c in self._copy_sync(p)]

    def _copy_sync(self, p: ParamPlan) -> list[Comm]:
        if p.pad_copies and p.copy_group(self.mesh) > 1 and not p.is_buffer and p.trainable:
            return [Comm(phase="bwd", kind="all_reduce", axes=p.copy_axes(self.mesh),
                         group_size=p.copy_group(self.mesh), buffer_bytes=p.local_bytes(self.mesh))]
        return []

    @property
    def state_bytes_per_rank(self) -> int:
        """Bytes of the state inputs one rank holds (a generation step's KV cache, at the
        plan's batch size; 0 for a training graph)."""
        return sum(n.param_bytes for n in self.nodes if n.kind == "state")

    def grad_sync_buckets(self, bucket_bytes: int = GRAD_BUCKET_BYTES) -> list[Comm]:
        """:meth:`grad_sync_comms` as a ShardedModule runs them by default: per group and
        dtype, the gradients in the order backward produces them (the parameters' reverse
        order) fill a bucket, all-reduced once it holds ``bucket_bytes``; the partial
        buckets at the end of backward. The same bytes, fewer calls (the count follows the
        order gradients arrive in, which the plan assumes)."""
        pending: dict = {}
        out = []
        for p in reversed([p for p in self.params if p.grad_sync and not p.is_buffer and p.trainable]):
            key = (p.grad_sync, p.dtype_bytes)
            size = pending.get(key, 0) + p.local_bytes(self.mesh)
            if size >= bucket_bytes:
                out.append(self._bucket(key[0], size))
                size = 0
            pending[key] = size
        for (axes, _), size in sorted(pending.items(), key=lambda kv: (",".join(kv[0][0]), kv[0][1])):
            if size:
                out.append(self._bucket(axes, size))
        return out

    def _bucket(self, axes: tuple[str, ...], nbytes: int) -> Comm:
        return Comm(phase="bwd", kind="all_reduce", axes=axes, group_size=self.mesh.size(axes), buffer_bytes=nbytes)

    def comms(self, phase: str | None = None) -> list[Comm]:
        cs = [c for n in self.nodes for c in n.comms] + self.grad_sync_buckets() + self.copy_sync_comms()
        return [c for c in cs if phase is None or c.phase == phase]

    def comm_bytes_per_rank(self, phase: str | None = None) -> float:
        return sum(c.bytes_per_rank for c in self.comms(phase))

    @property
    def fallbacks(self) -> list[NodePlan]:
        return [n for n in self.nodes if n.fallback]

    @property
    def tp_size(self) -> int:
        """Ranks of one tensor-parallel group (the mesh without ``dp`` and ``cp``)."""
        return self.mesh.world_size // self.dp // self.mesh.cp

    def parallel_fraction(self) -> dict:
        """How much of the model the plan really splits.

        ``params_split``: the share of parameter elements split over a tensor-parallel
        axis; ``flops_split``: the share of the Linears' dense FLOPs (2·rows·k·n each)
        run with a split weight; ``vs_ideal``: parameter bytes per rank over the ideal
        (dense bytes / :attr:`weight_ways`; 1.0 is perfect); ``replicated``: the largest
        parameters held whole; ``held_back``: the parameters whose bytes per rank exceed
        their ideal share the most (whole, or split fewer ways than the mode allows).

        >>> from autoshard.ir.mesh import Mesh
        >>> from autoshard.ir.spec import ShardSpec
        >>> p = ShardingPlan(model="m", mode="1d", mesh=Mesh(axes=("tp",), sizes=(2,)), tp_axes=("tp",),
        ...                  batch_axes=(), batch_size=1, seq_len=1, nodes=(), params=(
        ...     ParamPlan(name="w", global_shape=(4, 4), spec=ShardSpec(dims=(("tp",), ())), grad_sync=()),
        ...     ParamPlan(name="b", global_shape=(4,), spec=ShardSpec(dims=((),)), grad_sync=())))
        >>> f = p.parallel_fraction(); f["params_split"], f["vs_ideal"], f["replicated"], f["held_back"]
        (0.8, 1.2, ['b'], ['b'])
        """
        params = [p for p in self.params if not p.is_buffer]
        total = sum(math.prod(p.global_shape) for p in params) or 1
        tp = set(self.tp_axes) - {"dp"}
        split = sum(math.prod(p.global_shape) for p in params if tp & set(p.spec.axes))
        dense = sum(math.prod(p.hf_shape) * p.dtype_bytes for p in params) or 1     # padding counts as cost
        whole = sorted((p for p in params if not tp & set(p.spec.axes)), key=lambda p: -math.prod(p.global_shape))
        ways = self.weight_ways
        excess = sorted(((math.prod(p.local_shape(self.mesh)) - math.prod(p.hf_shape) / ways) * p.dtype_bytes, p.name)
                        for p in params)
        lin = [n for n in self.nodes if n.kind == "linear" and n.flops]
        flops = sum(n.flops for n in lin)
        return {"params_split": split / total, "vs_ideal": self.param_bytes_per_rank / (dense / self.weight_ways),
                "flops_split": sum(n.flops for n in lin if not n.weight.startswith("replicated")) / flops
                if flops else 0.0,
                "replicated": [p.name for p in whole[:8]],
                "held_back": [name for b, name in reversed(excess[-5:]) if b > 0]}

    def whole_report(self, limit: float = WHOLE_LIMIT, top: int = 4) -> str:
        """A sentence naming the largest parameters held whole and why, when the
        parameter bytes per rank exceed ``limit`` times the mode's ideal
        (:meth:`parallel_fraction`'s ``vs_ideal``); empty otherwise. ``shard()`` warns
        with it and ``autoshard check`` prints it.

        >>> from autoshard.ir.mesh import Mesh
        >>> from autoshard.ir.spec import ShardSpec
        >>> whole = ShardSpec(dims=((), ()))
        >>> p = ShardingPlan(model="m", mode="1d", mesh=Mesh(axes=("tp",), sizes=(2,)), tp_axes=("tp",),
        ...                  batch_axes=(), batch_size=1, seq_len=1, params=(
        ...     ParamPlan(name="q.weight", global_shape=(4, 4), spec=whole, grad_sync=()),),
        ...     nodes=(NodePlan(name="linear", op="linear", kind="linear", module="q", out_spec=whole,
        ...                     weight="replicated", notes=("whole: 4 out features do not divide tp 8",)),))
        >>> print(p.whole_report())
        parameter bytes per rank are 2.00× the 1d ideal (dense / 2): held whole: q.weight (64 B; linear: whole: 4 out features do not divide tp 8)
        """
        f = self.parallel_fraction()
        if f["vs_ideal"] <= limit:
            return ""
        tp = set(self.tp_axes) - {"dp", "dep"}
        whole = sorted((p for p in self.params if not p.is_buffer and not tp & set(p.spec.axes)),
                       key=lambda p: (-p.local_bytes(self.mesh), p.name))
        why = self._whole_reasons()
        items = [f"{p.name} ({p.local_bytes(self.mesh):,} B" + (f"; {why[p.name]}" if p.name in why else "") + ")"
                 for p in whole[:top]]
        more = f", … ({len(whole) - top} more)" if len(whole) > top else ""
        return (f"parameter bytes per rank are {f['vs_ideal']:.2f}× the {self.mode} ideal (dense / {self.weight_ways})"
                + (f": held whole: {', '.join(items)}{more}" if items else ""))

    def _whole_reasons(self) -> dict[str, str]:
        """Parameter name -> ``"node: whole: why"`` from the first plan row of the
        parameter's module (its name less the last part) with a "whole:" note."""
        rows: dict[str, str] = {}
        for n in self.nodes:
            note = next((x for x in n.notes if x.startswith("whole:")), None)
            if note is not None and n.module:
                rows.setdefault(n.module, f"{n.name}: {note}")
        out = {}
        for p in self.params:
            for name in (p.name,) + tuple(p.aliases):
                why = rows.get(name.rpartition(".")[0])
                if why:
                    out[p.name] = why
                    break
        return out

    @property
    def weight_ways(self) -> int:
        """Into how many parts the mode ideally splits a weight: the TP size, except
        2.5d, whose depth axis replicates the weights by design (docs/design.md, "2.5d"): q²."""
        return self.tp_size // (self.mesh.size(("dep",)) if "dep" in self.mesh.axes else 1)

    def padding(self) -> list[dict]:
        """Where the vocabulary was padded (:mod:`autoshard.passes.pad`): per parameter,
        its Hugging Face and padded shapes and the bytes per rank the zero rows cost."""
        out = []
        for p in self.params:
            if p.pad_dim is None:
                continue
            local = math.prod(p.local_shape(self.mesh))
            share = local / math.prod(p.global_shape)
            extra = (math.prod(p.global_shape) - math.prod(p.hf_shape)) * share * p.dtype_bytes
            row = {"param": p.name, "aliases": list(p.aliases), "dense_shape": list(p.hf_shape),
                   "padded_shape": list(p.global_shape), "extra_bytes_per_rank": int(extra)}
            if p.pad_unit:
                row.update(kind="width", unit=p.pad_unit, copies=p.pad_copies, shares=self._shares(p))
            out.append(row)
        return out

    def _shares(self, p: "ParamPlan") -> list[int]:
        """The dense units (heads, features) each distinct block of the padded ``p`` holds,
        in rank order: the uneven split the padding stands for (copies count as held; a
        block cut from several fused blocks, GPT-2's q, k, v: per fused block)."""
        d = p.pad_dim
        m = p.pad_segments
        seg_p, seg_d = p.global_shape[d] // m, p.hf_shape[d] // m
        out = []
        for r in p.spec.owners(self.mesh):
            ranges = p.spec.blocks(p.global_shape, self.mesh, r)[d]
            real = sum(1 for lo, hi in ranges for i in range(lo, hi) if p.pad_copies or i % seg_p < seg_d)
            fused = len({i // seg_p for lo, hi in ranges for i in (lo, hi - 1)})
            out.append(real // p.pad_unit // fused)
        return out

    def summary(self) -> dict:
        return {
            "model": self.model, "mode": self.mode, "mesh": str(self.mesh),
            "world_size": self.mesh.world_size, "batch_size": self.batch_size, "seq_len": self.seq_len,
            "param_bytes_per_rank": self.param_bytes_per_rank,
            "trainable_bytes_per_rank": self.trainable_bytes_per_rank,
            "frozen_bytes_per_rank": self.frozen_bytes_per_rank,
            "grad_bytes_per_rank": self.grad_bytes_per_rank,
            "comm_bytes_per_rank_fwd": self.comm_bytes_per_rank("fwd"),
            "comm_bytes_per_rank_bwd": self.comm_bytes_per_rank("bwd"),
            "collective_calls_per_step": len(self.comms()),
            **({"state_bytes_per_rank": self.state_bytes_per_rank} if self.state_bytes_per_rank else {}),
            "fallbacks": [n.name for n in self.fallbacks],
            "parallel_fraction": self.parallel_fraction(),
            "padding": self.padding(),
        }

    def fingerprint(self) -> str:
        """Stable hash of the decisions (mesh, mode, parameter slices)."""
        blob = json.dumps({"mode": self.mode, "mesh": self.mesh.to_dict(),
                           "params": [(p.name, list(p.global_shape), p.spec.to_dict()) for p in self.params]},
                          sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:16]

    # --------------------------------------------------------------- printing
    def table(self, *, all_nodes: bool = False, all_layers: bool = False):
        """A ``rich.table.Table`` with one row per annotated node, fallback or kernel (all
        nodes with ``all_nodes=True``); each run of layers the same as a layer shown above
        is one row (every layer with ``all_layers=True``; :mod:`autoshard.ir.plan_table`).

            >>> from autoshard.ir.mesh import Mesh
            >>> fc = [NodePlan(name=f"linear_{i}", op="linear", kind="linear", module=f"m.layers.{i}.fc",
            ...                out_spec=None) for i in range(3)]
            >>> p = ShardingPlan(model="toy", mode="1d", mesh=Mesh(axes=("tp",), sizes=(2,)), tp_axes=("tp",),
            ...                  batch_axes=(), batch_size=1, seq_len=1, nodes=tuple(fc), params=())
            >>> p.table().row_count, p.table(all_layers=True).row_count   # layer 0 + "same as" row; all 3
            (2, 3)
        """
        from .plan_table import table

        return table(self, all_nodes=all_nodes, all_layers=all_layers)

    def show(self, console=None, *, all_nodes: bool = False, all_layers: bool = False,
             node_size: int | None = None) -> None:
        """Print the table (``all_nodes``, ``all_layers``: as :meth:`table`) and a summary.
        ``node_size``: ranks per node (default: torchrun's ``LOCAL_WORLD_SIZE`` when this
        plan's world is the job's) adds which axes' groups stay inside a node and which cross nodes."""
        import os

        from rich.console import Console

        console = console or Console(width=220)
        console.print(self.table(all_nodes=all_nodes, all_layers=all_layers))
        s = self.summary()
        console.print(
            f"[bold]per rank:[/bold] parameters {s['param_bytes_per_rank']:,} B"
            + (f" ({s['trainable_bytes_per_rank']:,} B trainable, {s['frozen_bytes_per_rank']:,} B frozen)"
               if s["frozen_bytes_per_rank"] else "")
            + f" · gradients {s['grad_bytes_per_rank']:,} B · "
            f"comm/step fwd {s['comm_bytes_per_rank_fwd']:,.0f} B, bwd {s['comm_bytes_per_rank_bwd']:,.0f} B · "
            f"{s['collective_calls_per_step']} collective calls/step · "
            f"fallbacks: {len(s['fallbacks'])}{' (' + ', '.join(s['fallbacks']) + ')' if s['fallbacks'] else ''}")
        f = s["parallel_fraction"]
        console.print(f"[bold]split:[/bold] {f['params_split']:.0%} of parameters split over TP · parameter bytes per "
                      f"rank {f['vs_ideal']:.2f}× the ideal (dense / {self.tp_size})"
                      + (f" · largest held whole: {', '.join(f['replicated'][:4])}" if f["vs_ideal"] > 1.15 else ""))
        if s.get("state_bytes_per_rank"):
            n = sum(1 for x in self.nodes if x.kind == "state")
            console.print(f"[bold]KV cache:[/bold] {s['state_bytes_per_rank']:,} B per rank in {n} state inputs at "
                          f"batch {self.batch_size} (each rank holds its block; a generation step's comm/step is "
                          f"per token)")
        widths: dict[tuple, list[str]] = {}
        for pad in s["padding"]:
            d, g = pad["dense_shape"], pad["padded_shape"]
            if pad.get("kind") == "width":      # one line per kind of weight (every layer alike)
                key = (pad["param"].split(".")[-2:][0], tuple(d), tuple(g), tuple(pad["shares"]), pad["unit"],
                       pad["copies"], pad["extra_bytes_per_rank"])
                widths.setdefault(key, []).append(pad["param"])
                continue
            console.print(f"[bold]padded:[/bold] {pad['param']} {list(d)} → {list(g)} so the vocabulary splits "
                          f"({pad['extra_bytes_per_rank']:,} B of zero rows per rank; the padded logits are masked "
                          f"out of the loss and trimmed from the outputs; checkpoints keep {list(d)})")
        for (_, d, g, shares, unit, copies, extra), names in widths.items():
            what = "heads" if unit > 1 else "features"
            how = (f"each kv head held by the {copies} ranks whose query heads read it, its gradient summed over "
                   f"them" if copies else f"{extra:,} B of zero units per rank")
            console.print(f"[bold]uneven:[/bold] {names[0]}" + (f" (×{len(names)})" if len(names) > 1 else "")
                          + f" {list(d)} → {list(g)}: {what} per rank {', '.join(map(str, shares))} ({how}; "
                          f"the largest share sets each rank's memory and time; checkpoints keep {list(d)})")
        if node_size is None and os.environ.get("WORLD_SIZE") == str(self.mesh.world_size):
            node_size = int(os.environ.get("LOCAL_WORLD_SIZE", "0") or 0) or None
        where = self.mesh.placement(node_size)
        if where:
            console.print(f"[bold]nodes:[/bold] {where}")

    def draw(self, path) -> str:
        """Write an SVG picture of the plan to ``path``: for the stem/head and the first
        repeated block, each weight's blocks coloured by the rank that holds them, the
        mesh, and one Linear's collectives (see :mod:`autoshard.ir.draw`). Returns ``path``.

            >>> plan.draw("plan.svg")       # doctest: +SKIP
            'plan.svg'
        """
        from .draw import draw      # the drawing code is loaded only by those who draw

        return draw(self, path)

    # ------------------------------------------------------------ serialising
    def to_json(self) -> str:
        def node_d(n: NodePlan):
            d = asdict(n)
            d["kernel"] = n.kernel.to_dict() if n.kernel is not None else None
            d["out_spec"] = _spec_to_json(n.out_spec)
            d["arg_steps"] = [[list(p), [asdict(s) for s in steps]] for p, steps in n.arg_steps]
            d["post"] = [asdict(s) for s in n.post]
            d["patches"] = [[list(p), v] for p, v in n.patches]
            d["saved"] = None if n.saved is None else [[s.key, s.nbytes, s.dtype, list(s.shape), s.role]
                                                       for s in n.saved]
            return d

        return json.dumps({
            "model": self.model, "mode": self.mode, "mesh": self.mesh.to_dict(),
            "tp_axes": list(self.tp_axes), "batch_axes": list(self.batch_axes),
            "batch_size": self.batch_size, "seq_len": self.seq_len, "dp": self.dp,
            "cp_order": self.cp_order, "cp_attention": self.cp_attention, "nodes": [node_d(n) for n in self.nodes],
            "params": [{"name": p.name, "global_shape": list(p.global_shape), "spec": p.spec.to_dict(),
                        "grad_sync": list(p.grad_sync), "dtype_bytes": p.dtype_bytes, "is_buffer": p.is_buffer,
                        "aliases": list(p.aliases), "dense_shape": list(p.dense_shape), "trainable": p.trainable,
                        **({"pad_segments": p.pad_segments} if p.pad_segments != 1 else {}),
                        **({"pad_copies": p.pad_copies} if p.pad_copies else {}),
                        **({"pad_unit": p.pad_unit} if p.pad_unit else {}),
                        **({"pad_extra": list(p.pad_extra)} if p.pad_extra else {})}
                       for p in self.params],
        })

    @classmethod
    def from_json(cls, text: str) -> "ShardingPlan":
        d = json.loads(text)

        def tup(x):
            return tuple(tup(i) for i in x) if isinstance(x, list) else x

        nodes = []
        for n in d["nodes"]:
            nodes.append(NodePlan(
                name=n["name"], op=n["op"], kind=n["kind"], module=n["module"],
                out_spec=_spec_from_json(n["out_spec"]), kernel=Kernel.from_dict(n["kernel"]) if n["kernel"] else None,
                arg_steps=tuple((tup(p), tuple(Step(**{**s, "axes": tuple(s["axes"])}) for s in steps))
                                for p, steps in n["arg_steps"]),
                post=tuple(Step(**{**s, "axes": tuple(s["axes"])}) for s in n["post"]),
                patches=tuple((tup(p), v) for p, v in n["patches"]),
                comms=tuple(Comm(**{**c, "axes": tuple(c["axes"])}) for c in n["comms"]),
                global_shape=tup(n["global_shape"]), local_shape=tup(n["local_shape"]),
                weight=n["weight"], param_bytes=n["param_bytes"], notes=tuple(n["notes"]),
                fallback=n["fallback"], flops=n.get("flops", 0),
                saved=None if n.get("saved") is None else tuple(
                    SavedTensor(key=k, nbytes=b, dtype=t, shape=tuple(sh), role=r) for k, b, t, sh, r in n["saved"])))
        params = tuple(ParamPlan(name=p["name"], global_shape=tuple(p["global_shape"]),
                                 spec=ShardSpec.from_dict(p["spec"]), grad_sync=tuple(p["grad_sync"]),
                                 dtype_bytes=p["dtype_bytes"], is_buffer=p["is_buffer"],
                                 aliases=tuple(p.get("aliases", ())), dense_shape=tuple(p.get("dense_shape", ())),
                                 trainable=p.get("trainable", True), pad_segments=p.get("pad_segments", 1),
                                 pad_copies=p.get("pad_copies", 0), pad_unit=p.get("pad_unit", 0),
                                 pad_extra=tuple(p.get("pad_extra", ())))
                       for p in d["params"])
        return cls(model=d["model"], mode=d["mode"], mesh=Mesh.from_dict(d["mesh"]), tp_axes=tuple(d["tp_axes"]),
                   batch_axes=tuple(d["batch_axes"]), batch_size=d["batch_size"], seq_len=d["seq_len"],
                   nodes=tuple(nodes), params=params, dp=d.get("dp", 1),
                   cp_order=d.get("cp_order", "balanced"), cp_attention=d.get("cp_attention", "ring"))

