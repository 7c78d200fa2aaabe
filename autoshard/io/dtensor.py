"""The sharded module's tensors as DTensors: every mode's layout as DTensor placements.

A :class:`~autoshard.ir.spec.ShardSpec` names, per tensor dim, the mesh axes that
split it (first axis outermost) and how many fused segments the dim holds. A
DTensor names, per *mesh* dim in mesh order, a placement. The two meet as follows
(``docs/design.md``, DTensor placements):

* an axis that splits dim ``d`` alone, or first among the axes of ``d`` that come
  later in mesh order, with no segments: ``Shard(d)``;
* otherwise ``_StridedShard(d, split_factor=m · n)``: ``m`` the dim's segments (GPT-2's
  fused q/k/v: 3) and ``n`` the product of the sizes of the axes that split ``d``
  further *out* than this one but come later in mesh order (a 2d block whose rows are
  split col-major). torch applies placements left to right over the mesh; a strided
  shard takes block ``i`` of each of its ``split_factor`` groups, which is how a
  segmented or out-of-order split lays its blocks out;
* an axis the tensor is not split over: ``Replicate()`` (2.5d's depth, ``dp``);
* a dim of fused blocks of *unequal* widths (``ShardSpec.widths``: Phi-3's q, k, v with
  fewer kv heads), which no placement expresses: the tensor is presented whole,
  ``Replicate()`` on every axis (:func:`to_dtensor` gathers it; loading slices it again).

A padded vocabulary (:mod:`autoshard.passes.pad`, ``Vp = ceil(V / n) · n``) is torch's
uneven ``Shard``: rank ``i`` holds rows ``[i·c, min((i+1)·c, V))``, ``c = ceil(V / n)``, so
the DTensor has the Hugging Face shape and its local tensor drops the zero rows.

:func:`local_pieces` reads any DTensor's placements back into the rectangular pieces
of the global tensor this rank holds, in local order; the DCP planners
(:mod:`autoshard.io.dcp`) save and load by it, since DCP's own planners describe a
rank's block as one rectangle, which a strided shard is not.

    >>> from autoshard.ir.mesh import Mesh
    >>> from autoshard.ir.spec import ShardSpec
    >>> mesh = Mesh(axes=("row", "col"), sizes=(2, 2))
    >>> placements(ShardSpec(dims=(("row",), ("col",))), mesh)
    (Shard(dim=0), Shard(dim=1))
    >>> placements(ShardSpec(dims=((), ("col",)), segments=(1, 3)), mesh)
    (Replicate(), _StridedShard(dim=1, sf=3))
    >>> placements(ShardSpec(dims=(("col", "row"),)), mesh)
    (_StridedShard(dim=0, sf=2), Shard(dim=0))
"""

from __future__ import annotations

import itertools
import math
from typing import Sequence

import torch

from ..ir.errors import ShardingError
from ..ir.mesh import Mesh
from ..ir.spec import ShardSpec, regroup

__all__ = ["placements", "local_pieces", "device_mesh", "to_dtensor", "dtensor_state_dict", "from_dtensor",
           "tp_local", "like_fsdp", "narrow_piece"]


def _types():
    from torch.distributed.tensor import Partial, Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    return Shard, _StridedShard, Replicate, Partial


def placements(spec: ShardSpec, mesh: Mesh) -> tuple:
    """The DTensor placements (one per mesh axis, in mesh order) of a tensor laid out by ``spec``."""
    Shard, Strided, Replicate, Partial = _types()
    out: list = [Replicate()] * len(mesh.axes)
    if spec.widths:             # unequal fused blocks: no placement cuts them, presented whole
        return tuple(out)
    for d, axes in enumerate(spec.dims):
        for pos, a in enumerate(axes):
            later = [b for b in axes[:pos] if mesh.axes.index(b) > mesh.axes.index(a)]
            sf = spec.segments[d] * math.prod(mesh.size(b) for b in later)
            out[mesh.axes.index(a)] = Shard(d) if sf == 1 else Strided(d, split_factor=sf)
    for a in spec.partial:
        out[mesh.axes.index(a)] = Partial()
    return tuple(out)


