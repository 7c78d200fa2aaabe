"""The Linear kernels: row-parallel (1d; pipelined in row blocks for asynchronous TP),
SUMMA (2d, 2.5d), 3D, the partial LM head, several Linears on one gathered input,
and the grouped (expert) products; a weight gather launched ahead
(:func:`gather_weight_start`, weight prefetching)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .. import collectives as C
from .common import autocast_on, collect_two, may_overlap, on_segments, seg, to_wire, unseg, wire_dtype

__all__ = ["row_linear", "gathered_linears", "summa", "three_d", "gather_weight_start", "partial_head"]


def _matmul(x, w, n_dim: int):
    """x @ W in math layout, for a weight stored [n, k] (n_dim 0) or [k, n] (n_dim 1)."""
    return x @ (w.t() if n_dim == 0 else w)


def row_linear(x, w, b, *, group: str, n_dim: int, scatter_dim: int | None = None, chunks: int = 1):
    """Row-parallel: local partial product, all-reduce (or reduce-scatter on
    ``scatter_dim``: sequence parallelism), then the (replicated) bias. ``chunks > 1``
    (asynchronous TP, :mod:`autoshard.passes.async_tp`): the rows in that many chunks,
    each chunk's all-reduce launched while the next multiplies — with ``scatter_dim``,
    chunks of dim 0 (the batch), each reduce-scattered on ``scatter_dim`` (eager, real
    tensors, no autocast, at least ``chunks`` samples; the plain path otherwise)."""
    eager = chunks > 1 and _pipelinable(x, (w,))
    if eager and scatter_dim is None:
        y = _ChunkedRow.apply(x, w, group, n_dim, chunks)
    elif eager and scatter_dim % x.dim() != 0 and x.dim() > 2 and x.shape[0] >= chunks:
        y = _ChunkedRowScatter.apply(x, w, group, n_dim, chunks, scatter_dim % x.dim())
    else:
        y = _matmul(x, w, n_dim)
        y = C.reduce_from(y, group) if scatter_dim is None else C.reduce_scatter_to(y, scatter_dim, group)
    return y if b is None else y + b


def _pipelinable(x, weights) -> bool:
    """Whether asynchronous TP's chunked kernels may run on ``x`` and ``weights``: real
    tensors (not the meta trace), eager (not under torch.compile, which sees the plain
    ops), no autocast, the weights in ``x``'s dtype."""
    return x.device.type != "meta" and not autocast_on(x) and not torch.compiler.is_compiling() \
        and all(w.dtype == x.dtype for w in weights)


def _row_grads(ctx, x, w, dy):
    """dX = dY·W and dW = dYᵀ·X of a row-parallel product (each where it is needed)."""
    dx = _summa_dx(dy, w, ctx.n_dim, x.dtype) if ctx.needs_input_grad[0] else None
    dw = _summa_dw(dy, x, ctx.n_dim, w.dtype) if ctx.needs_input_grad[1] else None
    return dx, dw


class _ChunkedRow(torch.autograd.Function):
    """The row-parallel product and its all-reduce, micro-pipelined over row chunks.
    Backward as the plain path's: the all-reduce's gradient is the identity, so
    dX = dY·W and dW = dYᵀ·X, no collective."""

    @staticmethod
    def forward(ctx, x, w, group: str, n_dim: int, chunks: int):
        ctx.save_for_backward(x, w)
        ctx.n_dim = n_dim
        wm = w.t() if n_dim == 0 else w
        x2 = x.reshape(-1, x.shape[-1])
        y = x2.new_empty((x2.shape[0], wm.shape[1]))
        works = []
        for px, py in zip(x2.tensor_split(chunks), y.tensor_split(chunks)):
            if py.numel():
                torch.mm(px, wm, out=py)
                works.append(C.all_reduce_async(py, group))
        for work in works:
            work.wait()
        return y.reshape(*x.shape[:-1], wm.shape[1])

    @staticmethod
    def backward(ctx, dy):
        x, w = ctx.saved_tensors
        return (*_row_grads(ctx, x, w, dy), None, None, None)


