"""The runtime of the kernel objects (:mod:`autoshard.ir.kernels`) and the re-layout steps.

Each is a plain function of local tensors and c10d group names (or shape-only
groups on meta); collectives go through :mod:`autoshard.runtime.collectives` so the
ledger sees them. Which collectives each issues is declared by its kernel
object's ``comms``; the ledger tests hold the two together.
"""

from __future__ import annotations

import contextlib
import contextvars
import math

import torch
import torch.nn.functional as F

from . import collectives as C
from ..ir import kernels as K
from ..ir.spec import ShardSpec

__all__ = ["bind", "step", "AUTOCAST_PRODUCTS", "casting_kernels", "row_linear", "summa", "three_d", "partial_head", "vocab_embedding",
           "dist_layer_norm", "sync_batch_norm",
           "cross_entropy", "dropout", "dropout_active", "attention_dropout", "paired_collectives",
           "gather_weight_start", "gathered_linears"]


# --------------------------------------------------------------- re-layout steps
_STEPS = {
    "reduce_from": lambda x, g, dim, m, f: C.reduce_from(x, g),
    "copy_to": lambda x, g, dim, m, f: C.copy_to(x, g),
    "all_reduce_both": lambda x, g, dim, m, f: C.all_reduce_both(x, g),
    "reduce_scatter": lambda x, g, dim, m, f: C.reduce_scatter_to(x, dim, g),
    "gather": lambda x, g, dim, m, f: _on_segments(C.gather_from, x, dim, g, m),
    "gather_partial": lambda x, g, dim, m, f: _on_segments(C.gather_partial, x, dim, g, m),
    "scatter": lambda x, g, dim, m, f: _on_segments(C.scatter_to, x, dim, g, m),
    "scale": lambda x, g, dim, m, f: x * f,
}


def step(x: torch.Tensor, op: str, group: str | None, dim: int | None, segments: int, factor: float | None,
         wire: bool = False):
    """Apply one :class:`~autoshard.ir.plan.Step` to a local tensor. ``wire``: every reader
    of the result is a product that autocast runs in its compute dtype
    (:data:`AUTOCAST_PRODUCTS`), so under autocast ``x`` is cast to it first and travels at
    half the bytes (the readers get the values they would have cast to)."""
    if op not in _STEPS:
        raise ValueError(f"unknown step {op!r}; valid: {', '.join(_STEPS)}")
    if wire:
        x = _to_wire(x, _wire_dtype(x))
    return _STEPS[op](x, group, dim, segments, factor)


def _autocast_products() -> frozenset:
    """The ATen products autocast runs in its compute dtype on CPU and CUDA alike (both
    lists name them), casting every floating operand."""
    aten = torch.ops.aten
    return frozenset(getattr(aten, name).default for name in (
        "linear", "mm", "addmm", "bmm", "baddbmm", "addbmm", "matmul", "conv1d", "conv2d", "conv3d"))


AUTOCAST_PRODUCTS = _autocast_products()


def _autocast_on(t: torch.Tensor) -> bool:
    """Whether autocast is on for ``t``'s device (never on meta, where the trace runs)."""
    return t.device.type != "meta" and torch.is_autocast_enabled(t.device.type)


def _wire_dtype(t: torch.Tensor) -> torch.dtype | None:
    """The dtype a product's operands travel in: autocast's compute dtype while autocast is
    on for ``t``'s device (the product casts them to it anyway), else None (as they are)."""
    return torch.get_autocast_dtype(t.device.type) if _autocast_on(t) else None