def _dim_ranges(size: int, steps) -> list[tuple[int, int]]:
    """The global ranges of one dim a rank holds, in local order, after ``steps``
    (``(kind, split_factor, count, index)`` in mesh order)."""
    ranges = [(0, size)]
    for kind, sf, n, i in steps:
        length = sum(b - a for a, b in ranges)
        if kind == "shard":             # torch.chunk: ceil-sized blocks, the last ones short or empty
            c = -(-length // n)
            want = [(min(i * c, length), min((i + 1) * c, length))]
        else:
            if length % (sf * n):
                raise ShardingError(f"a strided shard of {length} into {sf}×{n} blocks is uneven")
            seg, blk = length // sf, length // (sf * n)
            want = [(s * seg + i * blk, s * seg + (i + 1) * blk) for s in range(sf)]
        out: list[tuple[int, int]] = []
        for lo, hi in want:             # local positions -> global ranges through the current ones
            at = 0
            for a, b in ranges:
                x, y = max(lo, at), min(hi, at + b - a)
                if x < y:
                    g = (a + x - at, a + y - at)
                    if out and out[-1][1] == g[0]:
                        out[-1] = (out[-1][0], g[1])
                    else:
                        out.append(g)
                at += b - a
        ranges = out
    return ranges


def local_pieces(shape: Sequence[int], placements_: Sequence, mesh_sizes: Sequence[int],
                 coords: Sequence[int]) -> list[tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]]:
    """The rectangular pieces of the global tensor of ``shape`` a rank at mesh
    ``coords`` holds under ``placements_``: ``(global offsets, local offsets, sizes)``
    per piece. One piece for ``Shard`` / ``Replicate``; several where a strided shard
    takes a block of each group.

        >>> from torch.distributed.tensor import Shard
        >>> from torch.distributed.tensor.placement_types import _StridedShard
        >>> local_pieces((12, 2), [_StridedShard(0, split_factor=3)], [2], [1])
        [((2, 0), (0, 0), (2, 2)), ((6, 0), (2, 0), (2, 2)), ((10, 0), (4, 0), (2, 2))]
        >>> local_pieces((5,), [Shard(0)], [2], [1])
        [((3,), (0,), (2,))]
    """
    Shard, Strided, _, Partial = _types()
    steps: list[list] = [[] for _ in shape]
    for p, n, i in zip(placements_, mesh_sizes, coords):
        if isinstance(p, Strided):
            steps[p.dim].append(("strided", int(p.split_factor), n, i))
        elif isinstance(p, Shard):
            steps[p.dim].append(("shard", 1, n, i))
        elif isinstance(p, Partial):
            raise ShardingError("a partial-sum tensor has no pieces: reduce it first")
    per_dim = []
    for size, st in zip(shape, steps):
        runs, at = [], 0
        for lo, hi in _dim_ranges(int(size), st):
            runs.append((lo, at, hi - lo))
            at += hi - lo
        per_dim.append(runs or [(0, 0, 0)])
    return [(tuple(r[0] for r in c), tuple(r[1] for r in c), tuple(r[2] for r in c))
            for c in itertools.product(*per_dim)]


