"""2D (SUMMA, as in Optimus) and 2.5D (Tesseract, Algorithm 3) tensor parallelism.

Mesh ``dep[d] × row[q] × col[q]`` (``d = 1`` is exactly 2D). Activations are
``[tokens / (d·q) over (dep,row), hidden / q over col]``; a Linear ``Y = X·W``
keeps that layout with ``W`` split ``[k / q over row, n / q over col]`` and
replicated over depth::

    Y_ij = Σ_l X_il · W_lj   (all-gather X over col, W over row; backward
                              reduce-scatters dX over col and dW over row)

Gradients of depth-replicated parameters are all-reduced over ``dep`` (the
propagate pass derives that from the specs). Embedding tables are split on
hidden over ``col``; a Linear that reuses such a table (tied LM head) computes
``X·Eᵀ`` partial over ``col`` and reduce-scatters it on the vocabulary. Block shapes
and formulas: docs/design.md, "2d" and "2.5d".

>>> from autoshard.policies import make_policy
>>> make_policy("2.5d", 8, depth=2).batch_axes
('dep', 'row')
"""

from __future__ import annotations

import math

from autoshard.ir.argpath import get_arg
from autoshard.ir.errors import ConfigError
from autoshard.ir.grouped import grouped_linear
from autoshard.ir.kernels import Summa
from autoshard.ir.mesh import Mesh
from autoshard.ir.spec import ShardSpec

from .base import Choice, Policy, RuleContext
from .ops.matmul import grouped_offs_spec, linear_operands, rows_whole, tied_head_choice

__all__ = ["Tesseract", "TwoD"]


