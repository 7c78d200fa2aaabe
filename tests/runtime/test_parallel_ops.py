"""Kernels of autoshard/runtime/kernels/ checked on one process (shape-only
groups of one rank: no process group)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def test_ring_attention_accumulates_in_float32_under_bf16():
    """bf16 queries, keys and values (autocast's attention inputs): the running sum, max
    and output are float32, as the dense kernel accumulates, so the ring is as close to
    the float64 result as dense bf16 attention is. With the accumulators in bf16 a row's
    sum of 1001 ones per block rounds (1001 needs 10 bits) and the output was 2.7x the
    dense error."""
    from autoshard.runtime import parallel_ops as P

    torch.manual_seed(0)
    s = 2 * 1001            # two blocks (the balanced order's two chunks on one rank)
    q = torch.zeros(1, 2, s, 16)             # equal scores: the output is a mean over many keys
    k, v = torch.randn(1, 2, s, 16), torch.randn(1, 2, s, 16) + 3
    exact = F.scaled_dot_product_attention(q.double(), k.double(), v.double())
    low = [t.bfloat16() for t in (q, k, v)]
    dense = F.scaled_dot_product_attention(*low)
    ring = P.ring_attention(*low, None, group="autoshard-sim:1:balanced")
    assert ring.dtype == torch.bfloat16
    err, dense_err = (ring.double() - exact).abs().max().item(), (dense.double() - exact).abs().max().item()
    assert err <= 1.5 * dense_err, (err, dense_err)


def test_ring_attention_reads_no_mask_off_the_cpu():
    """A mask on an accelerator is not read on the host (every block is computed; a hidden
    block adds exactly nothing); a CPU mask is (no device to wait for)."""
    import types

    from autoshard.runtime.kernels.attention import _visible

    mask = torch.ones(8, 8, dtype=torch.bool).tril()
    assert _visible(mask, 2, 1, 4, 4) == [[True, False], [True, True]]
    assert _visible(mask.to("meta"), 2, 1, 4, 4) is None
    on_gpu = types.SimpleNamespace(device=torch.device("cuda", 0), dtype=torch.bool, shape=mask.shape)
    assert _visible(on_gpu, 2, 1, 4, 4) is None         # untouched: any read of it would raise here


def test_unequal_fused_blocks_gather_and_scatter_in_the_dense_order(monkeypatch):
    """A gather, scatter or reduce-scatter of a dim of unequal fused blocks (``Step.segments`` a tuple of
    widths: Phi-3's q, k, v with fewer kv heads) re-orders around one collective: the
    gathered ``[q_0 k_0 v_0 | q_1 k_1 v_1]`` becomes the dense ``[q | k | v]``, and a
    scatter hands rank r the block ``ShardSpec.local`` gives it. The collectives are
    simulated for 2 ranks (the real ones run in tests/test_fused_blocks.py)."""
    from autoshard.ir.mesh import Mesh
    from autoshard.ir.spec import ShardSpec
    from autoshard.runtime import collectives as C
    from autoshard.runtime.kernels.common import on_segments

    mesh, spec = Mesh(axes=("tp",), sizes=(2,)), ShardSpec(dims=((), ("tp",)), widths=((), (4, 1, 1)))
    dense = torch.randn(3, 24)
    locals_ = [spec.local(dense, mesh, r) for r in range(2)]
    gathered = on_segments(lambda t, d, g: torch.cat(locals_, d), locals_[0], 1, "autoshard-sim:2", (4, 1, 1))
    assert torch.equal(gathered, dense)
    for r in range(2):
        fake = lambda t, d, g, r=r: t.chunk(2, d)[r]       # noqa: E731 - rank r's contiguous chunk
        monkeypatch.setattr(C, "scatter_to", fake)
        assert torch.equal(on_segments(fake, dense, 1, "autoshard-sim:2", (4, 1, 1)), locals_[r])
        summed = lambda t, d, g, r=r: (2 * t).chunk(2, d)[r]       # noqa: E731 - two equal partial sums
        monkeypatch.setattr(C, "reduce_scatter", summed)
        assert torch.equal(on_segments(summed, dense, 1, "autoshard-sim:2", (4, 1, 1)), 2 * locals_[r])
