"""Dropout of a split tensor: each rank draws its own block of the dense tensor's mask,
so the sharded run drops what the dense run drops (:func:`dropout_active` follows
the module's train / eval mode)."""

from __future__ import annotations

import contextlib
import contextvars

import torch

from .. import collectives as C
from ...ir.spec import ShardSpec

__all__ = ["dropout", "dropout_active"]


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
