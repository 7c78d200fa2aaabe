"""What every parallel kernel shares: the re-layout steps the rewrite inserts between
kernels (:func:`step`), the autocast dtype operands travel in (:func:`to_wire`), fused
segments along a dim (:func:`seg`), and the pairing of two collectives in flight
together (:func:`paired_collectives`)."""

from __future__ import annotations

import contextlib

import torch

from .. import collectives as C
from ...ir.spec import regroup

__all__ = ["step", "AUTOCAST_PRODUCTS", "autocast_on", "wire_dtype", "to_wire", "paired_collectives",
           "may_overlap", "seg", "unseg", "collect_two", "on_segments"]


_STEPS = {
    "reduce_from": lambda x, g, dim, m, f: C.reduce_from(x, g),
    "copy_to": lambda x, g, dim, m, f: C.copy_to(x, g),
    "all_reduce_both": lambda x, g, dim, m, f: C.all_reduce_both(x, g),
    "reduce_scatter": lambda x, g, dim, m, f: C.reduce_scatter_to(x, dim, g),
    "gather": lambda x, g, dim, m, f: on_segments(C.gather_from, x, dim, g, m),
    "gather_partial": lambda x, g, dim, m, f: on_segments(C.gather_partial, x, dim, g, m),
    "scatter": lambda x, g, dim, m, f: on_segments(C.scatter_to, x, dim, g, m),
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
        x = to_wire(x, wire_dtype(x))
    return _STEPS[op](x, group, dim, segments, factor)


def _autocast_products() -> frozenset:
    """The ATen products autocast runs in its compute dtype on CPU and CUDA alike (both
    lists name them), casting every floating operand."""
    aten = torch.ops.aten
    return frozenset(getattr(aten, name).default for name in (
        "linear", "mm", "addmm", "bmm", "baddbmm", "addbmm", "matmul", "conv1d", "conv2d", "conv3d"))


AUTOCAST_PRODUCTS = _autocast_products()


def autocast_on(t: torch.Tensor) -> bool:
    """Whether autocast is on for ``t``'s device (never on meta, where the trace runs)."""
    return t.device.type != "meta" and torch.is_autocast_enabled(t.device.type)


def wire_dtype(t: torch.Tensor) -> torch.dtype | None:
    """The dtype a product's operands travel in: autocast's compute dtype while autocast is
    on for ``t``'s device (the product casts them to it anyway), else None (as they are)."""
    return torch.get_autocast_dtype(t.device.type) if autocast_on(t) else None


def to_wire(t: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    """``t`` in ``dtype`` (autocast's compute dtype) when autocast would cast it: a float16,
    bfloat16 or float32 tensor (float64 is not autocast-eligible and stays). Cast before
    gathering: the gathered value is the one the product would have cast, at half the
    bytes on the wire (docs/design.md, "Mixed precision")."""
    if dtype is None or t.dtype == dtype or t.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        return t
    return t.to(dtype)


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


def may_overlap(t) -> bool:
    """Whether a backward may launch a collective asynchronously and compute meanwhile:
    paired collectives on, a real tensor (not the meta trace), not under torch.compile
    (which sees the paired op instead)."""
    return _PAIRED["on"] and t.device.type != "meta" and not torch.compiler.is_compiling()


def seg(t, dim: int, m: int):
    """``t`` with ``dim`` split into ``m`` fused segments (a new dim before it), and the dim to use."""
    if m == 1:
        return t, dim
    shape = list(t.shape)
    return t.reshape(shape[:dim] + [m, shape[dim] // m] + shape[dim + 1:]), dim + 1


def unseg(t, dim: int, m: int):
    """The inverse of :func:`seg`: the segment dim at ``dim`` merged back into the one after it."""
    if m == 1:
        return t
    shape = list(t.shape)
    return t.reshape(shape[:dim] + [-1] + shape[dim + 2:])


def collect_two(kind: str, a, a_dim: int, a_group: str, b, b_dim: int, b_group: str, m_b: int = 1):
    """Two all-gathers (``kind="all_gather"``) or reduce-scatters on two groups, in
    flight together unless :func:`paired_collectives` is off; ``b`` made of ``m_b``
    fused segments along ``b_dim``, each split."""
    bs, bd = seg(b, b_dim, m_b)
    if _PAIRED["on"]:
        ya, yb = (C.all_gather_two if kind == "all_gather" else C.reduce_scatter_two)(a, a_dim, a_group, bs, bd, b_group)
    else:
        one = C.all_gather if kind == "all_gather" else C.reduce_scatter
        ya, yb = one(a, a_dim, a_group), one(bs, bd, b_group)
    return ya, unseg(yb, b_dim, m_b)


def on_segments(fn, t, dim: int, group: str, m):
    """Apply a dim-wise collective to a dim made of ``m`` fused segments, each split; ``m``
    a tuple: the relative widths of unequal fused blocks (``ShardSpec.widths``: Phi-3's q,
    k, v), re-ordered around one collective, the same calls and bytes as equal blocks."""
    if isinstance(m, tuple):
        p = C.group_rank_size(group)[1]
        if fn in (C.scatter_to, C.reduce_scatter):      # whole -> rank-major [q_0 k_0 v_0 | q_1 ..], each its chunk
            return fn(regroup(t, dim, m, p, rank_major=True), dim, group)
        return regroup(fn(t, dim, group), dim, m, p, rank_major=False)
    ts, d = seg(t, dim, m)
    return unseg(fn(ts, d, group), dim, m)
