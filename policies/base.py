"""The policy ↔ pass contract: what a rule sees, what it returns, what a mode implements.

A rule looks at one node through a :class:`RuleContext` (given by the propagate
pass; rules use nothing else of it) and returns an immutable :class:`Choice`: the
spec each tensor input must have (the pass inserts the re-layout), the spec of the
output, and for heavy ops the :class:`~autoshard.ir.kernels.Kernel` object to run. A
rule that cannot take an input's split raises :class:`NeedReplicate`; any other
exception is re-raised by the pass with the node, its module path and its input
specs. Policies import no pass and nothing that touches ``torch.distributed``
(docs/design.md, "Layers").

A mode is one module in this package defining a :class:`Policy` subclass with a
``name``; :data:`autoshard.policies.POLICIES` finds it. Besides its rules
(:meth:`Policy.linear`, :meth:`Policy.embedding`) it answers the questions the
face asks about it: its mesh for a world size (:meth:`Policy.make_mesh`), how far
it splits each model dimension (:meth:`Policy.dim_splits`), which world sizes
divide a dimension (:meth:`Policy.valid_world_sizes`) and how a mesh is labelled
(:meth:`Policy.label`).

Example: every mode answers the same questions about its mesh.

>>> from autoshard.policies import make_policy
>>> p = make_policy("2d", 4)
>>> p.mesh, p.label(p.mesh), p.grid(p.mesh)
(Mesh(axes=('row', 'col'), sizes=(2, 2)), '2d [2,2]', (2, 1))
>>> p.batch_split()
(2, '2d splits the batch over row[2]')
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Mapping, Protocol

from autoshard.ir.errors import ConfigError
from autoshard.ir.kernels import KComm, Kernel
from autoshard.ir.mesh import Mesh
from autoshard.ir.plan import Step
from autoshard.ir.spec import ShardSpec

__all__ = ["Choice", "KComm", "Policy", "NeedReplicate", "RuleContext", "SymbolicSizes", "spec_of"]


class SymbolicSizes:
    """How propagation writes symbolic sizes as integers: each free symbol (batch,
    sequence, others) is a distinct prime far above any literal dimension, so a
    product matches only when it truly matches and a size is symbolic exactly when
    one of these primes divides it.

    >>> SymbolicSizes.is_symbolic(128256), SymbolicSizes.is_symbolic(3 * SymbolicSizes.BATCH)
    (False, True)
    >>> SymbolicSizes.text((SymbolicSizes.BATCH, 2 * SymbolicSizes.SEQ, 64))
    '(b, 2·s, 64)'
    """

    BATCH = 1_000_000_007
    SEQ = 1_000_000_009
    _FIRST_OTHER = 1_000_000_021

    @classmethod
    def others(cls):
        """Primes for further free symbols, as many as needed."""
        p = cls._FIRST_OTHER
        while True:
            if all(p % d for d in range(3, int(p ** 0.5) + 1, 2)):
                yield p
            p += 2

    @classmethod
    def is_symbolic(cls, size: int) -> bool:
        """Whether a probe size stands for a symbol (it is one of the primes, or a multiple of one)."""
        return size >= cls.BATCH

    @classmethod
    def is_rows(cls, size: int) -> bool:
        """A leading dim of batch·k rows (the batch, or batch and heads merged)."""
        return size % cls.BATCH == 0 and size >= cls.BATCH

    @classmethod
    def text(cls, shape) -> str:
        """A probe shape as people read it: symbolic sizes as multiples of ``b`` / ``s``."""
        out = []
        for v in shape:
            if not cls.is_symbolic(v):
                out.append(str(v))
                continue
            for sym, prime in (("b", cls.BATCH), ("s", cls.SEQ)):
                if v % prime == 0:
                    k = v // prime
                    out.append(sym if k == 1 else f"{k}·{sym}")
                    break
            else:
                out.append("?")
        return "(" + ", ".join(out) + ")"


class RuleContext(Protocol):
    """What a rule may see of the graph while the propagate pass visits ``node``.

    Shapes come in two forms: *probe* shapes (:meth:`pshape`; symbolic sizes as the
    primes of :class:`SymbolicSizes`, for matching dims) and *local* numbers for
    the plan's batch size and sequence length (:meth:`local_numel`, :meth:`local_size`)."""

    node: Any                       # the fx node being planned
    mesh: Mesh
    batch_axes: tuple[str, ...]     # axes the batch rows are split over (dp first)
    training: bool
    dropout: str                    # "sharded" | "dense": how Dropout kernels draw their masks
    cp_attention: str               # "ring" | "gather": attention over a cp-split sequence
    cp_order: str                   # "balanced" | "contiguous": the order of the sequence's cp blocks
    BATCH: int                      # the batch symbol's probe prime

    def is_tensor(self, a) -> bool:
        """Whether ``a`` is a graph value holding a tensor (not a size, a scalar or a list)."""
    def spec(self, a) -> Any:
        """The :class:`~autoshard.ir.spec.ShardSpec` of ``a`` (a tuple of them for a
        multi-output op, ``None`` for a non-tensor)."""
    def is_free_param(self, a) -> bool:
        """Whether ``a`` is a parameter that no earlier use has laid out yet (a rule may choose its split)."""
    def fixed_param_spec(self, a) -> ShardSpec | None:
        """The split an earlier use gave parameter ``a`` (a tied weight), or ``None`` when it is free."""
    def is_free_state(self, a) -> bool:
        """Whether ``a`` is a state input (a KV cache: written before it is read) not laid out yet."""
    def pshape(self, a) -> tuple[int, ...]:
        """The probe shape of ``a``: symbolic sizes as the primes of :class:`SymbolicSizes`."""
    def pshape_of_val(self, v) -> tuple[int, ...]:
        """The probe shape of a fake tensor ``v`` (an element of a multi-output node's ``meta['val']``)."""
    def local_numel(self, a, spec: ShardSpec) -> int:
        """Elements one rank holds of ``a`` laid out as ``spec``, at the plan's batch size and sequence length."""
    def local_size(self, a, spec: ShardSpec, d: int) -> int:
        """The local size of dim ``d`` of ``a`` laid out as ``spec``, at the plan's batch size and sequence length."""
    def is_batch_index(self, a) -> bool:
        """Whether ``a`` is an ``arange`` over the (split) batch rows, whose local values are not the dense ones."""
    def row_fact(self, a, i: int | None = None) -> Any:
        """What is known of the order of ``a``'s rows on this rank
        (:mod:`autoshard.passes.row_order`); ``i`` picks an output."""
    def forced_replicate(self, node) -> bool:
        """Whether a re-plan asked the Linear ``node`` to stay whole (its output split could not pass a later op)."""
    def forced_reason(self, node) -> str:
        """The op, node and reason that refused ``node``'s split in a re-plan (for the plan row's note)."""
    def default_out_spec(self, node) -> Any:
        """The spec of ``node``'s output when nothing splits it: replicated, with the batch rows kept split."""
    def output_segments(self, node) -> int:
        """How many fused blocks a later ``split`` / ``chunk`` cuts ``node``'s output in (3 for a fused QKV)."""
    def output_block_widths(self, node) -> tuple[int, ...]:
        """The widths of the unequal fused blocks slices cut ``node``'s output into (Phi-3's q, k, v), or ``()``."""
    def output_feeds_parallel_consumer(self, node) -> bool:
        """Whether ``node``'s output reaches another Linear, the loss or the graph
        output through ops that keep a feature split."""
    def split_stop(self, node, unequal: bool = False) -> str:
        """The first op that stops a feature split of ``node``'s output on its way to a
        consumer (op, node and reason), or ``''`` when none does; ``unequal``: fused blocks
        of unequal widths split per block and do not stop it."""
    def is_largest_embedding(self, w) -> bool:
        """Whether ``w`` is the largest embedding table of the graph (the vocabulary)."""


