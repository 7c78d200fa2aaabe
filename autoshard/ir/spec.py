"""How one tensor is laid out over a mesh. Pure data plus reversible slicing.

``ShardSpec.dims[d]`` lists the mesh axes that split tensor dim ``d`` (first axis
outermost); ``segments[d] = m`` says dim ``d`` is ``m`` equal blocks fused
together (GPT-2's ``c_attn`` holds q, k, v: 3 segments), each split on its own;
``partial`` lists the axes over which the local values are partial sums still to
be reduced. ``widths[d]``, where dim ``d``'s blocks are *unequal* (Phi-3's ``qkv_proj``
with fewer kv heads: q, k, v of widths 4 : 1 : 1), gives their relative widths; each
block is still split on its own (a rank holds its part of every block), and ``()``
(the default) means ``segments[d]`` equal blocks. A dim split 2 ways with 3 segments,
sliced for block 1::

    global  [q0 q1 | k0 k1 | v0 v1]   ->   local [q1 | k1 | v1]

    >>> import torch
    >>> from autoshard.ir.mesh import Mesh
    >>> mesh = Mesh(axes=("tp",), sizes=(2,))
    >>> s = ShardSpec(dims=(("tp",),), segments=(3,))
    >>> w = torch.arange(12.)
    >>> s.local(w, mesh, rank=1).tolist()
    [2.0, 3.0, 6.0, 7.0, 10.0, 11.0]
    >>> torch.equal(s.assemble([s.local(w, mesh, r) for r in range(2)], mesh), w)
    True
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Iterator, Sequence

from .errors import ShardingError

if TYPE_CHECKING:       # torch is not imported at run time: `import autoshard.ir.spec` stays light
    import torch

__all__ = ["ShardSpec", "replicated", "regroup"]


@dataclass(frozen=True, kw_only=True)
class ShardSpec:
    dims: tuple[tuple[str, ...], ...]
    partial: tuple[str, ...] = ()
    segments: tuple[int, ...] = field(default=())
    widths: tuple[tuple[int, ...], ...] = field(default=())

    def __post_init__(self) -> None:
        dims = tuple(tuple(a) for a in self.dims)
        object.__setattr__(self, "dims", dims)
        object.__setattr__(self, "partial", tuple(self.partial))
        segs = tuple(self.segments) or (1,) * len(dims)
        if len(segs) != len(dims):
            raise ShardingError(f"segments {segs} do not match dims {dims}")
        if self.widths:
            segs = self._set_widths(dims, segs)
        object.__setattr__(self, "segments", segs)
        used = [a for d in dims for a in d] + list(self.partial)
        if len(set(used)) != len(used):
            raise ShardingError(f"a mesh axis is used twice in spec {self}")

    def _set_widths(self, dims, segs) -> tuple[int, ...]:
        """Normalise ``widths``: per dim reduced by their gcd, ``()`` where the blocks are
        equal (or the dim whole), ``()`` overall when no dim has unequal blocks, so that a
        spec of equal blocks compares and serialises as it always did. The segment count
        of a dim with widths is their number."""
        if len(self.widths) != len(dims):
            raise ShardingError(f"widths {self.widths} do not match dims {dims}")
        segs, out = list(segs), []
        for d, w in enumerate(self.widths):
            w = tuple(int(x) for x in w)
            if w and (min(w) <= 0 or not dims[d]):
                raise ShardingError(f"widths {w} of dim {d} need a split dim and positive widths")
            g = math.gcd(*w) if w else 1
            w = tuple(x // g for x in w)
            if w:
                segs[d] = len(w)
            out.append(w if len(set(w)) > 1 else ())
        object.__setattr__(self, "widths", tuple(out) if any(out) else ())
        return tuple(segs)

    # ----------------------------------------------------------------- queries
    @property
    def ndim(self) -> int:
        return len(self.dims)

    @property
    def is_replicated(self) -> bool:
        return not self.partial and not any(self.dims)

    @property
    def axes(self) -> tuple[str, ...]:
        """Axes that split some dim."""
        return tuple(a for d in self.dims for a in d)

    def split_dim(self, axis: str) -> int | None:
        for i, d in enumerate(self.dims):
            if axis in d:
                return i
        return None

    def local_shape(self, shape: Sequence[int], mesh) -> tuple[int, ...]:
        return tuple(s // mesh.size(d) if d else s for s, d in zip(shape, self.dims))

    def blocks(self, shape: Sequence[int], mesh, rank: int) -> tuple[tuple[tuple[int, int], ...], ...]:
        """Where ``rank``'s block lies in the global tensor: per dim, the ``(start, stop)``
        index ranges it takes, in order (one per segment; adjacent ranges merged).

        The block :meth:`local` returns is the cartesian product of these ranges, glued
        in order; a replicated dim is the single range ``(0, size)``. The dim-by-dim
        geometry is the one :meth:`local` slices with, so a drawing or a file reader
        that needs offsets asks here instead of re-deriving it.

            >>> from autoshard.ir.mesh import Mesh
            >>> mesh = Mesh(axes=("tp",), sizes=(2,))
            >>> ShardSpec(dims=((), ("tp",)), segments=(1, 3)).blocks((4, 12), mesh, rank=1)
            (((0, 4),), ((2, 4), (6, 8), (10, 12)))
        """
        if len(shape) != self.ndim:
            raise ShardingError(f"spec {self} has {self.ndim} dims, tensor shape {tuple(shape)}")
        out = []
        for d, (size, at) in enumerate(zip(shape, self.block_index(mesh, rank))):
            size = int(size)
            if at is None:
                out.append(((0, size),))
                continue
            idx, count = at
            ranges: list[tuple[int, int]] = []
            for start, width in self.cuts(d, size, count):
                blk = width // count
                lo = start + idx * blk
                if ranges and ranges[-1][1] == lo:
                    ranges[-1] = (ranges[-1][0], lo + blk)
                else:
                    ranges.append((lo, lo + blk))
            out.append(tuple(ranges))
        return tuple(out)

    def block_widths(self, d: int) -> tuple[int, ...]:
        """Dim ``d``'s relative block widths: its ``widths`` when unequal, else ``segments[d]`` ones."""
        return (self.widths[d] if self.widths else ()) or (1,) * self.segments[d]

    def cuts(self, d: int, size: int, count: int) -> list[tuple[int, int]]:
        """``(start, width)`` of each fused block of dim ``d`` (global ``size``), each checked
        to split into ``count`` equal parts.

        >>> ShardSpec(dims=(("tp",),), widths=((2, 1, 1),)).cuts(0, 96, 2)
        [(0, 48), (48, 24), (72, 24)]
        """
        w = self.block_widths(d)
        if len(w) == 1 or len(set(w)) == 1:
            m = self._divisible(d, size, count)
            return [(i * (size // m), size // m) for i in range(m)]
        if size % sum(w) or any((size // sum(w) * x) % count for x in w):
            raise ShardingError(f"dim {d} of size {size} is not divisible into blocks of widths {w} "
                                f"each split in {count} ({self.dims[d]})")
        unit, out, at = size // sum(w), [], 0
        for x in w:
            out.append((at, unit * x))
            at += unit * x
        return out

    # ------------------------------------------------------------ constructors
    def with_dim(self, d: int, axes: tuple[str, ...], segments: int = 1,
                 widths: tuple[int, ...] | None = None) -> "ShardSpec":
        """This spec with dim ``d`` split over ``axes`` in ``segments`` blocks (of relative
        ``widths`` when unequal; None keeps dim ``d``'s widths when the count is unchanged)."""
        dims = list(self.dims)
        segs = list(self.segments)
        dims[d] = tuple(axes)
        segs[d] = segments if axes else 1
        if widths is None:
            widths = self.widths[d] if self.widths and axes and segments == self.segments[d] else ()
        wid = list(self.widths or ((),) * len(dims))
        wid[d] = tuple(widths) if axes else ()
        return ShardSpec(dims=tuple(dims), partial=self.partial, segments=tuple(segs), widths=tuple(wid))

    def with_partial(self, partial: tuple[str, ...]) -> "ShardSpec":
        return ShardSpec(dims=self.dims, partial=tuple(partial), segments=self.segments, widths=self.widths)

    # ------------------------------------------------------- reversible slicing
    def _divisible(self, d: int, size: int, count: int) -> int:
        """Dim ``d``'s segment count, once ``size`` is known to cut into them × ``count`` blocks."""
        m = self.segments[d]
        if size % (m * count):
            raise ShardingError(
                f"dim {d} of size {size} is not divisible by {m} segment(s) × {count} shards ({self.dims[d]})")
        return m

    def block_index(self, mesh, rank: int) -> tuple[tuple[int, int] | None, ...]:
        """Per dim, ``(which block, how many blocks)`` this rank holds, or None where
        the dim is whole: the geometry :meth:`local` and :meth:`block` slice by."""
        return tuple((mesh.index(axes, rank), mesh.size(axes)) if axes else None for axes in self.dims)

    def block(self, tensor: torch.Tensor, index) -> torch.Tensor:
        """The block of the global ``tensor`` at ``index`` (from :meth:`block_index`, or
        built from group ranks at run time), as a view where possible. Each split dim
        keeps block ``i`` of ``count`` within each of its ``segments``."""
        out = tensor
        for d, at in enumerate(index):
            if at is None:
                continue
            idx, count = at
            size = out.shape[d]
            if self.widths and self.widths[d]:      # unequal blocks: this rank's part of each, glued
                out = _cat([out.narrow(d, start + idx * (w // count), w // count)
                                 for start, w in self.cuts(d, size, count)], d)
                continue
            m = self._divisible(d, size, count)
            shape = list(out.shape)
            seg = out.reshape(shape[:d] + [m, count, size // (m * count)] + shape[d + 1:])
            out = seg.select(d + 1, idx).reshape(shape[:d] + [size // count] + shape[d + 1:])
        return out

    def local(self, tensor: torch.Tensor, mesh, rank: int) -> torch.Tensor:
        """This rank's block of the global ``tensor`` (a copy, contiguous)."""
        out = self.block(tensor, self.block_index(mesh, rank))
        # always a fresh contiguous copy: a view would keep the full tensor alive behind the slice
        return out.new_empty(out.shape).copy_(out)

    def pieces(self, shape: Sequence[int], mesh, rank: int) -> Iterator[tuple[tuple[slice, ...], tuple[slice, ...]]]:
        """``rank``'s block of a tensor of global ``shape`` as rectangular pieces:
        ``(global index, local index)`` pairs of slice tuples, from :meth:`blocks` (one
        piece unless a split dim has segments), so a lazy file reader reads each piece once.

        >>> from autoshard.ir.mesh import Mesh
        >>> s = ShardSpec(dims=(("tp",),), segments=(3,))
        >>> list(s.pieces((12,), Mesh(axes=("tp",), sizes=(2,)), 1))[0]
        ((slice(2, 4, None),), (slice(0, 2, None),))
        """
        per_dim = []
        for ranges in self.blocks(tuple(shape), mesh, rank):
            runs, at = [], 0
            for lo, hi in ranges:
                runs.append((slice(lo, hi), slice(at, at + hi - lo)))
                at += hi - lo
            per_dim.append(runs)
        for combo in itertools.product(*per_dim):
            yield tuple(g for g, _ in combo), tuple(lo for _, lo in combo)

    def place(self, out: torch.Tensor, block: torch.Tensor, mesh, rank: int) -> None:
        """Inverse of :meth:`local`: write ``rank``'s ``block`` into the global tensor ``out``.

        >>> import torch
        >>> from autoshard.ir.mesh import Mesh
        >>> m, s = Mesh(axes=("tp",), sizes=(2,)), ShardSpec(dims=(("tp",),))
        >>> out = torch.zeros(4); s.place(out, torch.ones(2), m, 1); out.tolist()
        [0.0, 0.0, 1.0, 1.0]
        """
        if out.dim() == 0:
            out.copy_(block)
            return
        for gidx, lidx in self.pieces(out.shape, mesh, rank):
            out[gidx] = block[lidx]

    def assemble(self, blocks: Sequence[torch.Tensor], mesh) -> torch.Tensor:
        """Inverse of :meth:`local`: the global tensor from every rank's block (indexed by rank).

        Ranks that hold the same block must hold equal values; the lowest rank's is used."""
        ref = blocks[0]
        out = ref.new_empty([s * (mesh.size(d) if d else 1) for s, d in zip(ref.shape, self.dims)])
        for rank in self.owners(mesh):
            self.place(out, blocks[rank], mesh, rank)
        return out

    def owner(self, mesh, rank: int) -> int:
        """Lowest rank holding the same block as ``rank`` (its coordinates on the axes
        that do not split this tensor set to 0): the one that writes it once.

        >>> from autoshard.ir.mesh import Mesh
        >>> ShardSpec(dims=(("tp",),)).owner(Mesh(axes=("dp", "tp"), sizes=(2, 2)), 3)
        1
        """
        c = mesh.coords(rank)
        keep = set(self.axes)
        return mesh.rank_of({a: (c[a] if a in keep else 0) for a in mesh.axes})

    def owners(self, mesh) -> list[int]:
        """One rank per distinct block, ascending (see :meth:`owner`)."""
        return sorted({self.owner(mesh, r) for r in range(mesh.world_size)})

    # ------------------------------------------------------------------- text
    def __str__(self) -> str:
        parts = []
        for axes, m in zip(self.dims, self.segments):
            if not axes:
                parts.append("R")
            else:
                s = ",".join(axes)
                w = self.widths[len(parts)] if self.widths else ()
                parts.append(f"S({s})" if m == 1 else f"S({s})x{m}" if not w else f"S({s})x({':'.join(map(str, w))})")
        txt = "[" + ", ".join(parts) + "]"
        if self.partial:
            txt += " P(" + ",".join(self.partial) + ")"
        return txt

    __repr__ = __str__

    def to_dict(self) -> dict:
        out = {"dims": [list(d) for d in self.dims], "partial": list(self.partial),
               "segments": list(self.segments)}
        if self.widths:
            out["widths"] = [list(w) for w in self.widths]
        return out

    @classmethod
    def from_dict(cls, d: dict) -> "ShardSpec":
        return cls(dims=tuple(tuple(x) for x in d["dims"]), partial=tuple(d["partial"]),
                   segments=tuple(d["segments"]), widths=tuple(tuple(w) for w in d.get("widths", ())))


def regroup(t, dim: int, widths, p: int, *, rank_major: bool):
    """Reorder dim ``dim`` of ``t``, made of blocks of relative ``widths`` each cut in ``p``
    parts, from block-major (``[q_0 q_1 | k_0 k_1 | ..]``, the dense layout) to rank-major
    (``[q_0 k_0 .. | q_1 k_1 ..]``, what a gather over ranks returns), or back.

    >>> import torch
    >>> regroup(torch.arange(6), 0, (2, 1), 2, rank_major=False).tolist()     # [q0 k0 | q1 k1] -> [q | k]
    [0, 1, 3, 4, 2, 5]
    """
    unit = t.shape[dim] // sum(widths)
    if rank_major:
        parts = [blk.chunk(p, dim) for blk in t.split([unit * w for w in widths], dim)]
        return _cat([parts[i][r] for r in range(p) for i in range(len(widths))], dim)
    per = [unit * w // p for w in widths]
    ranks = [c.split(per, dim) for c in t.chunk(p, dim)]
    return _cat([ranks[r][i] for i in range(len(widths)) for r in range(p)], dim)


def _cat(parts, dim: int):
    """``torch.cat`` (torch imported where a tensor is already at hand: the module stays light)."""
    import torch

    return torch.cat(parts, dim)


_REPLICATED: dict[int, ShardSpec] = {}


def replicated(ndim: int) -> ShardSpec:
    """The spec of a tensor held whole on every rank (one frozen object per rank count: the
    walk asks for it at every node)."""
    s = _REPLICATED.get(ndim)
    if s is None:
        s = _REPLICATED[ndim] = ShardSpec(dims=((),) * ndim)
    return s
