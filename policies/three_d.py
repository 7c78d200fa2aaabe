"""3D tensor parallelism (the 3D paper's layouts X_ijl / W_lji): ``P = q³`` ranks on a mesh ``x[q] × y[q] × z[q]``.

For ``Y = X·W`` with rank ``(i, j, l)`` on ``(x, y, z)``: ``X_ijl`` holds token rows
block ``(i, j)`` and feature columns block ``l``; ``W_lji`` holds ``k`` block ``l``
and ``n`` block ``(j, i)``. Forward all-gathers X over ``y`` and W over ``x``,
multiplies, and reduce-scatters over ``z``; the output ``Y_ijl`` has rows
``(i, l)`` and columns ``j``. Backward all-gathers ``dY`` and reduce-scatters ``dX``
and ``dW``. In axis terms, with the input laid out rows ``(A, B)`` / columns ``C``::

    X [rows (A,B), k (C)] · W [k (C), n (B,A)]  →  Y [rows (A,C), n (B)]

so the next Linear sees the roles of ``B`` and ``C`` swapped; the pass simply
reads the incoming layout, and a Linear pair (QKV → out, up → down) lands back
on the residual stream's layout. Nothing here is named after a layer. Block shapes
and formulas: docs/design.md, "3d".

>>> from autoshard.policies import make_policy
>>> make_policy("3d", 8).mesh
Mesh(axes=('x', 'y', 'z'), sizes=(2, 2, 2))
"""

from __future__ import annotations

from autoshard.ir.argpath import get_arg
from autoshard.ir.errors import ConfigError
from autoshard.ir.grouped import grouped_linear
from autoshard.ir.kernels import Summa, ThreeDLinear
from autoshard.ir.mesh import Mesh
from autoshard.ir.spec import ShardSpec

from .base import Choice, Policy, RuleContext
from .ops.matmul import grouped_offs_spec, linear_operands, rows_whole, tied_head_choice

__all__ = ["ThreeD"]

_AXES = ("x", "y", "z")


