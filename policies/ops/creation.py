"""Creation and structure: ``arange`` / ``zeros`` / ``full`` (a size read from the
batch is split over the batch axes), ``*_like``, ``getitem`` of a multi-output op,
and nodes with no tensor layout (``sym_size``).
"""

from __future__ import annotations

import operator

import torch

from autoshard.ir.spec import ShardSpec

from ..base import Choice, RuleContext, SymbolicSizes
from .common import buffer_layout, register, tensor_args
from .views import patch_sizes

aten = torch.ops.aten

__all__ = ["creation", "getitem", "like", "new_empty", "no_spec"]


@register(aten.arange.default, aten.arange.start, aten.arange.start_step, aten.full.default, aten.zeros.default,
          aten.ones.default, aten.new_ones.default, aten.new_zeros.default, aten.new_full.default,
          aten.empty.memory_format, aten.scalar_tensor.default)
def creation(ctx: RuleContext) -> Choice:
    """``arange`` / ``zeros`` / ``full`` ...: a size read from the batch makes that dim split
    over the batch axes (it counts local rows at run time); others are whole."""
    shape = ctx.pshape(ctx.node)
    # a size read from the local batch: the batch, or rows of it leading an arange (its
    # length comes from local sizes at run time)
    lead_rows = ctx.node.target in (aten.arange.default,) and shape and SymbolicSizes.is_rows(shape[0])
    dims = tuple(ctx.batch_axes if ctx.batch_axes and (v == ctx.BATCH or (i == 0 and lead_rows)) else ()
                 for i, v in enumerate(shape))
    return Choice(out=ShardSpec(dims=dims), inputs={p: ctx.spec(a) for p, a in tensor_args(ctx)})


@register(aten.new_empty.default)
def new_empty(ctx: RuleContext) -> Choice:
    """``x.new_empty(sizes)``: a buffer of uninitialised values that the graph fills by
    writes (DeepSeek-V3's MLA builds its keys so: ``k = kv.new_empty(...)``, then
    ``k[..., :nope].copy_(k_nope)``, ``k[..., nope:].copy_(k_rot)``). Only the writes give it
    values, and each write is brought to the buffer's layout (:func:`.pointwise.inplace`),
    so any layout is exact: :func:`~.common.buffer_layout` (a dim of the size and position
    of a split dim of ``x`` takes that split; its literal size patched to the local one),
    else laid out as :func:`creation` lays them."""
    out = buffer_layout(ctx, ctx.node)
    if out is None:
        return creation(ctx)
    x, sizes = ctx.node.args[:2]
    return Choice(out=out, inputs={(0,): ctx.spec(x)}, patches=patch_sizes(ctx, out, sizes, (1,)))


@register(aten.empty_like.default, aten.zeros_like.default, aten.ones_like.default, aten.full_like.default)
def like(ctx: RuleContext) -> Choice:
    """``empty_like`` / ``zeros_like`` ...: the input's layout, fresh values."""
    s = ctx.spec(ctx.node.args[0])
    return Choice(out=s.with_partial(()), inputs={(0,): s})


@register(operator.getitem)
def getitem(ctx: RuleContext) -> Choice:
    """``operator.getitem`` on a multi-output node: the spec of that output."""
    src, i = ctx.node.args
    specs = ctx.spec(src)
    if not isinstance(specs, tuple):
        return Choice(out=None)
    return Choice(out=specs[i])


@register(aten.sym_size.int, aten._assert_tensor_metadata.default)
def no_spec(ctx: RuleContext) -> Choice:
    """Nodes with no tensor layout (``sym_size``, metadata asserts): no spec."""
    return Choice(out=None)