def _to_wire(t: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    """``t`` in ``dtype`` (autocast's compute dtype) when autocast would cast it: a float16,
    bfloat16 or float32 tensor (float64 is not autocast-eligible and stays). Cast before
    gathering: the gathered value is the one the product would have cast, at half the
    bytes on the wire (docs/design.md, "Mixed precision")."""
    if dtype is None or t.dtype == dtype or t.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        return t
    return t.to(dtype)


# ----------------------------------------------------------------------- linears
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
    return x.device.type != "meta" and not _autocast_on(x) and not torch.compiler.is_compiling() \
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
        xg = C.gather_partial(_to_wire(x, _wire_dtype(x)), dim, group)     # autocast: gathered in bf16
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
    from ..ir.grouped import grouped_linear

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


_PAIRED = {"on": True}      # a plain global: torch.compile reads it (and guards on it), a ContextVar it cannot


@contextlib.contextmanager
def paired_collectives(on: bool):
    """Whether a SUMMA / 3D Linear sends the collectives of its two operands together
    (default: both launched, then both waited, :func:`~autoshard.runtime.collectives.all_gather_two`)
    or one after the other (``on=False``: what ``benchmarks/bench_overlap.py`` compares
    against). The same calls, bytes and results either way."""
    was, _PAIRED["on"] = _PAIRED["on"], bool(on)
    try:
        yield
    finally:
        _PAIRED["on"] = was


def _overlap(t) -> bool:
    """Whether a backward may launch a collective asynchronously and compute meanwhile:
    paired collectives on, a real tensor (not the meta trace), not under torch.compile
    (which sees the paired op instead)."""
    return _PAIRED["on"] and t.device.type != "meta" and not torch.compiler.is_compiling()


def _seg(t, dim: int, m: int):
    """``t`` with ``dim`` split into ``m`` fused segments (a new dim before it), and the dim to use."""
    if m == 1:
        return t, dim
    shape = list(t.shape)
    return t.reshape(shape[:dim] + [m, shape[dim] // m] + shape[dim + 1:]), dim + 1


def _unseg(t, dim: int, m: int):
    if m == 1:
        return t
    shape = list(t.shape)
    return t.reshape(shape[:dim] + [-1] + shape[dim + 2:])


def _two(kind: str, a, a_dim: int, a_group: str, b, b_dim: int, b_group: str, m_b: int = 1):
    """Two all-gathers (``kind="all_gather"``) or reduce-scatters on two groups, in
    flight together unless :func:`paired_collectives` is off; ``b`` made of ``m_b``
    fused segments along ``b_dim``, each split."""
    bs, bd = _seg(b, b_dim, m_b)
    if _PAIRED["on"]:
        ya, yb = (C.all_gather_two if kind == "all_gather" else C.reduce_scatter_two)(a, a_dim, a_group, bs, bd, b_group)
    else:
        one = C.all_gather if kind == "all_gather" else C.reduce_scatter
        ya, yb = one(a, a_dim, a_group), one(bs, bd, b_group)
    return ya, _unseg(yb, b_dim, m_b)


class _Summa(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, row: str, col: str, n_dim: int, k_dim: int, offs=None, impl: str = "", ready=None,
                rows_whole: bool = False):
        ctx.save_for_backward(x, w, offs)
        ctx.cfg = (row, col, n_dim, k_dim, impl, rows_whole)
        # under autocast both operands travel in the compute dtype, forward and backward
        ctx.wire = wire = _wire_dtype(x)
        xw = _to_wire(x, wire)
        # X over the column [N_loc, k] and W over the row [k, n/q] (per expert when grouped), together;
        # W already on its way when a prefetch launched it (passes.prefetch)
        if ready is not None:
            xg, wg = C.all_gather(xw, x.dim() - 1, col), ready.result()
        else:
            xg, wg = _two("all_gather", xw, x.dim() - 1, col, _to_wire(w, wire), k_dim, row)
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
        xw, ww = _to_wire(x, wire), _to_wire(w, wire)
        gx = x.dtype if wire is None else wire          # the dtype the gradients travel in
        gw = w.dtype if wire is None else wire
        nx, nw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        if nx and nw and not rows_whole:    # both operands gathered together, both gradients scattered together
            wg, xg = _two("all_gather", ww, k_dim, row, xw, x.dim() - 1, col)
            if offs is not None:
                dxg, dwg = _grouped_grads(xg, wg, offs, n_dim, impl, dy, True, True)
                dxg, dwg = dxg.to(gx), dwg.to(gw)
            else:
                dxg = _summa_dx(dy, wg, n_dim, gx)
                if _overlap(dxg):      # dX's scatter travels while dW is computed
                    dx = C.reduce_scatter_start(dxg, dxg.dim() - 1, col)
                    dw = C.reduce_scatter(_summa_dw(dy, xg, n_dim, gw), k_dim, row)
                    return (dx().to(x.dtype), dw.to(w.dtype)) + (None,) * 8
                dwg = _summa_dw(dy, xg, n_dim, gw)
            dx, dw = _two("reduce_scatter", dxg, dxg.dim() - 1, col, dwg, k_dim, row)
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


def _on_segments(fn, t, dim: int, group: str, m: int):
    """Apply a dim-wise collective to a dim made of ``m`` fused segments, each split."""
    ts, d = _seg(t, dim, m)
    return _unseg(fn(ts, d, group), dim, m)


def _rs_seg(t, dim: int, group: str, m: int):
    return _on_segments(C.reduce_scatter, t, dim, group, m)


class _ThreeD(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, a: str, b: str, c: str, row_dim: int, n_dim: int, m: int, ready=None):
        wire = _wire_dtype(x)                      # autocast: the operands travel in the compute dtype
        if ready is not None:                      # W already on its way (passes.prefetch)
            xg, wg = C.all_gather(_to_wire(x, wire), row_dim, b), ready.result()
        else:                                      # X_il: rows (a); W_lj: n (b)
            xg, wg = _two("all_gather", _to_wire(x, wire), row_dim, b, _to_wire(w, wire), n_dim, a, m)
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
        if nx and nw and _overlap(dxg):        # dX's scatter travels while dW is computed
            dx = C.reduce_scatter_start(dxg, row_dim, b)
            dw = _rs_seg(_summa_dw(dyg, xg, n_dim, wg.dtype), n_dim, a, m)
            return (dx().to(x_dtype), dw.to(w_dtype)) + (None,) * 7
        dwg = _summa_dw(dyg, xg, n_dim, wg.dtype) if nw else None
        if nx and nw:       # the two gradients scattered together
            dx, dw = _two("reduce_scatter", dxg, row_dim, b, dwg, n_dim, a, m)
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
            self._value = _unseg(self._finish(), self._dim, self._m)
            self._finish = None
        return self._value


def gather_weight_start(w, dim: int, group: str, segments: int = 1) -> _Gathering:
    """Launch the all-gather of weight ``w`` on ``dim`` over ``group`` (``segments``
    fused segments, each split) now, for a SUMMA / 3D Linear that runs later
    (``ready=``): :mod:`autoshard.passes.prefetch` puts it before the Linear ahead, so the
    weight travels while that one computes. Counted by the ledger at launch."""
    ws, d = _seg(_to_wire(w.detach(), _wire_dtype(w)), dim, segments)
    return _Gathering(C.all_gather_start(ws, d, group), dim, segments)


def partial_head(x, w, b, *, col: str):
    """``x · Eᵀ`` for a table split on hidden over ``col``: partial sums, reduce-scattered on vocab."""
    y = C.reduce_scatter_to(x @ w.t(), x.dim() - 1, col)
    return y if b is None else y + b


# --------------------------------------------------------------------- embedding
def vocab_embedding(w, ids, *, group: str, padding_idx: int = -1, reduce: bool = True,
                    scatter_dim: int | None = None):
    """Lookup in this rank's vocabulary range; other rows are zero; all-reduce
    (``reduce=False``: the partial sum, reduced later by the plan; ``scatter_dim``:
    reduce-scattered on that dim, the sequence of 1d-sp)."""
    v_loc = w.shape[0]
    lo = C.rank_in(group, ids) * v_loc           # a tensor under torch.compile: one graph on every rank
    inside = (ids >= lo) & (ids < lo + v_loc)
    local = torch.where(inside, ids - lo, torch.zeros_like(ids))
    # the padding row gets no gradient, as in the dense lookup; it lives on one rank
    if isinstance(lo, int):
        pad = padding_idx - lo if padding_idx is not None and lo <= padding_idx < lo + v_loc else None
        out = F.embedding(local, w, padding_idx=pad)
    else:           # the rank is not known while tracing: the padding tokens' rows stop the gradient
        out = F.embedding(local, w)
        if padding_idx is not None and padding_idx >= 0:
            out = torch.where((ids == padding_idx).unsqueeze(-1), out.detach(), out)
    out = out * inside.unsqueeze(-1).to(w.dtype)
    if scatter_dim is not None:
        return C.reduce_scatter_to(out, scatter_dim, group)
    return C.reduce_from(out, group) if reduce else out


# ------------------------------------------------------------------------- norms
def dist_layer_norm(x, normalized_shape, w, b, eps, *, group: str, count: int):
    """LayerNorm over a hidden dim split over ``group``: Σx and Σ(x-μ)² all-reduced
    both ways (the statistics are used with split data, so their grads are partial).

    Computed in float32 at least, as the dense kernel does (float64 stays float64); the
    result has ``x``'s dtype, or float32 under autocast (where ``layer_norm`` runs in float32)."""
    dtype = torch.float32 if _autocast_on(x) else x.dtype
    acc = torch.promote_types(x.dtype, torch.float32)
    x = x.to(acc)
    h = x.shape[-1] * count
    mean = C.all_reduce_both(x.sum(-1, keepdim=True), group) / h
    xc = x - mean
    var = C.all_reduce_both((xc * xc).sum(-1, keepdim=True), group) / h
    y = xc * torch.rsqrt(var + eps)
    if w is not None:
        y = y * w.to(acc)
    if b is not None:
        y = y + b.to(acc)
    return y.to(dtype)


def sync_batch_norm(x, w, b, running_mean, running_var, *, momentum, eps, group: str):
    """``batch_norm`` in training over a batch whose rows are split over ``group``, as
    ``torch.nn.SyncBatchNorm``: each rank's per-channel mean and sum of squared
    deviations (over its rows and positions) are all-gathered in one call and combined
    (Chan's parallel variance: exact, no cancellation); backward reduce-scatters their
    gradients home, so every rank's input gradient is that of the global batch. The
    running statistics are updated in place from the global figures (unbiased
    variance), identically on every rank. Every rank holds as many rows (the batch
    divides the split). Computed in float32 at least, as the dense kernel does."""
    dtype = torch.float32 if _autocast_on(x) else x.dtype
    acc = torch.promote_types(x.dtype, torch.float32)
    xa = x.to(acc)
    red = [0] + list(range(2, x.dim()))
    n = xa.numel() // max(xa.shape[1] if x.dim() > 1 else 1, 1)          # values per channel on this rank
    mean_r = xa.mean(red)
    m2_r = ((xa - mean_r.view(_bn_shape(x))) ** 2).sum(red)
    every = C.gather_partial(torch.stack([mean_r, m2_r]).unsqueeze(0), 0, group)        # [p, 2, C]
    p = every.shape[0]
    means = every[:, 0]
    mean = means.mean(0)
    m2 = every[:, 1].sum(0) + n * ((means - mean) ** 2).sum(0)
    total = n * p
    var = m2 / total
    y = (xa - mean.view(_bn_shape(x))) * torch.rsqrt(var + eps).view(_bn_shape(x))
    if w is not None:
        y = y * w.to(acc).view(_bn_shape(x))
    if b is not None:
        y = y + b.to(acc).view(_bn_shape(x))
    if running_mean is not None and momentum is not None:
        with torch.no_grad():
            running_mean.mul_(1 - momentum).add_(mean.detach().to(running_mean.dtype), alpha=momentum)
            unbiased = m2.detach() / max(total - 1, 1)
            running_var.mul_(1 - momentum).add_(unbiased.to(running_var.dtype), alpha=momentum)
    return y.to(dtype)


def _bn_shape(x) -> tuple:
    """``[1, C, 1, ...]``: a per-channel vector broadcast over ``x``."""
    return (1, -1) + (1,) * (x.dim() - 2)


# -------------------------------------------------------------------------- loss
class _VocabParallelCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, group: str, ignore_index: int):
        v_loc = logits.shape[-1]
        lo = C.rank_in(group, target) * v_loc      # a tensor under torch.compile: one graph on every rank
        lmax = C.all_reduce_max(logits.detach().max(dim=-1).values, group)
        shifted = logits - lmax.unsqueeze(-1)
        exp = shifted.exp()
        sumexp = C.all_reduce(exp.sum(-1), group, "sum")
        inside = (target >= lo) & (target < lo + v_loc)
        idx = torch.where(inside, target - lo, torch.zeros_like(target))
        picked = shifted.gather(-1, idx.unsqueeze(-1)).squeeze(-1) * inside.to(logits.dtype)
        picked = C.all_reduce(picked, group, "sum")
        valid = (target != ignore_index).to(logits.dtype)
        loss = (sumexp.log() - picked) * valid
        ctx.save_for_backward(exp / sumexp.unsqueeze(-1), idx, inside, valid)
        return loss

    @staticmethod
    def backward(ctx, g):
        soft, idx, inside, valid = ctx.saved_tensors
        gv = (g * valid).unsqueeze(-1)
        d = soft * gv
        d.scatter_add_(-1, idx.unsqueeze(-1), -(inside.to(d.dtype).unsqueeze(-1) * gv))
        return d, None, None, None


def cross_entropy(logits, target, weight=None, *, vocab_group: str | None, batch_group: str | None,
                  ignore_index: int = -100, reduction: int = 1, smoothing: float | None = None,
                  class_dim: int | None = None):
    """Token cross-entropy of a batch split over ``batch_group`` with logits possibly
    split on the classes over ``vocab_group``: a mean (``reduction=1``) or sum (2) is
    global and identical on every rank; ``reduction=0`` gives each local token's loss.
    ``weight`` (class weights, whole), ``smoothing`` (label smoothing) and ``class_dim``
    (1: spatial targets) follow ``torch.nn.functional.cross_entropy``; given any of
    them (even as defaults) the general path runs (:func:`_ce_general`).
    Under autocast it runs in float32, as autocast runs ``cross_entropy_loss``."""
    if _autocast_on(logits):
        logits = logits.float()
    if smoothing is not None or class_dim is not None or weight is not None or reduction == 0:
        return _ce_general(logits, target, weight, vocab_group, batch_group, ignore_index, reduction,
                           smoothing or 0.0, -1 if class_dim is None else class_dim)
    if logits.dim() > 2:        # tokens kept apart (autoshard.ir.tokens.token_cross_entropy)
        logits, target = logits.reshape(-1, logits.shape[-1]), target.reshape(-1)
    if vocab_group is not None:
        tok = _VocabParallelCE.apply(logits, target, vocab_group, ignore_index)
    else:
        tok = F.cross_entropy(logits, target, reduction="none", ignore_index=ignore_index)
    total = tok.sum()
    count = (target != ignore_index).sum().to(logits.dtype)
    if batch_group is not None:
        total = C.reduce_from(total, batch_group)
        count = C.all_reduce_nograd(count, batch_group)
    return total / count if reduction == 1 else total


def _ce_general(logits, target, weight, vocab_group, batch_group, ignore_index: int, reduction: int,
                smoothing: float, class_dim: int):
    """Each token's ``(1-ε)·w[y]·(lse - l_y) + ε/C·Σ_c w_c·(lse - l_c)`` (0 where ignored),
    as ``cross_entropy_loss`` computes it, from per-token sums over the classes: over a
    class split they are partial and all-reduced together (one call, backward identity:
    every rank holds the same loss). Classes whose logit is ``-inf`` (a padded vocabulary,
    :mod:`autoshard.passes.pad`) take no part in the smoothing term, so ``C`` counts the
    finite ones. A mean divides the global sum by the global ``Σ w[y]`` of the tokens kept."""
    shape = target.shape
    if class_dim != -1 and class_dim != logits.dim() - 1:
        logits = logits.movedim(class_dim, -1)
    v_loc = logits.shape[-1]
    logits, target = logits.reshape(-1, v_loc), target.reshape(-1)
    valid = target != ignore_index
    safe = torch.where(valid, target, torch.zeros_like(target))
    if vocab_group is not None:
        lo = C.rank_in(vocab_group, target) * v_loc
        lmax = C.all_reduce_max(logits.detach().max(dim=-1).values, vocab_group)
    else:
        lo, lmax = 0, logits.detach().max(dim=-1).values
    shifted = logits - lmax.unsqueeze(-1)
    inside = (safe >= lo) & (safe < lo + v_loc)
    idx = torch.where(inside, safe - lo, torch.zeros_like(safe))
    picked = shifted.gather(-1, idx.unsqueeze(-1)).squeeze(-1) * inside.to(logits.dtype)
    sums = [shifted.exp().sum(-1), picked]
    if smoothing:
        fin = torch.isfinite(shifted)
        cols = torch.arange(v_loc, device=logits.device) + lo
        wl = weight.to(logits.dtype).index_select(0, cols) if weight is not None \
            else torch.ones(v_loc, dtype=logits.dtype, device=logits.device)
        wf = torch.where(fin, wl, torch.zeros_like(wl))
        sums += [(torch.where(fin, shifted, torch.zeros_like(shifted)) * wf).sum(-1), wf.sum(-1),
                 fin.to(logits.dtype).sum(-1)]
    s = torch.stack(sums, -1)
    if vocab_group is not None:
        s = C.reduce_from(s, vocab_group)
    lse = s[:, 0].log()
    wy = weight.to(logits.dtype)[safe] if weight is not None else torch.ones_like(lse)
    tok = wy * (lse - s[:, 1])
    if smoothing:
        tok = (1 - smoothing) * tok + smoothing / s[:, 4] * (lse * s[:, 3] - s[:, 2])
    keep = valid.to(logits.dtype)
    tok = tok * keep
    if reduction == 0:
        return tok.reshape(shape)
    total = tok.sum()
    denom = (wy * keep).sum()
    if batch_group is not None:
        total = C.reduce_from(total, batch_group)
        denom = C.all_reduce_nograd(denom, batch_group)
    return total / denom if reduction == 1 else total


# ----------------------------------------------------------------------- dropout
def _dropout_mask(x: torch.Tensor, p: float, dense: bool, blocks, segments) -> torch.Tensor:
    """The scaled keep-mask (``bernoulli(1-p) / (1-p)``) of this rank's block of ``x``.

    ``blocks`` has per dim the group over the axes splitting it (None: whole);
    the rank in that group is the block index (see :class:`autoshard.ir.kernels.Dropout`)."""
    at = [None if g is None else C.group_rank_size(g) for g in blocks]
    if dense:       # the whole tensor's mask, drawn as the dense op draws it; keep this block
        gshape = [s * (a[1] if a else 1) for s, a in zip(x.shape, at)]
        noise = torch.empty(gshape, dtype=x.dtype, device=x.device).bernoulli_(1 - p)
        layout = ShardSpec(dims=tuple((f"d{d}",) if g else () for d, g in enumerate(blocks)), segments=segments)
        return layout.block(noise, at).div(1 - p)
    if x.device.type == "meta":
        return torch.empty_like(x, memory_format=torch.contiguous_format)
    if x.device.type == "cuda":
        return _philox_block_mask(x, p, at)
    base = int(torch.randint(0, 2 ** 62, (1,), device="cpu").item())       # one draw: the same on every rank
    g = torch.Generator(device=x.device).manual_seed(hash((base,) + tuple(a[0] if a else -1 for a in at)) % 2 ** 62)
    noise = torch.empty(x.shape, dtype=x.dtype, device=x.device).bernoulli_(1 - p, generator=g)
    return noise.div_(1 - p)


def _philox_block_mask(x: torch.Tensor, p: float, at) -> torch.Tensor:
    """The CUDA way to a per-block stream: no new generator and no host read. The
    device's default Philox generator is in the same state on every rank; this block
    draws at an offset of its own (block index × a stride no draw of ``x``'s size can
    pass), and every rank then moves the generator past all blocks alike, so the
    generators stay in step. Replicas of a block draw the same mask."""
    gen = torch.cuda.default_generators[x.device.index if x.device.index is not None else torch.cuda.current_device()]
    start = gen.get_offset()
    stride = -(-x.numel() // 4) * 4 + 4         # Philox yields 4 values per offset step: a bound on one draw
    index, blocks = 0, 1
    for a in at:
        if a is not None:
            index, blocks = index * a[1] + a[0], blocks * a[1]
    gen.set_offset(start + index * stride)
    noise = torch.empty(x.shape, dtype=x.dtype, device=x.device).bernoulli_(1 - p, generator=gen)
    gen.set_offset(start + blocks * stride)
    return noise.div_(1 - p)


_DROPOUT_ACTIVE = contextvars.ContextVar("autoshard_dropout_active", default=True)


@contextlib.contextmanager
def dropout_active(on: bool):
    """Within it, the dropout kernels drop (``on``) or pass values through: a sharded
    module captured in train mode follows its own ``.train()`` / ``.eval()``."""
    token = _DROPOUT_ACTIVE.set(on)
    try:
        yield
    finally:
        _DROPOUT_ACTIVE.reset(token)


def dropout(x: torch.Tensor, *, p: float, dense: bool, blocks, segments) -> torch.Tensor:
    """Dropout with rank-consistent masks of a value whose split dims are those with a
    group in ``blocks`` (each holding ``segments[d]`` fused blocks)."""
    if p == 0 or not _DROPOUT_ACTIVE.get():
        return x
    if p == 1:
        return x * 0
    return x * _dropout_mask(x, p, dense, blocks, segments)


def attention_dropout(q, k, v, attn_mask=None, *, is_causal: bool, scale, enable_gqa: bool, p: float, dense: bool,
                      blocks, segments):
    """``scaled_dot_product_attention`` with dropout, by its math path (the one the
    dense op takes on CPU), the probabilities dropped out by :func:`dropout`."""
    L, S = q.shape[-2], k.shape[-2]
    factor = 1 / math.sqrt(q.shape[-1]) if scale is None else scale
    if enable_gqa:
        k, v = _expand_kv(k, q.shape[-3]), _expand_kv(v, q.shape[-3])
    attn = (q * math.sqrt(factor)) @ (k * math.sqrt(factor)).transpose(-2, -1)
    if is_causal:
        keep = torch.ones(L, S, dtype=torch.bool, device=q.device).tril()
        attn = attn.masked_fill(~keep, float("-inf"))
    attn = _masked(attn, attn_mask)
    # the math path's safe softmax: a row masked everywhere (left padding) is 0, not NaN
    attn = dropout(torch.ops.aten._safe_softmax.default(attn, -1), p=p, dense=dense, blocks=blocks, segments=segments)
    return attn @ v


# ---------------------------------------------------------------- ring attention
def _masked(scores, mask):
    """``scores`` under an attention ``mask``: a bool mask keeps its True entries (the rest
    ``-inf``), a float mask is added; None leaves them as they are."""
    if mask is None:
        return scores
    return scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask


def _expand_kv(k, heads: int):
    """``k`` with its heads (dim -3) repeated to ``heads`` (grouped-query attention)."""
    return k if k.shape[-3] == heads else k.repeat_interleave(heads // k.shape[-3], dim=-3)


def _fold_kv(dk, heads: int):
    """The gradient of :func:`_expand_kv`: summed back onto ``heads`` kv heads."""
    if dk.shape[1] == heads:
        return dk
    b, h, s, d = dk.shape
    return dk.view(b, heads, h // heads, s, d).sum(2)


_RING_WORK: list[dict] = []


@contextlib.contextmanager
def ring_work():
    """Count the attention scores :func:`ring_attention` computes on this rank (forward),
    in ``box["scores"]``: the blocks a mask hides entirely are skipped, so with a causal
    mask the balanced order gives every rank the same count and the contiguous one does not.

        with ring_work() as box:
            loss = sharded(**batch).loss
        box["scores"]
    """
    box = {"scores": 0}
    _RING_WORK.append(box)
    try:
        yield box
    finally:
        _RING_WORK.remove(box)


def _visible(mask, R: int, p: int, hq: int, hk: int):
    """``vis[a][c]``: whether the rank's query chunk ``a`` (of ``R``) may see key chunk ``c``
    (of ``R·p``, the whole sequence's) anywhere under ``mask``; None: every block is computed
    (no mask, the shape-only trace, or a mask off the CPU: reading it would stop the host
    until the device caught up, every layer, forward and backward; a hidden block computed
    contributes exactly nothing)."""
    if mask is None or mask.device.type != "cpu":
        return None
    m = mask if mask.dtype == torch.bool else mask != float("-inf")
    m = m.unflatten(-2, (R, hq)) if m.shape[-2] != 1 else m.unsqueeze(-3)
    m = m.unflatten(-1, (R * p, hk)).any(-1).any(-2)            # [..., R or 1, R·p]
    m = m.reshape(-1, m.shape[-2], m.shape[-1]).any(0).expand(R, R * p)
    return m.tolist()


def _sub_blocks(group: str, R: int, j: int, vis):
    """``(a, b, c)`` for each score block to compute while rank ``j``'s block is held: query
    chunk ``a``, the block's key chunk ``b`` (chunk ``c`` of the sequence), unless the mask hides it."""
    return [(a, b, c) for a in range(R) for b, c in enumerate(C.held_chunks(group, j)) if vis is None or vis[a][c]]


def _sub_mask(mask, a: int, c: int, hq: int, hk: int):
    """Rows of query chunk ``a`` and columns of key chunk ``c`` of ``mask`` (None stays None)."""
    if mask is None:
        return None
    rows = mask if mask.shape[-2] == 1 else mask[..., a * hq:(a + 1) * hq, :]
    return rows[..., c * hk:(c + 1) * hk]


def _shift(x, group: str, tag: int, overlap: bool):
    """Start one ring step of ``x``; the function returned waits for the received tensor.
    Blocking (the graph op) when the step cannot overlap compute (shape-only trace, compile)."""
    if overlap:
        return C.ring_shift_start(x, group, tag)
    got = C.ring_shift(x, group)
    return lambda: got


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, mask, group: str, scale: float):
        heads, kv_heads = q.shape[1], k.shape[1]
        ctx.group, ctx.scale, ctx.kv_heads = group, scale, kv_heads
        if q.device.type == "meta":
            # the shape-only trace (passes/trace.py) reads only what is saved, and a forward's own
            # ops save nothing: the p·R² blocks are not walked, the results are their shapes
            # (contiguous, as the merge's torch.where makes them; docs/design.md, "Pricing the search")
            out, lse = torch.empty(q.shape, dtype=q.dtype, device="meta"), \
                torch.empty(q.shape[:-1] + (1,), dtype=torch.promote_types(q.dtype, torch.float32), device="meta")
            ctx.save_for_backward(q, k, v, out, lse, *(() if mask is None else (mask,)))
            return out
        r, p = C.group_rank_size(group)
        R = len(C.held_chunks(group, r))
        hq, hk = q.shape[-2] // R, k.shape[-2] // R
        vis = _visible(mask, R, p, hq, hk)
        overlap = _overlap(q)
        # running max, sum and output in float32 at least (bf16 under autocast), as the dense kernels accumulate
        acc = torch.promote_types(q.dtype, torch.float32)
        m = torch.full(q.shape[:-1] + (1,), float("-inf"), dtype=acc, device=q.device)
        l = torch.zeros_like(m)
        o = torch.zeros(q.shape, dtype=acc, device=q.device)
        kv = torch.stack([k, v])
        for step in range(p):
            j = (r - step) % p                  # the block held now started on rank j
            nxt = _shift(kv, group, 0, overlap) if step < p - 1 else None
            for a, b, c in _sub_blocks(group, R, j, vis):
                rows, cols = slice(a * hq, (a + 1) * hq), slice(b * hk, (b + 1) * hk)
                kj, vj = _expand_kv(kv[0][..., cols, :], heads), _expand_kv(kv[1][..., cols, :], heads)
                s = _masked((q[..., rows, :] @ kj.transpose(-2, -1)).to(acc) * scale, _sub_mask(mask, a, c, hq, hk))
                for box in _RING_WORK:
                    box["scores"] += s.numel()
                m_old = m[..., rows, :]
                m_new = torch.maximum(m_old, s.amax(-1, keepdim=True))
                base = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)
                e = torch.exp(s - base)
                alpha = torch.exp(m_old - base)
                l[..., rows, :] = l[..., rows, :] * alpha + e.sum(-1, keepdim=True)
                o[..., rows, :] = o[..., rows, :] * alpha + (e.to(vj.dtype) @ vj).to(acc)
                m[..., rows, :] = m_new
            if nxt is not None:
                kv = nxt()
        base = torch.where(torch.isinf(m), torch.zeros_like(m), m)
        # a row no key may see (a padding query under a causal mask) is 0, as the dense op's
        # safe softmax makes it; its log-sum-exp +inf makes its probabilities 0 in backward
        seen = l > 0
        out = torch.where(seen, o / torch.where(seen, l, torch.ones_like(l)), torch.zeros_like(o)).to(q.dtype)
        lse = torch.where(seen, base + torch.log(torch.where(seen, l, torch.ones_like(l))), torch.full_like(l, float("inf")))
        ctx.save_for_backward(q, k, v, out, lse, *(() if mask is None else (mask,)))
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, *mask = ctx.saved_tensors
        mask = mask[0] if mask else None
        group, scale = ctx.group, ctx.scale
        r, p = C.group_rank_size(group)
        R = len(C.held_chunks(group, r))
        heads = q.shape[1]
        hq, hk = q.shape[-2] // R, k.shape[-2] // R
        vis = _visible(mask, R, p, hq, hk)
        overlap = _overlap(q)
        dout = dout.contiguous()
        acc = lse.dtype         # the forward's accumulation dtype (float32 at least)
        delta = (dout.to(acc) * out.to(acc)).sum(-1, keepdim=True)
        dq = torch.zeros(q.shape, dtype=acc, device=q.device)
        # a float mask with a gradient (T5's learned position bias): d(bias) = d(scores)
        dmask = torch.zeros_like(mask) if mask is not None and ctx.needs_input_grad[3] else None
        kv = torch.stack([k, v])
        partial = None          # the held block's dk/dv from the ranks that held it before, on its way
        for step in range(p):
            j = (r - step) % p
            nxt = _shift(kv, group, 0, overlap) if step < p - 1 else None
            d = torch.zeros_like(kv)            # this rank's dk, dv of block j
            for a, b, c in _sub_blocks(group, R, j, vis):
                rows, cols = slice(a * hq, (a + 1) * hq), slice(b * hk, (b + 1) * hk)
                qa, da = q[..., rows, :], dout[..., rows, :]
                kj, vj = _expand_kv(kv[0][..., cols, :], heads), _expand_kv(kv[1][..., cols, :], heads)
                prob = torch.exp(_masked((qa @ kj.transpose(-2, -1)).to(acc) * scale, _sub_mask(mask, a, c, hq, hk))
                                 - lse[..., rows, :])
                d[1][..., cols, :] += _fold_kv(prob.to(da.dtype).transpose(-2, -1) @ da, ctx.kv_heads)
                dscores = prob * ((da @ vj.transpose(-2, -1)).to(acc) - delta[..., rows, :])
                if dmask is not None:   # summed over the dims the mask broadcasts on (none: as is)
                    sub = _sub_mask(dmask, a, c, hq, hk)
                    wide = [x for x in range(dscores.dim()) if sub.shape[x] == 1 and dscores.shape[x] != 1]
                    sub += dscores.sum(wide, keepdim=True) if wide else dscores
                ds = (dscores * scale).to(q.dtype)
                dq[..., rows, :] += ds @ kj
                d[0][..., cols, :] += _fold_kv(ds.transpose(-2, -1) @ qa, ctx.kv_heads)
            if partial is not None:
                d += partial()
            # block j's sums move on with the block (after the last step: home, to rank j)
            partial = _shift(d, group, 1, overlap) if p > 1 else (lambda d=d: d)
            if nxt is not None:
                kv = nxt()
        home = partial()
        return dq.to(q.dtype), home[0], home[1], dmask, None, None


def ring_attention(q, k, v, mask, *, group: str, scale: float | None = None):
    """Attention of this rank's queries over the keys and values of every rank of
    ``group``, each rank holding one block of the sequence (its rank's contiguous block,
    or chunks r and 2p-1-r in the balanced order, :func:`~autoshard.runtime.collectives.is_balanced`);
    ``mask`` has this rank's query rows and every key column. Exact: the blocks' partial
    softmax results are merged through their log-sum-exp; a block the mask hides entirely
    is not computed, and the next block travels while this one is (asynchronous send/recv)."""
    if scale is None:
        scale = q.shape[-1] ** -0.5
    # under autocast in its compute dtype, as autocast runs scaled_dot_product_attention: the
    # key/value blocks travel at half the bytes (rotary embeddings leave q and k in float32)
    wire = _wire_dtype(q)
    q, k, v = (_to_wire(t, wire) for t in (q, k, v))
    return _RingAttention.apply(q, k, v, mask, group, float(scale))


def sequence_conv(x, w, b, *, group: str, left: int, right: int, dilation: int = 1, groups: int = 1):
    """:func:`autoshard.ir.tokens.sequence_conv` of this rank's blocks of the sequence (the last
    dim of ``x``, split over ``group``: one block, or chunks r and 2p-1-r in the balanced order).
    The ``right`` first and ``left`` last rows of every block are all-gathered (one call,
    in sequence order: the group's own order); each block is convolved with the ``left``
    rows before it and the ``right`` after it (zeros at the sequence's ends). Backward:
    autograd, the edge rows' gradients reduce-scattered back to their blocks."""
    r, p = C.group_rank_size(group)
    index = C.held_chunks(group, r)           # the chunks this rank's blocks are, in the sequence
    R = len(index)
    n, h = x.shape[-1] // R, left + right
    if n < max(left, right):
        raise ValueError(f"a convolution over the sequence reaches {left} rows back and {right} ahead, past the "
                         f"{n} rows of a cp block: use a sequence of at least {max(left, right) * R * p} tokens")
    blocks = [x[..., a * n:(a + 1) * n] for a in range(R)]
    edges = torch.cat([torch.cat([blk[..., :right], blk[..., n - left:]], -1) for blk in blocks], -1)
    every = C.gather_partial(edges, edges.dim() - 1, group)        # [..., R·p·h]: each block's edges in order
    last = R * p - 1
    outs = []
    for a, g in enumerate(index):
        before = every[..., (g - 1) * h + right:g * h] if g > 0 else x.new_zeros(x.shape[:-1] + (left,))
        after = every[..., (g + 1) * h:(g + 1) * h + right] if g < last else x.new_zeros(x.shape[:-1] + (right,))
        outs.append(F.conv1d(torch.cat([before, blocks[a], after], -1), w, b, 1, 0, dilation, groups))
    return torch.cat(outs, -1) if R > 1 else outs[0]


# The implementation of each kernel class of autoshard.ir.kernels: the IR says what a
# kernel needs (Kernel.call_args), this table says what runs it.
_IMPLEMENTATIONS = {
    K.RowLinear: row_linear, K.Summa: summa, K.ThreeDLinear: three_d, K.PartialHead: partial_head,
    K.VocabEmbedding: vocab_embedding, K.DistLayerNorm: dist_layer_norm, K.SyncBatchNorm: sync_batch_norm,
    K.CrossEntropy: cross_entropy,
    K.Dropout: dropout, K.AttentionDropout: attention_dropout, K.RingAttention: ring_attention,
    K.SequenceConv: sequence_conv,
}


def casting_kernels() -> frozenset:
    """The kernels that cast their operands to autocast's compute dtype before they gather
    them (a value only they read may be cast before an earlier gather too)."""
    return frozenset((row_linear, summa, three_d, partial_head, gathered_linears))


def bind(kernel: K.Kernel, node, group, size) -> tuple:
    """``(function, args, kwargs)`` computing ``node`` with ``kernel``: the function
    registered for its class (the nearest base class that has one) with the
    arguments the kernel names (:meth:`~autoshard.ir.kernels.Kernel.call_args`)."""
    for cls in type(kernel).__mro__:
        fn = _IMPLEMENTATIONS.get(cls)
        if fn is not None:
            args, kwargs = kernel.call_args(node, group, size)
            return fn, args, kwargs
    raise TypeError(f"no runtime implementation for kernel {type(kernel).__name__}; "
                    f"registered: {sorted(c.__name__ for c in _IMPLEMENTATIONS)}")