class ThreeD(Policy):
    """3D tensor parallelism on a mesh ``x[q] × y[q] × z[q]``: token rows split over two
    axes, features over the third, every weight split ``q³`` ways with no replica
    (:class:`~autoshard.ir.kernels.ThreeDLinear`).

    >>> p = ThreeD(ThreeD.make_mesh(8))
    >>> p.label(p.mesh), p.batch_axes, p.vocab_multiple()
    ('3d [2,2,2]', ('x', 'y'), 4)
    """

    name = "3d"
    order = 3
    size_unit = "world sizes q³"
    tp_axes = _AXES
    composes_with_cp = False
    composes_with_cp_why = ("its token rows move between the axes from one Linear to the next (3d's swapped roles), "
                            "which the sequence split on cp does not follow yet: at 16 ranks the plan's traced local "
                            "shapes disagreed with its specs, so the plan is refused rather than run")
    batch_axes = ("x", "y")

    def __init__(self, mesh: Mesh):
        super().__init__(mesh)
        self.q = mesh.size("x")

    @classmethod
    def make_mesh(cls, world_size: int, *, depth: int | None = None, dp: int = 1) -> Mesh:
        """``x[q] × y[q] × z[q]`` with ``world_size / dp = q³`` and ``q ≥ 2``.

        Raises:
            ConfigError: a world size that is not a cube, or a ``depth`` other than 1; the message lists the valid choices.
        """
        if depth not in (None, 1):
            raise ConfigError(f"3d takes no depth (got depth={depth}); depth belongs to mode='2.5d'")
        tp = cls._check_dp(world_size, dp)
        q = round(tp ** (1 / 3))
        if q ** 3 != tp or q < 2:
            cubes = [c ** 3 for c in range(2, 17)]
            near = sorted(sorted(cubes, key=lambda c: abs(c - tp))[:2])
            raise ConfigError(f"3d needs a cube world size q³ (q ≥ 2); got {tp}. Nearest valid: "
                              + ", ".join(map(str, near)))
        axes, sizes = list(_AXES), [q, q, q]
        if dp > 1:
            axes, sizes = ["dp"] + axes, [dp] + sizes
        return Mesh(axes=tuple(axes), sizes=tuple(sizes))

    def dim_splits(self) -> tuple[dict[str, int], str]:
        """Heads, hidden, intermediate size and vocabulary split ``q`` ways (kv heads whole)."""
        return dict.fromkeys(("num_attention_heads", "hidden_size", "intermediate_size", "vocab_size"),
                             self.q), f"q={self.q}"

    def width_multiple(self) -> int:
        """``q``: heads and Linear widths the cube does not divide are padded with zero units
        (docs/design.md, "Uneven widths"); the activations split them ``q`` ways."""
        return self.q

    def width_storage(self) -> int:
        """``q²``: a Linear's out features are stored split over two axes (``n/q²``)."""
        return self.q * self.q

    def vocab_multiple(self) -> int:
        """``q²``: an untied LM head splits its output features (the vocabulary) over two axes."""
        return self.q * self.q          # an untied head splits its output features over q²

    @classmethod
    def valid_world_sizes(cls, n: int, limit: int = 4096) -> list[int]:
        """The cubes ``q³`` (``q ≥ 2``, up to ``limit``) whose ``q`` divides ``n``.

        >>> ThreeD.valid_world_sizes(12, limit=1000)
        [8, 27, 64, 216]
        """
        return [q ** 3 for q in range(2, int(round(limit ** (1 / 3))) + 1) if n % q == 0]

    # ------------------------------------------------------------------ linear
    def _roles(self, sx: ShardSpec):
        """(row dim, outer axes, A, B, C) of an input in a 3D layout, or the canonical
        one. Outer axes (a data-parallel ``dp``) stay in front of the row split."""
        outer = tuple(a for a in self.mesh.axes if a not in _AXES)
        split_rows = [(d, tuple(x for x in a if x not in outer)) for d, a in enumerate(sx.dims[:-1])
                      if set(a) - set(outer)]
        if len(split_rows) == 1 and len(split_rows[0][1]) == 2 and len(sx.dims[-1]) == 1:
            d, (A, B) = split_rows[0]
            C = sx.dims[-1][0]
            if {A, B, C} == set(_AXES):
                return d, outer, A, B, C
        return 0, outer, "x", "y", "z"

    def linear(self, ctx: RuleContext) -> Choice:
        """The 3D Linear on the incoming layout ``X [rows (A,B), k (C)]``: W split
        ``[k/q over C, n/q² over (B,A)]``, output ``[rows (A,C), n (B)]``; a grouped
        (per-expert) Linear runs SUMMA on the ``(A,B) × C`` grid; a weight tied to a
        hidden-split table runs as a partial head; replicated when the features do not
        divide ``q`` / ``q²``."""
        node = ctx.node
        xp, wp, bp, nd, kd = linear_operands(node)
        x, w = get_arg(node, xp), get_arg(node, wp)
        sx = ctx.spec(x).with_partial(())
        n, k = ctx.pshape(w)[nd], ctx.pshape(w)[kd]
        q = self.q
        fixed = ctx.fixed_param_spec(w)
        nrow = sx.ndim - 1

        def wspec(n_axes=(), k_axes=(), m=1):
            d, sg = [()] * len(ctx.pshape(w)), [1] * len(ctx.pshape(w))     # [E, n, k] keeps E whole
            d[nd], d[kd] = n_axes, k_axes
            sg[nd] = m if n_axes else 1
            return ShardSpec(dims=tuple(d), segments=tuple(sg))

        rd, outer, A, B, C = self._roles(sx)
        if fixed is not None and fixed.dims[nd] == () and len(fixed.dims[kd]) == 1:
            return self._tied_head(ctx, xp, wp, bp, sx, wspec((), fixed.dims[kd]), fixed.dims[kd][0])
        m = ctx.output_segments(node)
        if n % (q * q * m):
            m = 1
        grouped = node.target is grouped_linear
        # the plan keeps the batch whole (a static batch): the rows stay whole, SUMMA on (A,B) × C
        kept = not ctx.batch_axes and not {a for d in sx.dims[:-1] for a in d} & set(_AXES)
        if grouped or kept:
            m = ctx.output_segments(node)
            m = m if n % (q * m) == 0 else 1
        if ctx.forced_replicate(node) or (fixed is not None and fixed.is_replicated) or \
                (k % (q * q) or n % q if grouped or kept else k % q or n % (q * q)):
            rows = sx.dims[:-1] if kept else tuple(outer + (A, B) if i == rd else () for i in range(nrow))
            req = ShardSpec(dims=rows + ((),))
            ins = {xp: req, wp: wspec()}
            if grouped:
                ins[(2,)] = grouped_offs_spec(self.mesh, rows[rd])
            if bp:
                ins[bp] = ShardSpec(dims=((),))
            return Choice(out=req, inputs=ins, weight="replicated",
                          notes=(_whole_note(ctx, node, w, fixed, n, k, q, grouped or kept),))
        rows_in = tuple(outer + (A, B) if i == rd else () for i in range(nrow))
        if kept:
            return self._grouped(ctx, node, xp, wp, sx.dims[:-1], wspec, m, A, B, C, grouped)
        if grouped:
            return self._grouped(ctx, node, xp, wp, rows_in, wspec, m, A, B, C)
        rows_out = tuple(outer + (A, C) if i == rd else () for i in range(nrow))
        xreq = ShardSpec(dims=rows_in + ((C,),))
        ins = [(xp, xreq), (wp, wspec((B, A), (C,), m))]
        if bp:
            ins.append((bp, ShardSpec(dims=((B,),), segments=(m,))))
        out = ShardSpec(dims=rows_out + ((B,),), segments=(1,) * nrow + (m,))
        k = ThreeDLinear(a=(A,), b_axes=(B,), c=(C,), x=xp, w=wp, b=bp, row_dim=rd, n_dim=nd, segments=m,
                         in_specs=tuple(ins), out_spec=out)
        return Choice.run(k, weight=f"[k/{q} over {C}, n/{q * q} over ({B},{A})]"
                          + (f", {m} fused blocks" if m > 1 else ""),
                          notes=(f"rows ({A},{B})→({A},{C}), features {C}→{B}",))

    def _grouped(self, ctx, node, xp, wp, rows, wspec, m, A, B, C, grouped=True):
        """A grouped (per-expert) Linear keeps its rows where they are: they are the
        rank's tokens sorted by expert, a rank-local order that the 3D swap of the row
        axes would mix. SUMMA on the ``(A,B) × C`` grid keeps them: X gathered over
        ``C``, W (``k`` over ``(A,B)``, ``n`` over ``C``: still split q³ ways) gathered
        over ``(A,B)``; the output has the input's layout. So does any Linear whose rows
        the plan keeps whole (``grouped=False``: a static batch, never split), with dW
        kept as a block rather than summed over ``(A,B)``."""
        q = self.q
        _, _, bp, nd, kd = linear_operands(node)
        xreq = ShardSpec(dims=rows + ((C,),))
        ins = [(xp, xreq), (wp, wspec((C,), (A, B), m))]
        if grouped:
            ins.append(((2,), grouped_offs_spec(self.mesh, rows[0])))
        elif bp:
            ins.append((bp, ShardSpec(dims=((C,),), segments=(m,))))
        out = ShardSpec(dims=rows + ((C,),), segments=(1,) * len(rows) + (m,))
        kern = Summa(row=(A, B), col=(C,), x=xp, w=wp, b=None if grouped else bp, n_dim=nd, k_dim=kd,
                     in_specs=tuple(ins), out_spec=out, rows_whole=rows_whole(rows, (A, B)),
                     **(dict(offs=(2,), impl=node.args[4]) if grouped else {}))
        return Choice.run(kern, weight=f"[k/{q * q} over ({A},{B}), n/{q} over {C}]" + (" per expert" if grouped else "")
                          + (f", {m} fused blocks" if m > 1 else ""),
                          notes=("grouped: rows stay in the rank's sorted order",) if grouped else
                          (f"rows whole over ({A},{B}): the plan keeps the batch whole",))

    def _tied_head(self, ctx, xp, wp, bp, sx, ws, C):
        rows = tuple(tuple(a for a in d if a != C) for d in sx.dims[:-1])
        return tied_head_choice(ctx, xp, wp, bp, rows, (1,) * len(rows), (C,), ws, self.q)

    # --------------------------------------------------------------- embedding
    def embedding(self, ctx: RuleContext) -> Choice:
        """The table split on hidden over the one axis the ids' rows do not use (a local
        lookup, no collective); replicated when hidden does not divide ``q``."""
        node = ctx.node
        w, ids = node.args[0], node.args[1]
        si = ctx.spec(ids)
        V, h = ctx.pshape(w)
        fixed = ctx.fixed_param_spec(w)
        used = set(si.axes)
        C = next((a for a in ("z", "y", "x") if a not in used), None)
        if fixed is not None and fixed.dims[0] == () and len(fixed.dims[1]) == 1 and fixed.dims[1][0] not in used:
            C = fixed.dims[1][0]
        if C is not None and h % self.q == 0 and (fixed is None or fixed.dims == ((), (C,))):
            return Choice(out=ShardSpec(dims=si.dims + ((C,),)), inputs={(0,): ShardSpec(dims=((), (C,))), (1,): si},
                          weight=f"[vocab, hidden/{self.q} over {C}]")
        if C is None:
            why = "whole: the ids' split uses every axis that could split the hidden dim"
        elif h % self.q:
            why = f"whole: hidden {h} does not divide q {self.q}"
        else:
            why = f"whole: its table `{w.target}` is held as {fixed} by an earlier use"
        return Choice(out=ShardSpec(dims=si.dims + ((),)), inputs={(0,): ShardSpec(dims=((), ())), (1,): si},
                      weight="replicated", notes=(why,))


def _whole_note(ctx: RuleContext, node, w, fixed, n: int, k: int, q: int, grouped: bool) -> str:
    """Why a 3D Linear holds its weight whole: a re-plan, a shared weight held whole, or
    features that do not divide the cube's splits (``k`` by q, ``n`` by q²; a per-expert
    Linear the other way round)."""
    if ctx.forced_replicate(node):
        return "whole: " + (ctx.forced_reason(node) or "its out-feature split could not pass a later op")
    if fixed is not None and fixed.is_replicated:
        return f"whole: its weight `{w.target}` is held whole by an earlier use (a shared weight)"
    kq, nq = (q * q, q) if grouped else (q, q * q)
    why = ([f"{k} in features do not divide {kq}"] if k % kq else []) + \
        ([f"{n} out features do not divide {nq}"] if n % nq else [])
    return "whole: " + ("; ".join(why) or "no split of its features fits")