def _valid_25d(world: int) -> list[tuple[int, int]]:
    out = []
    for q in range(1, int(math.isqrt(world)) + 1):
        if world % (q * q) == 0:
            out.append((q, world // (q * q)))
    return out


class Tesseract(Policy):
    """2.5D (Tesseract) tensor parallelism: ``d`` layers of a ``q × q`` SUMMA grid on a
    mesh ``dep[d] × row[q] × col[q]``; tokens split over ``(dep, row)``, features over
    ``col``, weights ``[k/q over row, n/q over col]`` replicated over ``dep``.

    >>> p = Tesseract(Tesseract.make_mesh(8, depth=2))
    >>> p.mesh, p.label(p.mesh), (p.q, p.d)
    (Mesh(axes=('dep', 'row', 'col'), sizes=(2, 2, 2)), '2.5d [2,2,2]', (2, 2))
    >>> p.batch_split()
    (4, '2.5d splits the batch over dep[2]·row[2]')
    """

    name = "2.5d"
    order = 2
    size_unit = "q² per depth layer (world d·q²)"

    def __init__(self, mesh: Mesh):
        super().__init__(mesh)
        self.q = mesh.size("row")
        self.d = mesh.size("dep") if "dep" in mesh.axes else 1
        self.row, self.col = ("row",), ("col",)
        self.batch_axes = ("dep", "row") if "dep" in mesh.axes else ("row",)
        self.tp_axes = tuple(a for a in mesh.axes if a not in ("dp", "cp"))

    @classmethod
    def make_mesh(cls, world_size: int, *, depth: int | None = None, dp: int = 1) -> Mesh:
        """``dep[d] × row[q] × col[q]`` with ``world_size / dp = d·q²`` and ``q ≥ 2``.

        >>> Tesseract.make_mesh(8, depth=8)
        Traceback (most recent call last):
        ...
        autoshard.ir.errors.ConfigError: 2.5d needs world_size = d·q² with q ≥ 2; 8 ranks with depth=8 do not fit; 8 ranks allow (q=2,d=2)

        Raises:
            ConfigError: no ``depth``, or one that leaves no square ``q² ≥ 4``; the message lists the valid choices.
        """
        tp = cls._check_dp(world_size, dp)
        valid = [(q, d) for q, d in _valid_25d(tp) if q > 1]
        if depth is None:
            raise ConfigError(f"2.5d needs depth=d with world_size = d·q²; {tp} ranks allow "
                              + (", ".join(f"(q={q},d={d})" for q, d in valid) or "no (q>1, d)"))
        q2, r = divmod(tp, depth) if depth > 0 else (0, 1)
        q = math.isqrt(q2) if q2 > 0 else 0
        if depth < 1 or r or q * q != q2 or q < 2:
            raise ConfigError(f"2.5d needs world_size = d·q² with q ≥ 2; {tp} ranks with depth={depth} do not fit; "
                              f"{tp} ranks allow " + (", ".join(f"(q={q},d={d})" for q, d in valid) or "none"))
        axes, sizes = ["dep", "row", "col"], [depth, q, q]
        if dp > 1:
            axes, sizes = ["dp"] + axes, [dp] + sizes
        return Mesh(axes=tuple(axes), sizes=tuple(sizes))

    def dim_splits(self) -> tuple[dict[str, int], str]:
        """Heads, kv heads, hidden, intermediate size and vocabulary each split ``q`` ways."""
        return dict.fromkeys(("num_attention_heads", "num_key_value_heads", "hidden_size", "intermediate_size",
                              "vocab_size"), self.q), f"q={self.q}"

    def width_multiple(self) -> int:
        """``q``: heads and Linear widths split over ``col`` are padded to it (docs/design.md,
        "Uneven widths"); the hidden size, which the activations between the Linears split, is not."""
        return self.q

    @classmethod
    def label(cls, mesh: Mesh) -> str:
        """Tesseract's own notation ``[q,q,d]`` (``[q,q]`` for 2d)."""
        q, d = cls.grid(mesh)
        dp = mesh.dp
        grid = [q, q] + ([d] if cls.name == "2.5d" else [])
        return f"{cls.name} [{','.join(map(str, grid))}]" + (f" × dp{dp}" if dp > 1 else "")

    @classmethod
    def valid_world_sizes(cls, n: int, limit: int = 4096) -> list[int]:
        """The grid sizes ``q²`` (``q ≥ 2``, ``q²`` up to ``limit``) whose ``q`` divides ``n``;
        a 2.5D world is ``d`` times one of them.

        >>> Tesseract.valid_world_sizes(12, limit=64)
        [4, 9, 16, 36]
        """
        return [q * q for q in range(2, int(limit ** 0.5) + 1) if n % q == 0]

    # ------------------------------------------------------------------ linear
    def linear(self, ctx: RuleContext) -> Choice:
        """SUMMA (:class:`~autoshard.ir.kernels.Summa`): input ``[rows, k/q over col]``,
        weight ``[k/q over row, n/q over col]``, output in the input's layout; a weight
        tied to a hidden-split table runs as a partial head; replicated when the
        features do not divide ``q`` or a re-plan asked for it."""
        node = ctx.node
        xp, wp, bp, nd, kd = linear_operands(node)
        x, w = get_arg(node, xp), get_arg(node, wp)
        sx = ctx.spec(x)
        n, k = ctx.pshape(w)[nd], ctx.pshape(w)[kd]
        q, C, R = self.q, self.col, self.row
        fixed = ctx.fixed_param_spec(w)
        rows, rseg = sx.dims[:-1], sx.segments[:-1]

        grouped = node.target is grouped_linear
        offs = {(2,): grouped_offs_spec(self.mesh, rows[0] if rows else ())} if grouped else {}

        def wspec(n_axes=(), k_axes=(), m=1, widths=()):
            d, sg = [()] * ctx.pshape(w).__len__(), [1] * ctx.pshape(w).__len__()   # [E, n, k] keeps E whole
            d[nd], d[kd] = n_axes, k_axes
            sg[nd] = m if n_axes else 1
            wd = [()] * len(d)
            wd[nd] = widths if n_axes else ()
            return ShardSpec(dims=tuple(d), segments=tuple(sg), widths=tuple(wd))

        if ctx.forced_replicate(node) or (fixed is not None and fixed.is_replicated) or k % q:
            req = ShardSpec(dims=rows + ((),), segments=rseg + (1,))
            ins = {xp: req, wp: wspec(), **offs}
            if bp:
                ins[bp] = ShardSpec(dims=((),))
            return Choice(out=req, inputs=ins, weight="replicated", notes=(_whole_note(ctx, node, w, fixed, k, q),))
        if fixed is not None and fixed.dims[nd] == () and fixed.dims[kd] == C:
            return self._tied_head(ctx, xp, wp, bp, rows, rseg, wspec((), C), n)
        m = ctx.output_segments(node)
        # fused blocks of unequal widths (Phi-3's q, k, v): split per block where each divides q
        wd = ctx.output_block_widths(node) if m == 1 else ()
        wd = wd if wd and all(x % q == 0 for x in wd) else ()
        m = len(wd) or m
        if not wd and n % (q * m):
            m = 1
        if n % q:
            return self._tied_like_fallback(ctx, xp, wp, bp, rows, rseg, wspec, offs)
        xreq = ShardSpec(dims=rows + (C,), segments=rseg + (1,))
        ins = [(xp, xreq), (wp, wspec(C, R, m, wd)), *offs.items()]
        if bp:
            ins.append((bp, ShardSpec(dims=(C,), segments=(m,), widths=(wd,))))
        out = ShardSpec(dims=rows + (C,), segments=rseg + (m,), widths=((),) * len(rows) + (wd,))
        whole = rows_whole(rows, R)
        k = Summa(row=R, col=C, x=xp, w=wp, b=bp, n_dim=nd, k_dim=kd, in_specs=tuple(ins), out_spec=out,
                  rows_whole=whole, **(dict(offs=(2,), impl=node.args[4]) if grouped else {}))
        return Choice.run(k, weight=f"[k/{q} over row, n/{q} over col]" + (f", fused blocks of widths {wd}" if wd else f", {m} fused blocks" if m > 1 else "")
                          + (", replicated over dep" if self.d > 1 else ""),
                          notes=("rows whole over row: every row of the grid computes all rows",) if whole else ())

    def _tied_head(self, ctx, xp, wp, bp, rows, rseg, ws, n):
        return tied_head_choice(ctx, xp, wp, bp, rows, rseg, self.col, ws, self.q)

    def _tied_like_fallback(self, ctx, xp, wp, bp, rows, rseg, wspec, offs):
        req = ShardSpec(dims=rows + ((),), segments=rseg + (1,))
        ins = {xp: req, wp: wspec(), **offs}
        if bp:
            ins[bp] = ShardSpec(dims=((),))
        n = ctx.pshape(get_arg(ctx.node, wp))[linear_operands(ctx.node)[3]]
        return Choice(out=req, inputs=ins, weight="replicated",
                      notes=(f"whole: {n} out features do not divide q {self.q}",))

    # --------------------------------------------------------------- embedding
    def embedding(self, ctx: RuleContext) -> Choice:
        """The table split ``[vocab, hidden/q over col]`` (a local lookup, no collective)
        when hidden divides ``q``; replicated otherwise."""
        node = ctx.node
        w, ids = node.args[0], node.args[1]
        si = ctx.spec(ids)
        V, h = ctx.pshape(w)
        fixed = ctx.fixed_param_spec(w)
        C = self.col
        if (fixed is None and h % self.q == 0) or (fixed is not None and fixed.dims == ((), C)):
            return Choice(out=ShardSpec(dims=si.dims + (C,)), inputs={(0,): ShardSpec(dims=((), C)), (1,): si},
                          weight=f"[vocab, hidden/{self.q} over col]")
        why = (f"whole: its table `{w.target}` is held as {fixed} by an earlier use" if fixed is not None
               else f"whole: hidden {h} does not divide q {self.q}")
        return Choice(out=ShardSpec(dims=si.dims + ((),)), inputs={(0,): ShardSpec(dims=((), ())), (1,): si},
                      weight="replicated", notes=(why,))


def _whole_note(ctx: RuleContext, node, w, fixed, k: int, q: int) -> str:
    """Why a SUMMA Linear holds its weight whole: a re-plan, a shared weight held whole,
    or in features that do not divide the grid side ``q``."""
    if ctx.forced_replicate(node):
        return "whole: " + (ctx.forced_reason(node) or "its out-feature split could not pass a later op")
    if fixed is not None and fixed.is_replicated:
        return f"whole: its weight `{w.target}` is held whole by an earlier use (a shared weight)"
    return f"whole: {k} in features do not divide q {q}"


class TwoD(Tesseract):
    """2D (SUMMA) tensor parallelism: :class:`Tesseract` with depth 1 on a mesh
    ``row[q] × col[q]``.

    >>> p = TwoD(TwoD.make_mesh(4))
    >>> p.mesh, p.label(p.mesh), p.tp_axes, p.batch_axes
    (Mesh(axes=('row', 'col'), sizes=(2, 2)), '2d [2,2]', ('row', 'col'), ('row',))
    """

    name = "2d"
    order = 1
    size_unit = "world sizes q²"

    @classmethod
    def make_mesh(cls, world_size: int, *, depth: int | None = None, dp: int = 1) -> Mesh:
        """``row[q] × col[q]`` with ``world_size / dp = q²`` and ``q ≥ 2``.

        >>> TwoD.make_mesh(8)
        Traceback (most recent call last):
        ...
        autoshard.ir.errors.ConfigError: 2d needs a square world size q² (q ≥ 2); got 8. Nearest valid: 4, 9, 16

        Raises:
            ConfigError: a world size that is not a square, or a ``depth`` other than 1; the message lists the valid choices.
        """
        tp = cls._check_dp(world_size, dp)
        q = math.isqrt(tp)
        if depth not in (None, 1):
            raise ConfigError(f"2d has depth 1 (got depth={depth}); use mode='2.5d' for depth > 1")
        if q * q != tp or q < 2:
            squares = [s * s for s in range(2, 65)]
            near = sorted(squares, key=lambda s: abs(s - tp))[:3]
            raise ConfigError(f"2d needs a square world size q² (q ≥ 2); got {tp}. Nearest valid: "
                              f"{', '.join(map(str, sorted(near)))}")
        axes, sizes = ["row", "col"], [q, q]
        if dp > 1:
            axes, sizes = ["dp"] + axes, [dp] + sizes
        return Mesh(axes=tuple(axes), sizes=tuple(sizes))