@dataclass(frozen=True)
class Choice:
    """A rule's decision for one node (immutable; derive variants with :meth:`replace`)."""

    out: Any                                              # ShardSpec | tuple | None
    inputs: Mapping = field(default_factory=dict)         # arg path -> required ShardSpec
    kernel: Kernel | None = None
    post: tuple[Step, ...] = ()
    patches: Mapping = field(default_factory=dict)        # arg path -> new literal
    grad_complete: frozenset = frozenset()                # input paths whose grads the kernel completes
    param_sync: Mapping = field(default_factory=dict)     # arg path -> axes (explicit; overrides generic rule)
    notes: tuple[str, ...] = ()
    fallback: bool = False
    weight: str = ""

    @classmethod
    def run(cls, kernel: Kernel, **rest) -> "Choice":
        """Run ``kernel``: its declared input and output specs are the choice's."""
        return cls(out=kernel.out_spec, inputs=kernel.inputs, kernel=kernel, **rest)

    def replace(self, **changes) -> "Choice":
        """A copy of this choice with ``changes`` applied (a :func:`dataclasses.replace`)."""
        return dataclasses.replace(self, **changes)


class NeedReplicate(Exception):
    """Raised by a rule when an input split cannot pass; carries the input path and dim."""

    def __init__(self, path, dim: int, reason: str):
        super().__init__(reason)
        self.path, self.dim, self.reason = path, dim, reason