class _ChunkedRowScatter(torch.autograd.Function):
    """1d-sp's row-parallel product and its reduce-scatter on the sequence dim,
    micro-pipelined over chunks of the batch (dim 0): each chunk's reduce-scatter is
    launched while the next chunk multiplies; the chunks' blocks, concatenated on dim 0,
    are the whole product's block. Backward as the plain path's: the reduce-scatter's
    gradient is the all-gather of dY on that dim, then dX = dY·W and dW = dYᵀ·X."""

    @staticmethod
    def forward(ctx, x, w, group: str, n_dim: int, chunks: int, scatter_dim: int):
        ctx.save_for_backward(x, w)
        ctx.n_dim, ctx.group, ctx.scatter_dim = n_dim, group, scatter_dim
        wm = w.t() if n_dim == 0 else w
        waits = [C.reduce_scatter_start(C.to_rank_blocks(px @ wm, scatter_dim, group), scatter_dim, group)
                 for px in x.tensor_split(chunks) if px.shape[0]]
        return torch.cat([finish() for finish in waits])

    @staticmethod
    def backward(ctx, dy):
        x, w = ctx.saved_tensors
        d = ctx.scatter_dim
        dy = C.from_rank_blocks(C.all_gather(dy.contiguous(), d, ctx.group), d, ctx.group)
        return (*_row_grads(ctx, x, w, dy), None, None, None, None)


def gathered_linears(x, weights: tuple, biases: tuple, *, group: str, dim: int, chunks: int) -> tuple:
    """1d-sp's all-gather of the sequence (a ``gather_partial`` step on ``dim``) and the
    column-parallel Linears that read it (``F.linear`` with each of ``weights`` /
    ``biases``), micro-pipelined over ``chunks`` chunks of the batch (dim 0): the next
    chunk's gather travels while this chunk multiplies (:mod:`autoshard.passes.async_tp`).
    One output per weight, as the Linears give them. The gather then the Linears where
    it cannot run so (meta, torch.compile, autocast, another dtype, the gather on dim 0,
    fewer samples than chunks)."""
    d = dim % x.dim()
    if not _pipelinable(x, weights) or d == 0 or x.shape[0] < chunks:
        xg = C.gather_partial(to_wire(x, wire_dtype(x)), dim, group)     # autocast: gathered in bf16
        return tuple(F.linear(xg, w, b) for w, b in zip(weights, biases))
    return _GatheredLinears.apply(x, group, d, chunks, len(weights), *weights, *biases)


class _GatheredLinears(torch.autograd.Function):
    """:func:`gathered_linears`, pipelined. Backward as the plain path's: dX of the
    gathered input is the sum over the Linears of dYᵢ·Wᵢ, reduce-scattered on the
    sequence (the gather's gradient); dWᵢ = dYᵢᵀ·X and dbᵢ = Σ dYᵢ on the gathered X."""

    @staticmethod
    def forward(ctx, x, group: str, d: int, chunks: int, n: int, *wb):
        ws, bs = wb[:n], wb[n:]
        parts = [px for px in x.tensor_split(chunks) if px.shape[0]]
        pending = C.all_gather_start(parts[0], d, group)
        gathered, outs = [], [[] for _ in ws]
        for j in range(len(parts)):
            xg = C.from_rank_blocks(pending(), d, group)
            if j + 1 < len(parts):
                pending = C.all_gather_start(parts[j + 1], d, group)
            gathered.append(xg)
            for out, w, b in zip(outs, ws, bs):
                out.append(F.linear(xg, w, b))
        ctx.save_for_backward(torch.cat(gathered), *ws)
        ctx.group, ctx.d, ctx.n, ctx.has_bias = group, d, n, [b is not None for b in bs]
        return tuple(torch.cat(out) for out in outs)

    @staticmethod
    def backward(ctx, *dys):
        xg, *ws = ctx.saved_tensors
        n = ctx.n
        x2 = xg.reshape(-1, xg.shape[-1])
        dx, dws, dbs = None, [], []
        for i, (dy, w) in enumerate(zip(dys, ws)):
            dy2 = dy.reshape(-1, dy.shape[-1])
            part = dy @ w
            dx = part if dx is None else dx + part
            dws.append(dy2.t() @ x2 if ctx.needs_input_grad[5 + i] else None)
            dbs.append(dy2.sum(0) if ctx.has_bias[i] and ctx.needs_input_grad[5 + n + i] else None)
        if ctx.needs_input_grad[0]:
            dx = C.reduce_scatter(C.to_rank_blocks(dx.contiguous(), ctx.d, ctx.group), ctx.d, ctx.group)
        else:
            dx = None
        return (dx, None, None, None, None, *dws, *dbs)


