"""autoshard.passes.squeeze_fold: a bare ``squeeze()`` keeps the capture's meaning on a rank
holding one row of a split batch (MBart's ``shift_tokens_right`` at 2d@4, batch 2, was refused
by the self-check: ``[]`` where the plan expected ``[1]``)."""

from __future__ import annotations

import torch

from autoshard.passes.capture import capture
from autoshard.passes.pipeline import prepare
from autoshard.passes.squeeze_fold import fold_bare_squeezes
from autoshard.policies import make_policy

aten = torch.ops.aten


class _FirstToken(torch.nn.Module):
    def forward(self, input_ids):
        return input_ids.gather(1, input_ids[:, :1]).squeeze() * 2


def test_a_bare_squeeze_keeps_a_one_row_batch():
    cap = capture(_FirstToken(), example_inputs={"input_ids": torch.arange(15).reshape(3, 5) % 5})
    gm = fold_bare_squeezes(cap).module
    assert not any(n.target == aten.squeeze.default for n in gm.graph.nodes)
    one = torch.tensor([[2, 0, 4, 1, 3]])
    out = torch.fx.Interpreter(gm).run(one)                  # a rank's share: one row
    assert out.shape == (1,) and out.tolist() == [8]
    assert _FirstToken()(one).shape == ()                     # the bare squeeze would drop the row
    prepared = prepare(cap, make_policy("2d", 4))
    assert not any(n.target == aten.squeeze.default for n in prepared.module.graph.nodes)
