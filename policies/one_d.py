"""1D tensor parallelism (Megatron): column / row pairs found from the graph.

A Linear whose input is replicated and whose output flows (through pointwise,
view and attention ops) into another Linear, the loss or the graph output is
column-parallel; a Linear whose input arrives split on its features is
row-parallel and all-reduces its output. The largest embedding table is
vocab-parallel; a weight tied to it keeps its vocab split (the LM head is then
column-parallel and the loss vocab-parallel).
"""

from __future__ import annotations

from autoshard.errors import ConfigError
from autoshard.mesh import Mesh
from autoshard.spec import ShardSpec

from .base import Choice, KComm, Policy
from .linear_ops import linear_operands

__all__ = ["OneD"]


def _at(node, path):
    a = node.args[path[0]] if path[0] != "kw" else node.kwargs[path[1]]
    return a if len(path) == 1 or path[0] == "kw" else a[path[1]]


class OneD(Policy):
    name = "1d"
    tp_axes = ("tp",)
    batch_axes = ()

    @classmethod
    def make_mesh(cls, world_size: int, *, depth: int | None = None, dp: int = 1) -> Mesh:
        if depth not in (None, 1):
            raise ConfigError(f"1d takes no depth (got depth={depth}); depth belongs to mode='2.5d'")
        tp = cls._check_dp(world_size, dp)
        if dp > 1:
            return Mesh(axes=("dp", "tp"), sizes=(dp, tp))
        return Mesh(axes=("tp",), sizes=(tp,))

    # ------------------------------------------------------------------ linear
    def linear(self, ctx) -> Choice:
        node = ctx.node
        xp, wp, bp, nd, kd = linear_operands(node)
        x, w = _at(node, xp), _at(node, wp)
        sx = ctx.spec(x).with_partial(())
        wshape = ctx.pshape(w)
        n, k = wshape[nd], wshape[kd]
        tp = self.tp_axes
        c = self.mesh.size(tp)
        fixed = ctx.fixed_param_spec(w)
        rows = sx.dims[:-1]
        rseg = sx.segments[:-1]

        def wspec(n_axes=(), k_axes=(), m=1):
            d = [(), ()]
            sg = [1, 1]
            d[nd], d[kd] = n_axes, k_axes
            sg[nd] = m if n_axes else 1
            return ShardSpec(dims=tuple(d), segments=tuple(sg))

        def local(note=""):
            req = ShardSpec(dims=rows + ((),), segments=rseg + (1,))
            ins = {xp: req, wp: wspec()}
            if bp:
                ins[bp] = ShardSpec(dims=((),))
            return Choice(out=req, inputs=ins, weight="replicated", notes=(note,) if note else ())

        if c == 1 or ctx.forced_replicate(node):
            return local("replicated: its output split could not pass a later op" if c > 1 else "")
        if fixed is not None:
            if fixed.dims[nd] == tp:
                return self._column(ctx, xp, wp, bp, rows, rseg, wspec(tp, (), fixed.segments[nd]), fixed.segments[nd])
            if fixed.dims[kd] == tp and sx.dims[-1] == tp:
                return self._row(ctx, xp, wp, bp, sx, wspec((), tp))
            if fixed.is_replicated:
                return local()
        if sx.dims[-1] == tp and k % c == 0:
            return self._row(ctx, xp, wp, bp, sx, wspec((), tp))
        m = ctx.output_segments(node)
        if ctx.output_feeds_parallel_consumer(node) and n % (c * m) == 0:
            return self._column(ctx, xp, wp, bp, rows, rseg, wspec(tp, (), m), m)
        return local()

    def _column(self, ctx, xp, wp, bp, rows, rseg, ws, m):
        tp = self.tp_axes
        req = ShardSpec(dims=rows + ((),), segments=rseg + (1,))
        ins = {xp: req, wp: ws}
        if bp:
            ins[bp] = ShardSpec(dims=(tp,), segments=(m,))
        out = ShardSpec(dims=rows + (tp,), segments=rseg + (m,))
        return Choice(out=out, inputs=ins, weight=f"column: out features / {self.mesh.size(tp)}"
                      + (f" ({m} fused blocks)" if m > 1 else ""))

    def _row(self, ctx, xp, wp, bp, sx, ws):
        tp = self.tp_axes
        ins = {xp: sx, wp: ws}
        if bp:
            ins[bp] = ShardSpec(dims=((),))
        out = ShardSpec(dims=sx.dims[:-1] + ((),), segments=sx.segments[:-1] + (1,))
        numel = ctx.local_numel(ctx.node, out)
        return Choice(out=out, inputs=ins, kernel="row_linear",
                      kernel_args={"axes": list(tp), "bias": list(bp) if bp else None},
                      comms=(KComm("fwd", "all_reduce", tp, numel),),
                      weight=f"row: in features / {self.mesh.size(tp)}")

    # --------------------------------------------------------------- embedding
    def embedding(self, ctx) -> Choice:
        node = ctx.node
        w, ids = node.args[0], node.args[1]
        si = ctx.spec(ids)
        V, h = ctx.pshape(w)
        tp = self.tp_axes
        c = self.mesh.size(tp)
        fixed = ctx.fixed_param_spec(w)
        vocab = (fixed is not None and fixed.dims[0] == tp) or (
            fixed is None and c > 1 and V % c == 0 and ctx.is_largest_embedding(w))
        out = ShardSpec(dims=si.dims + ((),))
        if vocab:
            numel = ctx.local_numel(node, out)
            return Choice(out=out, inputs={(0,): ShardSpec(dims=(tp, ())), (1,): si}, kernel="vocab_embedding",
                          kernel_args={"axes": list(tp), "padding_idx": node.args[2] if len(node.args) > 2 else -1},
                          comms=(KComm("fwd", "all_reduce", tp, numel),), weight=f"vocab / {c}")
        return Choice(out=out, inputs={(0,): ShardSpec(dims=((), ())), (1,): si}, weight="replicated")