def _grouped(x, w, offs, n_dim: int, impl: str):
    """Per-expert product of rows ``x`` with ``w`` ``[E, n, k]`` (n_dim 1) or ``[E, k, n]``."""
    from ...ir.grouped import grouped_linear

    return grouped_linear(x, w, offs, n_dim == 1, impl)


def _grouped_grads(x, w, offs, n_dim: int, impl: str, dy, need_x: bool, need_w: bool):
    """dX and dW of :func:`_grouped` (its own autograd, on the gathered operands)."""
    with torch.enable_grad():
        xr = x.detach().requires_grad_(need_x)
        wr = w.detach().requires_grad_(need_w)
        y = _grouped(xr, wr, offs, n_dim, impl)
        want = [t for t, need in ((xr, need_x), (wr, need_w)) if need]
        got = iter(torch.autograd.grad(y, want, dy))
    return (next(got) if need_x else None), (next(got) if need_w else None)


class _Summa(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, row: str, col: str, n_dim: int, k_dim: int, offs=None, impl: str = "", ready=None,
                rows_whole: bool = False):
        ctx.save_for_backward(x, w, offs)
        ctx.cfg = (row, col, n_dim, k_dim, impl, rows_whole)
        # under autocast both operands travel in the compute dtype, forward and backward
        ctx.wire = wire = wire_dtype(x)
        xw = to_wire(x, wire)
        # X over the column [N_loc, k] and W over the row [k, n/q] (per expert when grouped), together;
        # W already on its way when a prefetch launched it (passes.prefetch)
        if ready is not None:
            xg, wg = C.all_gather(xw, x.dim() - 1, col), ready.result()
        else:
            xg, wg = collect_two("all_gather", xw, x.dim() - 1, col, to_wire(w, wire), k_dim, row)
        if offs is not None:                         # groups of this rank's rows: the same along the row
            return _grouped(xg, wg, offs, n_dim, impl)
        return _matmul(xg, wg, n_dim)

    @staticmethod
    def backward(ctx, dy):
        x, w, offs = ctx.saved_tensors
        row, col, n_dim, k_dim, impl, rows_whole = ctx.cfg
        dx = dw = None
        # X's rows whole over `row` (a static batch kept whole): the row group's ranks compute the
        # same dW, so each keeps its block of it instead of summing q copies
        reduce_dw = (lambda t: C.local_block(t, k_dim, row)) if rows_whole else \
            (lambda t: C.reduce_scatter(t, k_dim, row))
        # re-gather instead of saving the gathered copies (docs/design.md, "Pitfalls"); each operand
        # only for the gradient that reads it (kernels.Summa.comms says the same)
        # under autocast dy is low precision while x / w are not: compute in dy's dtype (as
        # autocast's matmul did), gather and scatter in it (ctx.wire), and hand each gradient
        # back in its input's dtype
        wire = ctx.wire
        xw, ww = to_wire(x, wire), to_wire(w, wire)
        gx = x.dtype if wire is None else wire          # the dtype the gradients travel in
        gw = w.dtype if wire is None else wire
        nx, nw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        if nx and nw and not rows_whole:    # both operands gathered together, both gradients scattered together
            wg, xg = collect_two("all_gather", ww, k_dim, row, xw, x.dim() - 1, col)
            if offs is not None:
                dxg, dwg = _grouped_grads(xg, wg, offs, n_dim, impl, dy, True, True)
                dxg, dwg = dxg.to(gx), dwg.to(gw)
            else:
                dxg = _summa_dx(dy, wg, n_dim, gx)
                if may_overlap(dxg):      # dX's scatter travels while dW is computed
                    dx = C.reduce_scatter_start(dxg, dxg.dim() - 1, col)
                    dw = C.reduce_scatter(_summa_dw(dy, xg, n_dim, gw), k_dim, row)
                    return (dx().to(x.dtype), dw.to(w.dtype)) + (None,) * 8
                dwg = _summa_dw(dy, xg, n_dim, gw)
            dx, dw = collect_two("reduce_scatter", dxg, dxg.dim() - 1, col, dwg, k_dim, row)
            return (dx.to(x.dtype), dw.to(w.dtype)) + (None,) * 8
        if offs is not None:
            wg = C.all_gather(ww, k_dim, row) if nx else ww
            xg = C.all_gather(xw, x.dim() - 1, col) if nw else xw
            dxg, dwg = _grouped_grads(xg, wg, offs, n_dim, impl, dy, nx, nw)
            if nx:
                dx = C.reduce_scatter(dxg.to(gx), dxg.dim() - 1, col).to(x.dtype)
            if nw:
                dw = reduce_dw(dwg.to(gw)).to(w.dtype)
            return dx, dw, None, None, None, None, None, None, None, None
        if nx:
            dxg = _summa_dx(dy, C.all_gather(ww, k_dim, row), n_dim, gx)
            dx = C.reduce_scatter(dxg, dxg.dim() - 1, col).to(x.dtype)
        if nw:
            dwg = _summa_dw(dy, C.all_gather(xw, x.dim() - 1, col), n_dim, gw)
            dw = reduce_dw(dwg).to(w.dtype)
        return dx, dw, None, None, None, None, None, None, None, None


