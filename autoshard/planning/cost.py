"""Cost model: per-rank FLOPs, memory and alpha-beta communication time of a plan.

Everything here reads a :class:`~autoshard.ir.plan.ShardingPlan` (pure data) and a
:class:`Cluster`; nothing runs a collective. A measured :class:`Cluster` comes from
:func:`autoshard.planning.profile.profile`, which times a few on the current process group.

Model (one training step on one rank, no overlap of compute and communication)::

    step = 3·F_fwd / flops                          # backward ≈ 2 × forward
         + Σ_collectives  steps·α_link + load·B / β_link

* ``F_fwd``: Linear ``2·N·k·n / w`` where ``w`` is the number of ranks that share
  the work (mesh axes splitting the output, the weight, or holding a partial
  sum), attention ``4·b·h·s²·d`` on the local ``[b, h, s, d]`` block.
* ``B``: bytes one rank sends (ring model, docs/design.md, "Communication and memory"); ``steps``: ``2(p−1)`` for
  an all-reduce, ``p−1`` for an all-gather / reduce-scatter.
* link class: a group whose ranks all sit in one node (``rank // ranks_per_node``
  with the mesh's rank = coordinate formula, outermost axis first) runs at
  ``intra_bw`` / ``intra_latency``; otherwise its ring crosses node boundaries
  and each node's network (``inter_bw``, the node's links together) carries every
  crossing edge of every group running at the same time, so ``load`` is the
  busiest node's number of outgoing crossing edges.
* memory per rank: parameters + gradients (the trainable parameters' size) + optimizer
  state (AdamW: two fp32 moments per trainable parameter; frozen ones have neither) + activations: the bytes autograd
  saves for backward in one forward, traced on meta when the plan is made
  (:mod:`autoshard.planning.activations`; fused attention per the cluster's ``device``).

Example:
    >>> c = Cluster.preset("dgx-a100")
    >>> c.ranks_per_node, c.memory_bytes // 2**30
    (8, 80)
    >>> link_of(Mesh(axes=("dep", "row", "col"), sizes=(4, 4, 4)), ("col",), 4)
    ('intra', 0)
    >>> link_of(Mesh(axes=("dep", "row", "col"), sizes=(4, 4, 4)), ("row",), 4)
    ('inter', 4)
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass, field

from .activations import saved_bytes
from ..ir.errors import ConfigError
from ..ir.kernels import PartialHead, RingAttention, RowLinear, Summa, ThreeDLinear
from ..ir.mesh import Mesh
from ..ir.plan import Comm, NodePlan, ShardingPlan
from ..ir.spec import ShardSpec

__all__ = ["Cluster", "CLUSTERS", "CostEstimate", "CommTime", "estimate", "forward_latency", "link_of", "collective_time",
           "node_flops", "default_cluster", "human_bytes"]

GiB = 2 ** 30


def human_bytes(n: float) -> str:
    """``1536 -> '1.50 KiB'``.

    >>> human_bytes(1536), human_bytes(80 * 2**30)
    ('1.50 KiB', '80.00 GiB')
    """
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024:
            return f"{n:,.0f} {unit}" if unit == "B" else f"{n:,.2f} {unit}"
        n /= 1024
    return f"{n:,.2f} TiB"


@dataclass(frozen=True, kw_only=True)
class Cluster:
    """Hardware figures the cost model needs (SI units: bytes, seconds, FLOP/s).

    Attributes:
        ranks_per_node: ranks that share a node (NVLink / shared memory).
        intra_bw: bytes/s one rank sends to a peer in its node.
        intra_latency: seconds per ring step inside a node.
        inter_bw: bytes/s of one node's network links together (shared by the
            ranks of that node that send across nodes at the same time).
        inter_latency: seconds per ring step across nodes.
        flops: sustained matmul FLOP/s of one rank.
        memory_bytes: memory of one rank (GPU memory, or host memory / ranks).
        name: preset name or ``"custom"`` / ``"measured"``.
        device: ``"cuda"`` or ``"cpu"``: which fused attention kernel the
            activation prediction assumes (:func:`autoshard.planning.activations.attention_saved`).
        call_overhead: seconds every collective call costs on top of its ring steps
            (the Python op, the launch, the backend's handshake).
        op_overhead: seconds one graph node costs per step (forward and backward
            dispatch of one small op), whatever it computes.
        flops_curve: ``((edge, FLOP/s), ...)``: the matmul rate by size (the cube
            root of ``m·k·n``), measured by :func:`~autoshard.planning.profile.profile`; a
            Linear is timed at the rate of its own size (interpolated), ``flops`` where the
            curve is empty.
        pair_overlap: the share (0-1) of the shorter of two collectives sent together
            (a SUMMA / 3D Linear's two operand gathers, ``Kernel.paired``) hidden behind
            the longer: 1 where they travel on links of their own (NCCL streams), about
            0 where both eat the same CPU cores (gloo on an oversubscribed host).
        compute_overlap: the share (0-1) of a collective launched asynchronously that
            hides behind compute running meanwhile (asynchronous TP's row chunks,
            :func:`estimate` ``async_tp=``): 1 with NCCL's own streams; on gloo the
            communication thread shares the cores (``benchmarks/bench_async_tp.py``).
    """

    ranks_per_node: int
    intra_bw: float
    intra_latency: float
    inter_bw: float
    inter_latency: float
    flops: float
    memory_bytes: int
    name: str = "custom"
    device: str = "cuda"
    call_overhead: float = 0.0
    op_overhead: float = 0.0
    flops_curve: tuple = ()
    pair_overlap: float = 1.0
    compute_overlap: float = 1.0

    def __post_init__(self) -> None:
        for f in ("ranks_per_node", "intra_bw", "inter_bw", "flops", "memory_bytes"):
            if not getattr(self, f) > 0:
                raise ConfigError(f"Cluster.{f} must be > 0, got {getattr(self, f)!r}")
        for f in ("intra_latency", "inter_latency", "call_overhead", "op_overhead"):
            if getattr(self, f) < 0:
                raise ConfigError(f"Cluster.{f} must be >= 0, got {getattr(self, f)!r}")
        for f in ("pair_overlap", "compute_overlap"):
            if not 0.0 <= getattr(self, f) <= 1.0:
                raise ConfigError(f"Cluster.{f} must be within 0-1, got {getattr(self, f)!r}")
        if self.device not in ("cuda", "cpu"):
            raise ConfigError(f"Cluster.device must be 'cuda' or 'cpu', got {self.device!r}")

    @classmethod
    def preset(cls, name: str) -> "Cluster":
        """One of :data:`CLUSTERS` by name (``dgx-a100``, ``h100-sxm``, ``cpu-gloo``,
        ``tesseract-paper``), or the path of a ``.json`` cluster file (:meth:`save`)."""
        if isinstance(name, Cluster):
            return name
        if isinstance(name, str) and name.endswith(".json"):
            return cls.load(name)
        try:
            return CLUSTERS[name]
        except KeyError:
            raise ConfigError(f"unknown cluster preset {name!r}; presets: {', '.join(CLUSTERS)}") from None

    def rate(self, flop: float) -> float:
        """FLOP/s of a matmul of ``flop`` FLOPs (``2·m·k·n``): :attr:`flops_curve` at its
        size ``(m·k·n)^(1/3)``, else :attr:`flops`.

        >>> c = CLUSTERS["cpu-gloo"].replace(flops_curve=((64, 1e9), (256, 4e9)))
        >>> [round(c.rate(2 * e ** 3) / 1e9, 3) for e in (32, 64, 128, 1024)]
        [1.0, 1.0, 2.0, 4.0]
        """
        curve = sorted(self.flops_curve)
        if not curve:
            return self.flops
        size = max(flop / 2, 1) ** (1 / 3)
        if size <= curve[0][0]:
            return curve[0][1]
        for (x0, r0), (x1, r1) in zip(curve, curve[1:]):
            if size <= x1:
                f = math.log(size / x0) / math.log(x1 / x0)
                return math.exp(math.log(r0) + f * (math.log(r1) - math.log(r0)))
        return curve[-1][1]

    def to_dict(self) -> dict:
        """The fields as JSON-ready data (:meth:`from_dict` reads them back)."""
        d = dataclasses.asdict(self)
        d["flops_curve"] = [list(x) for x in self.flops_curve]
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "Cluster":
        """A Cluster from :meth:`to_dict`'s data (e.g. a ``cluster.json`` of ``autoshard profile --out``);
        a ConfigError names an unknown or missing field."""
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise ConfigError(f"cluster file: unknown field(s) {', '.join(unknown)}; valid: {', '.join(sorted(names))}")
        d = dict(d)
        d["flops_curve"] = tuple(tuple(x) for x in d.get("flops_curve", ()))
        try:
            return cls(**d)
        except TypeError as e:
            raise ConfigError(f"cluster file: {e}") from None

    @classmethod
    def load(cls, path) -> "Cluster":
        """The Cluster saved at ``path`` (JSON, :meth:`save`)."""
        import json

        try:
            with open(path) as f:
                return cls.from_dict(json.load(f))
        except (OSError, ValueError) as e:
            raise ConfigError(f"cannot read the cluster file {path}: {e}") from None

    def save(self, path) -> str:
        """Write this Cluster as JSON to ``path`` (reuse it with ``--cluster path`` / :meth:`load`)."""
        import json

        with open(path, "w") as f:
            json.dump(self.to_dict(), f, indent=1)
        return str(path)

    def replace(self, **changes) -> "Cluster":
        """A copy with some fields changed (e.g. ``memory_bytes``)."""
        return dataclasses.replace(self, **changes)

    def describe(self) -> str:
        return (f"{self.name}: {self.ranks_per_node} ranks/node, intra {self.intra_bw / 1e9:g} GB/s "
                f"+ {self.intra_latency * 1e6:g} µs, inter {self.inter_bw / 1e9:g} GB/s/node "
                f"+ {self.inter_latency * 1e6:g} µs, {self.flops / 1e12:g} TFLOP/s, "
                f"{self.memory_bytes / GiB:g} GiB/rank")


#: Presets. ``flops`` is a *sustained* rate (roughly 60% of the dense peak of the
#: training dtype), what :func:`~autoshard.planning.profile.profile` would measure, not the datasheet peak.
#: Latencies per ring step follow NCCL's own tuning model (src/graph/tuning.cc,
#: Ring/Simple: NVLink 3.4-5.7 µs, network 6.6-9.6 µs per hop).
CLUSTERS: dict[str, Cluster] = {
    # DGX A100 80GB: NVLink3 via NVSwitch 300 GB/s per direction per GPU (≈230 achieved
    # by NCCL), 8 × HDR 200 Gb/s NICs per node; bf16 dense peak 312 TFLOP/s.
    "dgx-a100": Cluster(name="dgx-a100", ranks_per_node=8, intra_bw=230e9, intra_latency=5e-6,
                        inter_bw=8 * 25e9, inter_latency=10e-6, flops=190e12, memory_bytes=80 * GiB),
    # DGX H100 / HGX H100 SXM: NVLink4 450 GB/s per direction per GPU (≈360 achieved),
    # 8 × NDR 400 Gb/s NICs; bf16 dense peak 989 TFLOP/s.
    "h100-sxm": Cluster(name="h100-sxm", ranks_per_node=8, intra_bw=360e9, intra_latency=5e-6,
                        inter_bw=8 * 50e9, inter_latency=10e-6, flops=600e12, memory_bytes=80 * GiB),
    # Processes of one host exchanging CPU tensors through shared memory (runtime/shm.py: a 2 MiB
    # all-reduce on 2 ranks measured 1.4 ms, these rates predict 1.2 ms); "nodes" joined by 10 GbE.
    "cpu-gloo": Cluster(name="cpu-gloo", ranks_per_node=64, intra_bw=2e9, intra_latency=60e-6,
                        inter_bw=1.25e9, inter_latency=120e-6, flops=50e9, memory_bytes=16 * GiB,
                        device="cpu", pair_overlap=0.0, compute_overlap=0.5),
    # Tesseract paper (its §4, the experiments): MeluXina, 4 × A100-40GB per node, NVLink 200 GB/s
    # inside a node, InfiniBand 200 Gb/s (= 25 GB/s) between nodes. fp32 training with
    # TF32 matmuls (PyTorch's default in 2021): 156 TFLOP/s peak, 40% sustained assumed.
    "tesseract-paper": Cluster(name="tesseract-paper", ranks_per_node=4, intra_bw=200e9, intra_latency=5e-6,
                               inter_bw=25e9, inter_latency=10e-6, flops=0.4 * 156e12, memory_bytes=40 * GiB),
}


def default_cluster() -> Cluster:
    """A preset guessed from this process's device: ``h100-sxm`` on an H100,
    ``dgx-a100`` on another GPU, ``cpu-gloo`` without CUDA."""
    import torch

    if not torch.cuda.is_available():
        return CLUSTERS["cpu-gloo"]
    name = torch.cuda.get_device_name()
    return CLUSTERS["h100-sxm"] if "H100" in name or "H200" in name else CLUSTERS["dgx-a100"]


# --------------------------------------------------------------------------- links

@functools.lru_cache(maxsize=4096)
def link_of(mesh: Mesh, axes: tuple[str, ...], ranks_per_node: int) -> tuple[str, int]:
    """``("intra", 0)`` if every group along ``axes`` sits inside one node, else
    ``("inter", load)`` where ``load`` is the largest number of ring edges (over all
    groups along ``axes``, running at once) that leave one node."""
    axes = tuple(axes)
    if mesh.size(axes) <= 1 or ranks_per_node >= mesh.world_size:
        return ("intra", 0)
    strides = {}
    s = 1
    for a, n in zip(reversed(mesh.axes), reversed(mesh.sizes)):
        strides[a] = s
        s *= n
    # offsets of a group's members from its first rank, in ring order (first axis most significant)
    ring = [0]
    for a in axes:
        ring = [o + c * strides[a] for o in ring for c in range(mesh.size(a))]
    others = [a for a in mesh.axes if a not in axes]
    bases = [0]
    for a in others:
        bases = [b + c * strides[a] for b in bases for c in range(mesh.size(a))]
    # every group's ring at once (a group per row): each edge's node and its successor's;
    # a rank-by-rank walk took seconds over the search's meshes at thousands of ranks
    import torch

    nodes = (torch.tensor(bases)[:, None] + torch.tensor(ring)[None, :]) // ranks_per_node
    src = nodes[nodes != nodes.roll(-1, dims=1)]
    if not len(src):
        return ("intra", 0)
    return ("inter", int(torch.bincount(src).max()))


def _link(mesh: Mesh, axes, cluster: Cluster) -> tuple[str, float, float]:
    """(link class, latency per step, effective bytes/s of one rank's stream) for
    a group along ``axes``: NVLink inside a node; across nodes the ring is as slow
    as its slowest edge, the node's network links shared by ``load`` streams."""
    link, load = link_of(mesh, tuple(axes), cluster.ranks_per_node)
    if link == "intra":
        return link, cluster.intra_latency, cluster.intra_bw
    return link, cluster.inter_latency, min(cluster.intra_bw, cluster.inter_bw / load)


def collective_time(c: Comm, mesh: Mesh, cluster: Cluster) -> tuple[float, str]:
    """Seconds for one collective call and its link class (``intra`` / ``inter``)."""
    p = c.group_size
    if p <= 1 or c.buffer_bytes == 0:
        return 0.0, "none"
    steps = 2 * (p - 1) if c.kind == "all_reduce" else 1 if c.kind == "send_recv" else (p - 1)
    link, alpha, bw = _link(mesh, c.axes, cluster)
    return cluster.call_overhead + steps * alpha + c.bytes_per_rank / bw, link


def broadcast_time(nbytes: float, group_size: int, axes, mesh: Mesh, cluster: Cluster) -> float:
    """Seconds for one pipelined (chain) broadcast or reduce of ``nbytes`` over a
    group along ``axes``: ``(p-1)`` latency steps plus the message once over the
    slowest link. Used to model implementations that move SUMMA operands with
    one broadcast / reduce per step (the Tesseract paper's Algorithm 3) instead
    of one all-gather / reduce-scatter.

    >>> m = Mesh(axes=("row", "col"), sizes=(2, 2))
    >>> c = CLUSTERS["dgx-a100"]
    >>> round((broadcast_time(230e6, 2, ("col",), m, c) - c.intra_latency) * 1e3, 9)   # ms on NVLink
    1.0
    """
    if group_size <= 1 or nbytes == 0:
        return 0.0
    _, alpha, bw = _link(mesh, axes, cluster)
    return (group_size - 1) * alpha + nbytes / bw


# --------------------------------------------------------------------------- flops

_VIEW_OPS = frozenset({
    "view", "_unsafe_view", "reshape", "permute", "transpose.int", "t", "expand", "unsqueeze", "squeeze",
    "squeeze.dim", "slice.Tensor", "select.int", "getitem", "alias", "detach", "split.Tensor",
    "split_with_sizes", "chunk", "sym_size.int", "output", "unflatten.int", "flatten.using_ints",
    "lift_fresh_copy", "_assert_tensor_metadata", "_assert_scalar", "sym_constrain_range_for_size",
})


def _numel(shape) -> int:
    if shape is None:
        return 0
    if len(shape) == 0:          # a scalar
        return 1
    if isinstance(shape[0], (tuple, list)):
        return sum(_numel(s) for s in shape)
    return math.prod(int(x) for x in shape)


def _spec_axes(spec) -> set:
    if spec is None:
        return set()
    if isinstance(spec, tuple):
        out = set()
        for s in spec:
            out |= _spec_axes(s)
        return out
    return set(spec.axes) | set(spec.partial)


def _param_index(plan: ShardingPlan) -> dict:
    idx = {}
    for p in plan.params:
        for n in (p.name, *p.aliases):
            idx[n] = p
    return idx


def node_flops(n: NodePlan, plan: ShardingPlan, params: dict | None = None) -> float:
    """Forward FLOPs of one node on one rank (0 for cheap elementwise / view ops)."""
    if n.kind == "linear":
        params = params if params is not None else _param_index(plan)
        pp = params.get(f"{n.module}.weight") if n.module else None
        gshape = n.global_shape[0] if n.global_shape and isinstance(n.global_shape[0], tuple) else n.global_shape
        if not gshape:
            return 0.0
        out = math.prod(gshape)                      # N·n
        n_feat = gshape[-1]
        work = _spec_axes(n.out_spec)
        if pp is not None and len(pp.global_shape) == 2:
            nd = getattr(n.kernel, "n_dim", None)
            if nd in (0, 1):
                k = pp.global_shape[1 - nd]
            else:
                a, b = pp.global_shape
                k = b if a == n_feat else a
            work |= set(pp.spec.axes)
        else:                                        # weight unknown: assume square
            k = n_feat
        return 2.0 * out * k / plan.mesh.size(tuple(sorted(work, key=plan.mesh.axes.index)))
    if n.kind == "attention":
        ls = n.local_shape
        if ls and not isinstance(ls[0], tuple) and len(ls) == 4:
            b, h, s, d = ls
            # queries split on the sequence (cp) still meet every key
            keys = s * plan.mesh.size(n.out_spec.dims[2]) if isinstance(n.out_spec, ShardSpec) and n.out_spec.dims[2] else s
            return 4.0 * b * h * s * keys * d
    return 0.0


# --------------------------------------------------------------------------- estimate

@dataclass(frozen=True, kw_only=True)
class CommTime:
    """One collective of the step with its predicted time."""

    comm: Comm
    seconds: float
    link: str
    node: str


@dataclass(frozen=True, kw_only=True)
class CostEstimate:
    """Predicted figures for one training step on one rank (bytes, seconds, FLOPs)."""

    cluster: str
    flops_fwd: float
    compute_s: float
    comm_s_fwd: float
    comm_s_bwd: float
    comm_bytes: float
    inter_node_bytes: float
    collective_calls: int
    param_bytes: int
    grad_bytes: int
    optimizer_bytes: int
    activation_bytes: int
    memory_limit: int
    notes: tuple[str, ...] = ()
    comms: tuple[CommTime, ...] = field(default=(), repr=False, compare=False)

    @property
    def comm_s(self) -> float:
        return self.comm_s_fwd + self.comm_s_bwd

    @property
    def step_s(self) -> float:
        return self.compute_s + self.comm_s

    @property
    def memory_bytes(self) -> int:
        return self.param_bytes + self.grad_bytes + self.optimizer_bytes + self.activation_bytes

    @property
    def fits(self) -> bool:
        return self.memory_bytes <= self.memory_limit

    def to_dict(self) -> dict:
        return {"cluster": self.cluster, "flops_fwd": self.flops_fwd, "compute_s": self.compute_s,
                "comm_s_fwd": self.comm_s_fwd, "comm_s_bwd": self.comm_s_bwd, "comm_s": self.comm_s,
                "step_s": self.step_s, "comm_bytes": self.comm_bytes, "inter_node_bytes": self.inter_node_bytes,
                "collective_calls": self.collective_calls, "param_bytes": self.param_bytes,
                "grad_bytes": self.grad_bytes, "optimizer_bytes": self.optimizer_bytes,
                "activation_bytes": self.activation_bytes, "memory_bytes": self.memory_bytes,
                "memory_limit": self.memory_limit, "fits": self.fits, "notes": list(self.notes)}


def _dp_grad_comms(plan: ShardingPlan) -> list[Comm]:
    """Gradient all-reduce over ``dp`` for parameters whose plan does not sync it (not the
    experts split over dp by expert parallelism: each dp rank holds other experts, whose
    gradient the all-to-all's backward already summed)."""
    if "dp" not in plan.mesh.axes or plan.mesh.size("dp") <= 1:
        return []
    return [Comm(phase="bwd", kind="all_reduce", axes=("dp",), group_size=plan.mesh.size("dp"),
                 buffer_bytes=p.local_bytes(plan.mesh))
            for p in plan.params if not p.is_buffer and p.trainable and "dp" not in p.grad_sync
            and "dp" not in p.spec.axes]


def activation_bytes(plan: ShardingPlan, dtype_bytes: int | None = None, device: str = "cuda") -> int:
    """Bytes one rank saves for backward (:func:`autoshard.planning.activations.saved_bytes`
    on ``device``); for a plan without a trace (built by hand), the rough sum of the
    local output bytes of every node that allocates (views excluded)."""
    traced = saved_bytes(plan, device, dtype_bytes=dtype_bytes)
    if traced is not None:
        return traced
    if dtype_bytes is None:
        sizes = [p.dtype_bytes for p in plan.params if not p.is_buffer]
        dtype_bytes = max(set(sizes), key=sizes.count) if sizes else 4
    total = 0
    for n in plan.nodes:
        if n.kind == "input" or n.op in _VIEW_OPS or n.op.startswith(("sym_", "_assert")):
            continue
        total += _numel(n.local_shape) * dtype_bytes
    return int(total)


_CASTING = (Summa, ThreeDLinear, RowLinear, PartialHead, RingAttention)     # cast to autocast's dtype first


def _at_compute_dtype(c: Comm, nbytes: int) -> Comm:
    """``c`` moving ``nbytes``-byte elements instead of the plan's 4 (float32 capture)."""
    return dataclasses.replace(c, buffer_bytes=c.buffer_bytes * nbytes // 4)


def _node_comm_times(n: NodePlan, mesh: Mesh, cluster: Cluster) -> list[CommTime]:
    """The node's collectives, timed. A kernel whose collectives go two at a time
    (``Kernel.paired``: a SUMMA / 3D Linear's two operand gathers, its two gradient
    scatters) is charged the longer of each pair in full and the shorter for the
    share the longer does not hide (``1 - cluster.pair_overlap``; its bytes and call
    count either way)."""
    out = []
    pending: dict = {}          # (phase, kind) -> index in out of the pair's first call
    paired = getattr(n.kernel, "paired", False)
    for c in n.comms:
        t, link = collective_time(c, mesh, cluster)
        out.append(CommTime(comm=c, seconds=t, link=link, node=n.name))
        if not paired:
            continue
        key = (c.phase, c.kind)
        if key not in pending:
            pending[key] = len(out) - 1
            continue
        first = pending.pop(key)
        shorter = first if out[first].seconds < out[-1].seconds else len(out) - 1
        out[shorter] = dataclasses.replace(out[shorter], seconds=out[shorter].seconds * (1.0 - cluster.pair_overlap))
    return out


def _async_tp_times(n: NodePlan, plan: ShardingPlan, cluster: Cluster, chunks: int,
                     params: dict) -> list[CommTime] | None:
    """A node's collectives under asynchronous TP
    (:meth:`autoshard.module.ShardedModule.async_tp`), or None for a node it leaves alone:
    a row-parallel Linear's forward all-reduce (1d; 1d-sp: reduce-scatter), or the
    all-gather of the sequence that 1d-sp's Linear reads its input through (fused with
    the Linears that read it), in ``chunks`` calls of their own (each paying the call
    overhead and the ring latency), every one but the last hidden behind a chunk's
    product for the share ``cluster.compute_overlap``. In 1d-sp the chunks are chunks of
    the batch: only where each rank holds at least ``chunks`` samples. The product a
    gather hides behind is this Linear's alone (the others reading the gather hide it
    further: the estimate is on the safe side)."""
    if isinstance(n.kernel, RowLinear):
        kind = "all_reduce" if n.kernel.scatter_dim is None else "reduce_scatter"
    elif n.kernel is None and n.op == "linear" and plan.mode == "1d-sp" \
            and any(s.op == "gather_partial" for _, steps in n.arg_steps for s in steps):
        kind = "all_gather"
    else:
        return None
    if kind != "all_reduce":
        local_batch = plan.batch_size // (plan.mesh.size(plan.batch_axes) if plan.batch_axes else 1)
        if local_batch < chunks:
            return None
    fwd = [c for c in n.comms if c.phase == "fwd" and c.kind == kind]
    if len(fwd) != 1:
        return None
    flops = node_flops(n, plan, params) / chunks
    product = flops / cluster.rate(flops) if flops else 0.0      # one chunk's share of the matmul
    part = dataclasses.replace(fwd[0], buffer_bytes=fwd[0].buffer_bytes / chunks)
    t, link = collective_time(part, plan.mesh, cluster)
    out = [CommTime(comm=part, seconds=t - (min(t, product) * cluster.compute_overlap if i < chunks - 1 else 0.0),
                    link=link, node=n.name) for i in range(chunks)]
    return out + [ct for ct in _node_comm_times(n, plan.mesh, cluster) if ct.comm is not fwd[0]]


def estimate(plan: ShardingPlan, cluster: Cluster | str = "dgx-a100", *, optimizer: str | None = "adamw",
             activation_dtype_bytes: int | None = None, zero: int = 0, async_tp: int = 1,
             compute_dtype_bytes: int | None = None) -> CostEstimate:
    """Predict one training step of ``plan`` on ``cluster`` for one rank.

    ``compute_dtype_bytes=2`` (bf16 autocast): the Linears' and ring attention's
    collectives move the compute dtype, as the kernels cast before they gather
    (docs/design.md, "Mixed precision"); statistics, re-layout steps and the gradient sync
    keep the plan's dtype.

    ``zero=1`` (:class:`autoshard.training.zero.ZeroAdamW`): the optimizer state is split
    over the ``dp`` replicas; ``zero=2``: the gradients too. The bytes on the wire
    stay those of the dp all-reduce (a reduce-scatter plus an all-gather).
    ``async_tp=c`` (:meth:`autoshard.module.ShardedModule.async_tp`): each 1d
    row-parallel Linear's all-reduce (1d-sp: reduce-scatter) in ``c`` chunks, all but the last overlapping the
    next chunk's product (``Cluster.compute_overlap``); more calls, less exposed time
    where the overlap beats the extra calls' overhead.

    Example:
        >>> from transformers import LlamaConfig
        >>> import autoshard
        >>> cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=1,
        ...                   num_attention_heads=4, num_key_value_heads=2, vocab_size=128)
        >>> p = autoshard.plan(cfg, world_size=2, mode="1d", batch_size=4, seq_len=16)
        >>> e = estimate(p, "cpu-gloo")
        >>> e.param_bytes == p.param_bytes_per_rank, e.step_s > e.compute_s > 0
        (True, True)
    """
    cluster = Cluster.preset(cluster)
    mesh = plan.mesh
    if not isinstance(async_tp, int) or isinstance(async_tp, bool) or async_tp < 1:
        raise ConfigError(f"async_tp={async_tp!r}: a whole number of row chunks >= 1 (1: off)")
    # backward ≈ 2 × forward; every node pays the dispatch overhead once per step
    # (forward and backward together)
    flops, compute_s = _compute(plan, cluster, passes=3.0)
    timed: list[CommTime] = []
    params = _param_index(plan) if async_tp > 1 else {}
    notes = []
    chunked, gathers = 0, 0
    for n in plan.nodes:
        pipelined = _async_tp_times(n, plan, cluster, async_tp, params) if async_tp > 1 else None
        if pipelined is not None:
            chunked += isinstance(n.kernel, RowLinear)
            gathers += not isinstance(n.kernel, RowLinear)
        if compute_dtype_bytes is not None and pipelined is None and isinstance(n.kernel, _CASTING):
            n = dataclasses.replace(n, comms=tuple(_at_compute_dtype(c, compute_dtype_bytes) for c in n.comms))
        timed += pipelined if pipelined is not None else _node_comm_times(n, mesh, cluster)
    if chunked or gathers:
        what = "reduce-scatter(s)" if plan.mode == "1d-sp" else "all-reduce(s)"
        notes.append(f"asynchronous TP: {chunked} row-parallel {what}"
                     + (f" and {gathers} sequence all-gather(s)" if gathers else "") + f" in {async_tp} chunks")
    synced, said, pbytes, gbytes, obytes = _param_part(plan, cluster, optimizer, zero)
    timed += synced
    notes += said
    if plan.fallbacks:
        notes.append(f"{len(plan.fallbacks)} fallback node(s)")
    return CostEstimate(
        cluster=cluster.name, flops_fwd=flops, compute_s=compute_s,
        comm_s_fwd=sum(t.seconds for t in timed if t.comm.phase == "fwd"),
        comm_s_bwd=sum(t.seconds for t in timed if t.comm.phase != "fwd"),
        comm_bytes=sum(t.comm.bytes_per_rank for t in timed),
        inter_node_bytes=sum(t.comm.bytes_per_rank for t in timed if t.link == "inter"),
        collective_calls=len(timed), param_bytes=pbytes, grad_bytes=gbytes, optimizer_bytes=obytes,
        activation_bytes=activation_bytes(plan, activation_dtype_bytes, cluster.device),
        memory_limit=cluster.memory_bytes,
        notes=tuple(notes), comms=tuple(timed))


_PARAM_PART: list = [None]      # (key, figures) of the last _param_part


def _param_part(plan: ShardingPlan, cluster: Cluster, optimizer: str | None, zero: int) -> tuple:
    """What :func:`estimate` reads of ``plan``'s parameters alone: ``(the timed gradient
    syncs, the notes on them, parameter, gradient and optimizer bytes)``. The last one is
    remembered: a search estimates one candidate's parameter list (the full graph's, 720
    parameters for 70B) with and without a layer's rows, at each async-TP chunk count
    (docs/design.md, "Pricing the search")."""
    key = (plan.mesh, plan.dp, cluster, optimizer, zero)
    last = _PARAM_PART[0]
    if last is not None and last[0] is plan.params and last[1] == key:
        return last[2]
    mesh, timed, notes = plan.mesh, [], []
    for c in plan.grad_sync_buckets():       # as a ShardedModule runs them: bucketed
        t, link = collective_time(c, mesh, cluster)
        timed.append(CommTime(comm=c, seconds=t, link=link, node="grad sync"))
    for c in plan.copy_sync_comms():         # kv-head copies' gradient sums: per parameter
        t, link = collective_time(c, mesh, cluster)
        timed.append(CommTime(comm=c, seconds=t, link=link, node="copy grad sync"))
    extra = _dp_grad_comms(plan)
    if extra:
        notes.append("dp gradient all-reduce added by the cost model (the plan does not list it)")
    for c in extra:
        t, link = collective_time(c, mesh, cluster)
        timed.append(CommTime(comm=c, seconds=t, link=link, node="dp grad sync"))
    gbytes, obytes = _state_bytes(plan, optimizer, zero, notes)
    out = (tuple(timed), tuple(notes), plan.param_bytes_per_rank, gbytes, obytes)
    _PARAM_PART[0] = (plan.params, key, out)
    return out


def _state_bytes(plan: ShardingPlan, optimizer: str | None, zero: int, notes: list) -> tuple[int, int]:
    """``(gradient bytes, optimizer bytes)`` per rank of :func:`estimate` (what it says of
    them goes into ``notes``): frozen parameters have neither, ZeRO splits them over dp."""
    mesh = plan.mesh
    # frozen parameters (requires_grad=False) have neither gradient nor optimizer state
    trainable = sum(p.local_bytes(mesh) // p.dtype_bytes for p in plan.params if not p.is_buffer and p.trainable)
    if optimizer in (None, "none", "sgd"):
        obytes = 0
    elif optimizer in ("adam", "adamw"):
        obytes = 2 * 4 * trainable
    else:
        raise ConfigError(f"unknown optimizer {optimizer!r}; choose 'adamw', 'adam', 'sgd' or None")
    gbytes = plan.grad_bytes_per_rank
    if plan.frozen_bytes_per_rank:
        notes.append(f"{plan.frozen_bytes_per_rank:,} B of frozen parameters per rank: no gradient, "
                     f"no optimizer state")
    if zero not in (0, 1, 2):
        raise ConfigError(f"zero={zero!r}: the valid choices are 0 (off), 1 (optimizer state over dp), 2 (gradients too)")
    if zero and plan.dp > 1:
        obytes = -(-obytes // plan.dp)
        if zero == 2:
            gbytes = -(-gbytes // plan.dp)
        notes.append(f"ZeRO-{zero}: optimizer state{' and gradients' if zero == 2 else ''} split over dp={plan.dp}")
    return gbytes, obytes


def forward_latency(plan: ShardingPlan, cluster: Cluster | str = "dgx-a100") -> float:
    """Predicted seconds of one forward of ``plan`` on ``cluster`` for one rank: each
    node's matmul at the rate of its size, the per-node dispatch overhead and the
    forward collectives. For a :meth:`~autoshard.module.ShardedModule.generate`
    decode plan (``sharded.generation_plan("decode")``) it is the per-token latency.

    Example:
        >>> from transformers import LlamaConfig
        >>> import autoshard
        >>> cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=1,
        ...                   num_attention_heads=4, num_key_value_heads=2, vocab_size=128)
        >>> p = autoshard.plan(cfg, world_size=2, mode="1d", batch_size=4, seq_len=16)
        >>> 0 < forward_latency(p, "cpu-gloo") < estimate(p, "cpu-gloo").step_s
        True
    """
    cluster = Cluster.preset(cluster)
    _, seconds = _compute(plan, cluster, passes=1.0)
    return seconds + sum(collective_time(c, plan.mesh, cluster)[0] for n in plan.nodes for c in n.comms
                         if c.phase == "fwd")


def _compute(plan: ShardingPlan, cluster: Cluster, *, passes: float) -> tuple[int, float]:
    """(forward FLOPs, compute seconds) of ``plan`` on ``cluster``: each node's matmul
    run ``passes`` times at the rate of its size, plus the per-node dispatch overhead
    (graph inputs and state inputs dispatch nothing)."""
    params = _param_index(plan)
    per_node = [node_flops(n, plan, params) for n in plan.nodes]
    seconds = sum(passes * f / cluster.rate(f) for f in per_node if f)
    seconds += cluster.op_overhead * sum(1 for n in plan.nodes if n.kind not in ("input", "state"))
    return sum(per_node), seconds