class Policy:
    """Interface of a mode. Subclasses set ``name`` and implement ``make_mesh``,
    ``linear``, ``embedding``, ``dim_splits`` and ``valid_world_sizes``; norms,
    attention and the loss follow the specs (:mod:`autoshard.policies.ops`).

    ``order`` places the mode in the registry (the auto search breaks ties by it)."""

    name: str = ""
    order: int = 100
    tp_axes: tuple[str, ...] = ()
    batch_axes: tuple[str, ...] = ()
    #: how :meth:`valid_world_sizes` counts, for messages ("tp sizes", "world sizes q²")
    size_unit: str = "world sizes"
    #: whether a ``cp`` axis may join the mesh (context parallelism), and why not
    composes_with_cp: bool = True
    composes_with_cp_why: str = ""
    #: attention over a cp-split sequence: "ring" (key/value blocks sent around the ring)
    #: or "gather" (keys and values all-gathered); :func:`autoshard.policies.make_policy` sets it
    cp_attention: str = "ring"
    #: the sequence's blocks over cp: "balanced" (rank r holds chunks r and 2·cp-1-r of
    #: 2·cp: the same causal work on every rank) or "contiguous" (rank r: block r)
    cp_order: str = "balanced"
    #: expert parallelism's size (docs/design.md, "Expert parallelism"): the experts spread
    #: over the dp (× cp) ranks, planned after the mode's own rules; ``shard(ep=...)`` sets it
    ep: int = 1

    def __init__(self, mesh: Mesh):
        self.mesh = mesh

    # ------------------------------------------------------------ the mesh
    @classmethod
    def make_mesh(cls, world_size: int, *, depth: int | None = None, dp: int = 1) -> Mesh:
        """The mode's mesh for ``world_size`` ranks, ``dp`` of them data-parallel replicas
        (the ``dp`` axis outermost).

        Raises:
            ConfigError: the world size, ``depth`` or ``dp`` does not fit the mode; the
                message lists the valid choices.
        """
        raise NotImplementedError

    @staticmethod
    def _check_dp(world_size: int, dp: int) -> int:
        if dp < 1 or world_size % dp:
            raise ConfigError(f"dp={dp} must divide the world size {world_size}; "
                              f"valid dp: {[d for d in range(1, world_size + 1) if world_size % d == 0]}")
        return world_size // dp

    @property
    def dp(self) -> int:
        """Data-parallel replicas of this mesh (1 without a ``dp`` axis)."""
        return self.mesh.dp

    @property
    def cp(self) -> int:
        """Context-parallel ranks of this mesh: the sequence is split ``cp`` ways (1 without a ``cp`` axis)."""
        return self.mesh.cp

    def batch_split(self) -> tuple[int, str]:
        """How many blocks one dp replica's batch is cut into, and a label naming the axes."""
        axes = tuple(a for a in self.batch_axes if a != "dp")
        if not axes:
            return 1, ""
        return self.mesh.size(axes), f"{self.name} splits the batch over " + "·".join(
            f"{a}[{self.mesh.size(a)}]" for a in axes)

    @classmethod
    def grid(cls, mesh: Mesh) -> tuple[int, int]:
        """``(q, d)``: the side of the tensor-parallel grid (the TP size for a 1-axis
        mode) and its depth (1 unless the mode has a ``dep`` axis)."""
        d = mesh.size("dep") if "dep" in mesh.axes else 1
        sizes = [s for a, s in zip(mesh.axes, mesh.sizes) if a not in ("dp", "dep", "cp")]
        return (max(sizes) if sizes else 1), d

    @classmethod
    def label(cls, mesh: Mesh) -> str:
        """``'2.5d [2,2,2] × dp2'``: the mode and its TP grid, then the dp replicas."""
        sizes = [s for a, s in zip(mesh.axes, mesh.sizes) if a not in ("dp", "cp")]
        dp, cp = mesh.dp, mesh.cp
        return f"{cls.name} [{','.join(map(str, sizes))}]" + (f" × cp{cp}" if cp > 1 else "") + \
            (f" × dp{dp}" if dp > 1 else "")

    # ---------------------------------------------------- what it splits
    def dim_splits(self) -> tuple[dict[str, int], str]:
        """How many shards each model dimension (``num_attention_heads``,
        ``num_key_value_heads``, ``hidden_size``, ``intermediate_size``,
        ``vocab_size``) is cut into on this mesh, and a label (``"q=2"``)."""
        raise NotImplementedError

    def seq_split(self) -> int:
        """How many blocks the sequence is cut into (context parallelism: ``cp``, twice
        that in the balanced order; 1d-sp: also the TP size); a call's sequence length must
        be a multiple of it."""
        return self.cp * (2 if self.cp > 1 and self.cp_order == "balanced" else 1)

    def seq_split_why(self) -> str:
        """What cuts the sequence into :meth:`seq_split` blocks, for a refusal's message."""
        if self.cp <= 1:
            return ""
        if self.cp_order == "balanced":
            return (f"cp={self.cp} in the balanced order cuts it into 2·cp={2 * self.cp} chunks; "
                    f"cp_order='contiguous' needs a multiple of {self.cp} only")
        return f"cp={self.cp} cuts it into {self.cp} blocks"

    def vocab_multiple(self) -> int:
        """What the vocabulary is padded to a multiple of (:mod:`autoshard.passes.pad`)."""
        return self.dim_splits()[0].get("vocab_size", 1)

    def width_multiple(self) -> int:
        """What heads and Linear widths the split does not divide are padded to a
        multiple of (:func:`autoshard.passes.pad.pad_widths`); 1: none are (the mode
        holds such weights whole)."""
        return 1

    def width_storage(self) -> int:
        """How many ways a Linear's out features are split where the split of its weight
        goes further than its output's (3d: ``q²``, the output ``q``); padded widths
        divide it too (:func:`autoshard.passes.pad.pad_widths`, ``storage``)."""
        return self.width_multiple()

    def width_copies(self) -> bool:
        """Whether kv heads fewer than the split are held as copies by the ranks reading them
        (:func:`autoshard.passes.pad.pad_widths`, ``copies``); else they are left as they are."""
        return True

    @classmethod
    def valid_world_sizes(cls, n: int, limit: int = 4096) -> list[int]:
        """TP world sizes (dp = 1) of this mode whose split divides ``n``."""
        raise NotImplementedError

    # ------------------------------------------------------------ rules
    def linear(self, ctx: RuleContext) -> Choice:
        """The rule for a Linear-like node (``aten.linear`` / ``addmm`` / ``mm`` with a
        parameter operand, or a grouped per-expert Linear): the layout of its input,
        weight and bias, and the kernel that runs it."""
        raise NotImplementedError

    def embedding(self, ctx: RuleContext) -> Choice:
        """The rule for an ``aten.embedding`` lookup: how its table is split and the
        layout of the looked-up rows."""
        raise NotImplementedError


def spec_of(ndim: int, **dims) -> ShardSpec:
    """A spec of ``ndim`` dims, split where a keyword ``d<i>=axes`` says (others whole).

    >>> spec_of(3, d0=("row",), d2=("col",))
    [S(row), R, S(col)]
    """
    d = [()] * ndim
    for k, v in dims.items():
        d[int(k[1:])] = v
    return ShardSpec(dims=tuple(d))