def _summa_dx(dy, wg, n_dim: int, dtype):
    """dX of the gathered product: dy · Wᵀ in dy's dtype, returned in ``dtype``."""
    wg = wg.to(dy.dtype)
    return (dy @ (wg if n_dim == 0 else wg.t())).to(dtype)


def _summa_dw(dy, xg, n_dim: int, dtype):
    """dW of the gathered product (stored layout, n_dim): Xᵀ · dy in dy's dtype, returned in ``dtype``."""
    x2 = xg.to(dy.dtype).reshape(-1, xg.shape[-1])
    dy2 = dy.reshape(-1, dy.shape[-1])
    return (dy2.t() @ x2 if n_dim == 0 else x2.t() @ dy2).to(dtype)


def summa(x, w, b, *, row: str, col: str, n_dim: int, k_dim: int, offs=None, impl: str = "", ready=None,
          rows_whole: bool = False):
    """SUMMA Linear on a ``row × col`` grid (one depth layer of Tesseract). With
    ``offs`` a grouped Linear (per expert, :mod:`autoshard.ir.grouped`): the rows are
    this rank's tokens sorted by expert, the same on every rank of the row group.
    ``ready``: W's gather launched earlier by :func:`gather_weight_start`.
    ``rows_whole``: X's rows are not split over ``row`` (every rank of it holds them
    all): dW is kept as a block instead of summed over ``row``."""
    y = _Summa.apply(x, w, row, col, n_dim, k_dim, offs, impl, ready, rows_whole)
    return y if b is None else y + b


def _rs_seg(t, dim: int, group: str, m: int):
    return on_segments(C.reduce_scatter, t, dim, group, m)


