"""The pipeline cut (passes/stages.py): blocks balanced whole, the graph split with every
crossing value carried or recomputed."""

from __future__ import annotations

import pytest
import torch

from models import batch
from test_pipeline_parallel import _build


def test_balance_keeps_blocks_whole_and_weighs_the_ends():
    from autoshard.passes.stages import balance

    assert balance([1, 1, 1, 1], 2) == (0, 2)
    assert balance([1, 1, 1, 1], 4) == (0, 1, 2, 3)
    assert balance([1] * 6, 3) == (0, 2, 4)
    assert balance([1] * 6, 3, tail=2) == (0, 2, 5)       # the head and the loss weigh on the last stage
    assert balance([4, 1, 1, 1, 1], 2) == (0, 1)
    # memory bounds every stage: the time-best cut (0, 1) would put 3 blocks' bytes on stage 1
    assert balance([1, 1, 1, 1], 2, head=2.5, memory=[1, 1, 1, 1], limit=2) == (0, 2)
    from autoshard.ir.errors import ConfigError

    with pytest.raises(ConfigError, match="no cut of 4 blocks into 2 pipeline stages fits"):
        balance([1, 1, 1, 1], 2, memory=[1, 1, 1, 1], mem_tail=1, limit=2)


@pytest.mark.slow
def test_cut_stages_compute_what_the_graph_computes():
    """The captured Llama graph cut after its first block: stage 0 then stage 1 give the
    graph's own outputs; the rotary cos/sin, the mask and the hidden states cross the cut
    as tensors, and no symbolic size does (it is recomputed on stage 1)."""
    from torch.fx._pytree import tree_flatten_spec

    from autoshard.passes.capture import capture
    from autoshard.passes.stages import blocks_in_order, cut

    model = _build("llama")
    b = batch("llama", b=2, s=8)
    cap = capture(model, example_inputs=b)
    gm = cap.module
    keys = blocks_in_order(gm.graph)
    assert keys == ["model.layers.0", "model.layers.1"]
    s0, s1 = cut(gm, keys[1:])
    full = {**cap.constants, **b}
    flat = tree_flatten_spec(((), full), gm._in_spec)
    with torch.no_grad():
        mid = s0.gm(*flat)
        got = s1.gm(*flat, *mid)
        want = gm(**full)
    assert len(mid) == len(s1.carried_in) == len(s0.carried_out) >= 3
    assert all(isinstance(t, torch.Tensor) for t in mid)
    assert torch.equal(got[0], want.loss) and torch.equal(got[1], want.logits)
    assert s0.blocks == ("model.layers.0",) and s1.blocks == ("model.layers.1",)
    assert "lm_head.weight" in s1.tensors and "lm_head.weight" not in s0.tensors
    assert any(n.target is torch.ops.aten.sym_size.int for n in s1.gm.graph.nodes)