def device_mesh(sharded):
    """The ``DeviceMesh`` over the module's mesh (its axes and names), built from the
    plan's own per-axis process groups (no new group, no collective). The module keeps
    it: :attr:`autoshard.module.ShardedModule.device_mesh`."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d
    from torch.distributed.device_mesh import DeviceMesh

    mesh = sharded.mesh
    if not dist.is_initialized():
        raise ShardingError("DTensor state dicts need the process group the module was sharded in")
    groups = [c10d._resolve_process_group(sharded.group_name((a,))) for a in mesh.axes]
    ranks = torch.arange(mesh.world_size, device="cpu").reshape(mesh.sizes)     # a DeviceMesh layout: host-side
    return DeviceMesh.from_group(groups if len(groups) > 1 else groups[0], sharded.device.type, mesh=ranks,
                                 mesh_dim_names=tuple(mesh.axes))


def _trim_local(pp, local: torch.Tensor, mesh: Mesh, rank: int) -> torch.Tensor | None:
    """``local`` without its padded rows, when torch's uneven ``Shard`` over the Hugging Face
    size gives the same blocks as the padded spec (else None: described at the padded size)."""
    d = pp.pad_dim
    V = pp.hf_shape[d]
    pl = placements(pp.spec, mesh)
    coords = [mesh.coords(rank)[a] for a in mesh.axes]
    want = local_pieces(pp.hf_shape, pl, mesh.sizes, coords)
    have = pp.spec.blocks(pp.global_shape, mesh, rank)[d]
    kept = [(max(lo, 0), min(hi, V)) for lo, hi in have if min(hi, V) > lo]
    if [(p[0][d], p[0][d] + p[2][d]) for p in want if p[2][d]] != kept:
        return None
    return local.narrow(d, 0, sum(hi - lo for lo, hi in kept))


def _whole(sharded, spec: ShardSpec, local: torch.Tensor, shape) -> torch.Tensor:
    """The whole tensor of unequal fused blocks (collective over its split axes): DTensor
    gathers it in rank order (each rank's ``[q_r | k_r | v_r]`` one chunk of each split
    dim), then each such dim is put back in the dense order ``[q | k | v]``."""
    from torch.distributed.tensor import DTensor

    plain = ShardSpec(dims=spec.dims, segments=tuple(1 if w else m for w, m in zip(spec.widths, spec.segments)))
    full = DTensor.from_local(local.detach(), sharded.device_mesh, placements(plain, sharded.mesh), run_check=False,
                              shape=torch.Size(shape), stride=torch.empty(shape, device="meta").stride()).full_tensor()
    for d, w in enumerate(spec.widths):
        if w:
            full = regroup(full, d, w, sharded.mesh.size(spec.dims[d]), rank_major=False)
    return full


def to_dtensor(sharded, pp, local: torch.Tensor):
    """``local`` (this rank's block of the planned tensor ``pp``) as a DTensor sharing its storage."""
    from torch.distributed.tensor import DTensor

    mesh = sharded.mesh
    shape = tuple(pp.global_shape)
    if pp.spec.widths:          # unequal fused blocks, presented whole (see placements): every rank gathers
        local = _whole(sharded, pp.spec, local, shape)
    if pp.pad_dim is not None and not pp.pad_extra:     # padded on two dims: described at the padded size
        trimmed = _trim_local(pp, local, mesh, sharded.rank)
        if trimmed is not None:
            local, shape = trimmed, tuple(pp.hf_shape)
    stride = torch.empty(shape, device="meta").stride()
    return DTensor.from_local(local, sharded.device_mesh, placements(pp.spec, mesh), run_check=False,
                              shape=torch.Size(shape), stride=stride)


def dtensor_state_dict(sharded, local_state: dict) -> dict:
    """``local_state`` (this rank's local tensors under HF names) with every planned
    tensor as a DTensor over :func:`device_mesh`; other entries as they are."""
    plans = sharded.plan.params_by_name()
    out = type(local_state)()
    for k, v in local_state.items():
        pp = plans.get(k)
        # an FSDP2 module's parameters are DTensors of dp chunks: their TP-local blocks (gathered over dp)
        out[k] = to_dtensor(sharded, pp, tp_local(v)) if pp is not None and isinstance(v, torch.Tensor) else v
    if hasattr(local_state, "_metadata"):
        out._metadata = local_state._metadata
    return out


def from_dtensor(sharded, pp, value) -> torch.Tensor:
    """A DTensor of the planned tensor ``pp`` as this rank's local block: its local tensor
    where it is laid out as the plan lays it (padding restored), else gathered whole
    (collective over the DTensor's mesh) and sliced."""
    mine = placements(pp.spec, sharded.mesh)
    if tuple(value.placements) == mine and value.device_mesh.mesh.tolist() == sharded.device_mesh.mesh.tolist() \
            and not pp.spec.widths:
        local = value.to_local()
        shape = tuple(pp.local_shape(sharded.mesh))
        if pp.pad_dim is not None and tuple(local.shape) != shape:
            d = pp.pad_dim
            grow = list(local.shape)
            grow[d] = shape[d] - local.shape[d]
            local = torch.cat([local, local.new_zeros(grow)], dim=d)
        return local
    full = value.full_tensor()
    return pp.spec.local(pp.pad(full), sharded.mesh, sharded.rank)


def tp_local(t: torch.Tensor) -> torch.Tensor:
    """A parameter's (or its optimizer state's) TP-local block: as it is, or gathered over
    ``dp`` where FSDP2 made it a DTensor of its dp chunks (collective over dp: every rank
    of the replica group calls it, in the same order)."""
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def like_fsdp(like, local: torch.Tensor):
    """``local`` (a whole TP-local block, on every rank) as a DTensor laid out as FSDP2's
    ``like``: this rank's own chunk, cut locally (no communication)."""
    from torch.distributed.tensor import DTensor

    dm = like.device_mesh
    (goff, _, size), = local_pieces(tuple(like.shape), like.placements, tuple(dm.mesh.shape), dm.get_coordinate())
    chunk = narrow_piece(local, goff, size)
    return DTensor.from_local(chunk.contiguous().to(like.dtype), dm, like.placements, run_check=False,
                              shape=like.shape, stride=like.stride())


def narrow_piece(t: torch.Tensor, offsets: Sequence[int], sizes: Sequence[int]) -> torch.Tensor:
    """The view of ``t`` at ``offsets`` of ``sizes`` (a piece of :func:`local_pieces`)."""
    for d, (o, s) in enumerate(zip(offsets, sizes)):
        t = t.narrow(d, o, s)
    return t
