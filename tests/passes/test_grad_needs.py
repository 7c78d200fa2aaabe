"""autoshard.passes.grad_needs: which values backward reaches."""

from __future__ import annotations

import torch

from autoshard.passes.capture import capture
from autoshard.passes.grad_needs import needs_grad


class _FilledKey(torch.nn.Module):
    """DeepSeek-V2's key: two projections copied into the slices of a ``new_empty``, which
    the next layer reads (the ``copy_`` results themselves are read by nothing)."""

    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(32, 16)
        self.a, self.b, self.o = torch.nn.Linear(16, 16), torch.nn.Linear(16, 8), torch.nn.Linear(24, 32)

    def forward(self, input_ids):
        x = self.emb(input_ids)
        a, b = self.a(x), self.b(x)
        k = a.new_empty(*a.shape[:-1], 24)
        k[..., :16].copy_(a)
        k[..., 16:].copy_(b)
        return self.o(k)


def test_values_written_in_place_into_a_read_tensor_need_a_gradient():
    """The plan counted no backward collective for the projections (their gradient
    reduce-scatters at 2d: the ledger had 4 calls more than the plan)."""
    cap = capture(_FilledKey(), example_inputs={"input_ids": torch.zeros(2, 5, dtype=torch.long)})
    gm = cap.module
    params = {n.target for n in gm.graph.nodes if n.op == "get_attr"}
    need = needs_grad(gm, params, frozenset())
    by_op = {}
    for n in gm.graph.nodes:
        by_op.setdefault(str(n.target), []).append(n.name)
    linears = by_op["aten.linear.default"]
    assert len(linears) == 3 and set(linears) <= need, (linears, sorted(need))
    assert set(by_op["aten.copy_.default"]) <= need
