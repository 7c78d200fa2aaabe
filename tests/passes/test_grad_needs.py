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


class _ComplexRotary(torch.nn.Module):
    """DeepSeek-V2's rotary embedding: a projection's pairs viewed as complex numbers,
    multiplied by a complex rotation, viewed back as real pairs."""

    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(32, 16)
        self.q, self.o = torch.nn.Linear(16, 16), torch.nn.Linear(16, 32)
        self.register_buffer("freqs", torch.polar(torch.ones(5, 8), torch.rand(5, 8)), persistent=False)

    def forward(self, input_ids):
        q = self.q(self.emb(input_ids))
        qc = torch.view_as_complex(q.float().reshape(*q.shape[:-1], -1, 2))
        return self.o(torch.view_as_real(qc * self.freqs).flatten(-2))


def _needs(module):
    cap = capture(module, example_inputs={"input_ids": torch.zeros(2, 5, dtype=torch.long)})
    gm = cap.module
    need = needs_grad(gm, {n.target for n in gm.graph.nodes if n.op == "get_attr"}, frozenset())
    by_op = {}
    for n in gm.graph.nodes:
        by_op.setdefault(getattr(n.target, "__name__", str(n.target)), []).append(n.name)
    return need, by_op


def test_complex_values_need_a_gradient():
    """Complex values between ``view_as_complex`` and ``view_as_real`` carry the
    projection's gradient: before, only floating values counted, so the complex product
    and ``view_as_real`` were left out (at 2d the plan then missed the backward
    all-gather of each complex fallback's row-scattered output: tests/test_latent_attention.py)."""
    need, by_op = _needs(_ComplexRotary())
    complex_ops = [n for op in ("view_as_complex.default", "mul.Tensor", "view_as_real.default") for n in by_op[op]]
    assert len(complex_ops) == 3 and set(complex_ops) <= need, (by_op, sorted(need))
    assert set(by_op["linear.default"]) <= need


def test_complex_rotary_2d_plan_counts_backward_gathers():
    """At 2d@4 the complex fallbacks gather their input and scatter their output over the
    batch axis: the scatter's backward all-gathers the gradient, which the plan must count."""
    import warnings

    import autoshard
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan = autoshard.plan(_ComplexRotary(), world_size=4, mode="2d",
                              example_inputs={"input_ids": torch.zeros(2, 5, dtype=torch.long)})
    scattered = [n for n in plan.fallbacks if any(s.op == "scatter" for s in n.post)]
    assert {n.op for n in scattered} == {"view_as_complex", "view_as_real"}, [(n.name, n.post) for n in plan.nodes]
    for n in scattered:
        assert any(c.phase == "bwd" and c.kind == "all_gather" for c in n.comms), (n.name, n.comms)