class _ThreeD(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, a: str, b: str, c: str, row_dim: int, n_dim: int, m: int, ready=None):
        wire = wire_dtype(x)                      # autocast: the operands travel in the compute dtype
        if ready is not None:                      # W already on its way (passes.prefetch)
            xg, wg = C.all_gather(to_wire(x, wire), row_dim, b), ready.result()
        else:                                      # X_il: rows (a); W_lj: n (b)
            xg, wg = collect_two("all_gather", to_wire(x, wire), row_dim, b, to_wire(w, wire), n_dim, a, m)
        ctx.save_for_backward(xg, wg)              # saved, as the 3D cost formula assumes
        ctx.cfg = (a, b, c, row_dim, n_dim, m)
        ctx.dtypes = (x.dtype, w.dtype)
        return C.reduce_scatter(_matmul(xg, wg, n_dim), row_dim, c)

    @staticmethod
    def backward(ctx, dy):
        xg, wg = ctx.saved_tensors
        a, b, c, row_dim, n_dim, m = ctx.cfg
        x_dtype, w_dtype = ctx.dtypes
        dyg = C.all_gather(dy.contiguous(), row_dim, c)
        dx = dw = None
        # as in _Summa: compute in dy's dtype, scatter in the dtype the operands travelled in
        # (the compute dtype under autocast), hand each gradient back in its input's dtype
        nx, nw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        dxg = _summa_dx(dyg, wg, n_dim, xg.dtype) if nx else None
        if nx and nw and may_overlap(dxg):        # dX's scatter travels while dW is computed
            dx = C.reduce_scatter_start(dxg, row_dim, b)
            dw = _rs_seg(_summa_dw(dyg, xg, n_dim, wg.dtype), n_dim, a, m)
            return (dx().to(x_dtype), dw.to(w_dtype)) + (None,) * 7
        dwg = _summa_dw(dyg, xg, n_dim, wg.dtype) if nw else None
        if nx and nw:       # the two gradients scattered together
            dx, dw = collect_two("reduce_scatter", dxg, row_dim, b, dwg, n_dim, a, m)
            return (dx.to(x_dtype), dw.to(w_dtype)) + (None,) * 7
        if nx:
            dx = C.reduce_scatter(dxg, row_dim, b).to(x_dtype)
        if nw:
            dw = _rs_seg(dwg, n_dim, a, m).to(w_dtype)
        return dx, dw, None, None, None, None, None, None, None


def three_d(x, w, bias, *, a: str, b: str, c: str, row_dim: int, n_dim: int, segments: int = 1, ready=None):
    """3D Linear (the 3D paper's schedule, docs/design.md, "3d"): gather X over ``b`` and W
    over ``a``, reduce-scatter over ``c``.
    ``ready``: W's gather launched earlier by :func:`gather_weight_start`."""
    y = _ThreeD.apply(x, w, a, b, c, row_dim, n_dim, segments, ready)
    return y if bias is None else y + bias


class _Gathering:
    """A weight's all-gather in flight (:func:`gather_weight_start`); :meth:`result`
    waits for it once and gives the gathered weight."""

    def __init__(self, finish, dim: int, segments: int):
        self._finish, self._dim, self._m, self._value = finish, dim, segments, None

    def result(self) -> torch.Tensor:
        if self._value is None:
            self._value = unseg(self._finish(), self._dim, self._m)
            self._finish = None
        return self._value


def gather_weight_start(w, dim: int, group: str, segments: int = 1) -> _Gathering:
    """Launch the all-gather of weight ``w`` on ``dim`` over ``group`` (``segments``
    fused segments, each split) now, for a SUMMA / 3D Linear that runs later
    (``ready=``): :mod:`autoshard.passes.prefetch` puts it before the Linear ahead, so the
    weight travels while that one computes. Counted by the ledger at launch."""
    ws, d = seg(to_wire(w.detach(), wire_dtype(w)), dim, segments)
    return _Gathering(C.all_gather_start(ws, d, group), dim, segments)


def partial_head(x, w, b, *, col: str):
    """``x · Eᵀ`` for a table split on hidden over ``col``: partial sums, reduce-scattered on vocab."""
    y = C.reduce_scatter_to(x @ w.t(), x.dim() - 1, col)
    return y if b is None else y + b
