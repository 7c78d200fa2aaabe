"""Named device meshes. Pure data: nothing here touches ``torch.distributed``.

A mesh is an ordered list of named axes. Rank ``r`` has one coordinate per axis;
the first axis is the outermost (slowest varying), the last the innermost::

    >>> m = Mesh(axes=("dep", "row", "col"), sizes=(2, 2, 2))
    >>> m.coords(5)
    {'dep': 1, 'row': 0, 'col': 1}
    >>> m.rank_of({'dep': 1, 'row': 0, 'col': 1})
    5
    >>> m.group_ranks(("row",), 5)
    (5, 7)
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

from .errors import ConfigError

__all__ = ["Mesh"]


@functools.lru_cache(maxsize=1 << 14)
def _size(names: tuple[str, ...], sizes: tuple[int, ...], axes: tuple[str, ...]) -> int:
    """:meth:`Mesh.size`, remembered: planning asks it hundreds of thousands of times."""
    return math.prod(sizes[names.index(a)] for a in axes)


@dataclass(frozen=True, kw_only=True)
class Mesh:
    """An n-dimensional grid of ranks with named axes (outermost first)."""

    axes: tuple[str, ...]
    sizes: tuple[int, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "axes", tuple(self.axes))
        object.__setattr__(self, "sizes", tuple(int(s) for s in self.sizes))
        if len(self.axes) != len(self.sizes):
            raise ConfigError(f"mesh axes {self.axes} and sizes {self.sizes} differ in length")
        if len(set(self.axes)) != len(self.axes):
            raise ConfigError(f"mesh axis names repeat: {self.axes}")
        if any(s < 1 for s in self.sizes):
            raise ConfigError(f"mesh sizes must be >= 1, got {self.sizes}")

    @property
    def world_size(self) -> int:
        return math.prod(self.sizes)

    @property
    def dp(self) -> int:
        """Data-parallel replicas: the size of the ``dp`` axis, 1 without one."""
        return self.size("dp") if "dp" in self.axes else 1

    @property
    def cp(self) -> int:
        """Context-parallel ranks: the size of the ``cp`` axis, 1 without one."""
        return self.size("cp") if "cp" in self.axes else 1

    def size(self, axes: str | tuple[str, ...]) -> int:
        """Number of ranks spanned by one axis or a tuple of axes."""
        return _size(self.axes, self.sizes, (axes,) if isinstance(axes, str) else tuple(axes))

    def coords(self, rank: int) -> dict[str, int]:
        out: dict[str, int] = {}
        for name, size in zip(reversed(self.axes), reversed(self.sizes)):
            out[name] = rank % size
            rank //= size
        return {a: out[a] for a in self.axes}

    def rank_of(self, coords: dict[str, int]) -> int:
        rank = 0
        for name, size in zip(self.axes, self.sizes):
            rank = rank * size + coords[name]
        return rank

    def index(self, axes: tuple[str, ...], rank: int) -> int:
        """Block index of ``rank`` along ``axes`` (first axis most significant)."""
        c = self.coords(rank)
        idx = 0
        for a in axes:
            idx = idx * self.size(a) + c[a]
        return idx

    def group_ranks(self, axes: tuple[str, ...], rank: int) -> tuple[int, ...]:
        """Ranks that share ``rank``'s coordinates on every axis not in ``axes``,
        ordered by their block index along ``axes``."""
        base = self.coords(rank)
        out = []
        for i in range(self.size(axes)):
            c = dict(base)
            rem = i
            for a in reversed(axes):
                c[a] = rem % self.size(a)
                rem //= self.size(a)
            out.append(self.rank_of(c))
        return tuple(out)

    def all_groups(self, axes: tuple[str, ...]) -> list[tuple[int, ...]]:
        """Every group along ``axes``, in a rank-independent order (for ``new_group``)."""
        seen: dict[tuple[int, ...], None] = {}
        for r in range(self.world_size):
            seen.setdefault(self.group_ranks(axes, r), None)
        return list(seen)

    def across_nodes(self, node_size: int) -> dict[str, bool]:
        """For each axis, whether its groups span more than one node, when ranks fill
        nodes of ``node_size`` in order (torchrun's ``LOCAL_WORLD_SIZE``). The outermost
        axes cross first, so ``dp`` (outermost) goes across nodes and TP stays inside.

            >>> Mesh(axes=("dp", "tp"), sizes=(2, 2)).across_nodes(2)
            {'dp': True, 'tp': False}
        """
        if node_size < 1:
            raise ConfigError(f"node size must be >= 1, got {node_size}")
        return {a: any(len({r // node_size for r in g}) > 1 for g in self.all_groups((a,))) for a in self.axes}

    def placement(self, node_size: int | None) -> str:
        """``"2 nodes × 2 ranks · inside a node: tp · across nodes: dp"``, or ``""`` on one node.

            >>> Mesh(axes=("dp", "tp"), sizes=(2, 2)).placement(2)
            '2 nodes × 2 ranks · inside a node: tp · across nodes: dp'
        """
        if not node_size or node_size >= self.world_size or self.world_size % node_size:
            return ""
        cross = self.across_nodes(node_size)
        inside = [a for a, c in cross.items() if not c]
        across = [a for a, c in cross.items() if c]
        return (f"{self.world_size // node_size} nodes × {node_size} ranks · inside a node: "
                f"{', '.join(inside) or '-'} · across nodes: {', '.join(across) or '-'}")

    def to_dict(self) -> dict:
        return {"axes": list(self.axes), "sizes": list(self.sizes)}

    @classmethod
    def from_dict(cls, d: dict) -> "Mesh":
        return cls(axes=tuple(d["axes"]), sizes=tuple(d["sizes"]))

    def __str__(self) -> str:
        return " × ".join(f"{a}[{s}]" for a, s in zip(self.axes, self.sizes))
