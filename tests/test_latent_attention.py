"""DeepSeek-V3's multi-head latent attention (MLA) split by heads in 1d (issue 57), as
Megatron's MLA tensor parallelism splits it: the up projections (``q_proj`` or
``q_b_proj``, ``kv_b_proj``) column-parallel by heads, attention per local head,
``o_proj`` row-parallel; the down projections (``q_a_proj``, ``kv_a_proj_with_mqa``,
whose outputs every head reads) whole, each with a note naming the op that keeps it
whole (docs/design.md, "Low-rank and latent projections").

Before, ``kv_b_proj`` (and with it ``o_proj`` where the query is low-rank) was whole: its
keys are built in a buffer, ``k = kv.new_empty(...)``, ``k[..., :nope].copy_(k_nope)``,
``k[..., nope:].copy_(k_rot)``, and no rule kept the heads' split through it; a query with
``q_lora_rank`` paired ``q_a_proj`` (column) with ``q_b_proj`` (row), so every rank ran
every head. Planned offline on 2 ranks (no processes); the equivalence to the dense model
runs on gloo ranks (slow)."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import autoshard
import models
from dist_pool import get_pool

UP = ("q_proj", "q_b_proj", "kv_b_proj")      # column: out features (heads) / tp
DOWN = ("q_a_proj", "kv_a_proj_with_mqa")      # whole: their outputs are read by every head


def _plan(name, world=2, mode="1d"):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return autoshard.plan(models.build(name), world_size=world, mode=mode, batch_size=4, seq_len=8)


def _attn(plan, proj):
    return [p for p in plan.params if p.name.endswith(f"self_attn.{proj}.weight")]


def _layouts(plan):
    """Each attention projection's weight spec (the same in every layer) and its bytes per
    rank over the dense bytes."""
    out = {}
    for proj in UP + DOWN + ("o_proj",):
        ps = _attn(plan, proj)
        if not ps:
            continue
        assert len({str(p.spec) for p in ps}) == 1, [(p.name, p.spec) for p in ps]
        share = {p.local_bytes(plan.mesh) / (math.prod(p.global_shape) * p.dtype_bytes) for p in ps}
        out[proj] = (str(ps[0].spec), share.pop())
    return out


def _assert_split_by_heads(plan):
    lay = _layouts(plan)
    assert {k for k in lay if k in UP} in ({"q_proj", "kv_b_proj"}, {"q_b_proj", "kv_b_proj"}), lay
    for proj in UP:
        if proj in lay:
            assert lay[proj] == ("[S(tp), R]", 0.5), (proj, lay)
    assert lay["o_proj"] == ("[R, S(tp)]", 0.5), lay
    for proj in DOWN:
        if proj in lay:
            assert lay[proj] == ("[R, R]", 1.0), (proj, lay)
    assert not plan.fallbacks, [n.name for n in plan.fallbacks]


def _why(plan, proj):
    return {x for n in plan.nodes if n.kind == "linear" and n.module.endswith(f"self_attn.{proj}")
            for x in n.notes if x.startswith("whole:")}


@pytest.mark.slow       # ~10 s: a DeepSeek-V3 export (the plain-module pattern below is the default suite's)
def test_low_rank_query_splits_by_heads():
    """``q_lora_rank`` set (the full model's query): ``q_b_proj`` and ``kv_b_proj`` split
    their heads, ``o_proj`` its in features, each at half the dense bytes per rank;
    ``q_a_proj`` is whole as a low-rank pair's down half (through its RMSNorm) and
    ``kv_a_proj_with_mqa`` names the cut into the latent and the rope key."""
    plan = _plan("deepseekv3-q")
    _assert_split_by_heads(plan)
    q_a, kv_a = _why(plan, "q_a_proj"), _why(plan, "kv_a_proj_with_mqa")
    assert len(q_a) == 2 and all("the down half of a low-rank pair (64 -> 16 -> 64 features" in x for x in q_a), q_a
    assert len(kv_a) == 2 and all("`aten.split_with_sizes.default`" in x and "pieces of widths (16, 8)" in x
                                  for x in kv_a), kv_a
    # the keys' rope part (one head, expanded over all) is cut to the rank's heads: its backward gathers
    # the heads' gradients, as the plan counts (the ledger's figures match it on ranks, below)
    assert plan.parallel_fraction()["vs_ideal"] < 1.08


@pytest.mark.slow       # ~10 s: a second export
def test_full_rank_query_splits_by_heads():
    """The tiny config the other tests use (``q_lora_rank=None``: a plain ``q_proj``)."""
    _assert_split_by_heads(_plan("deepseekv3"))


class _Latent(nn.Module):
    """MLA as a plain module (no Hugging Face class): a low-rank query through an RMSNorm,
    a latent kv with one rope key for all heads, the keys written into a ``new_empty`` buffer."""

    def __init__(self, dim=32, heads=4, q_rank=8, kv_rank=8, nope=4, rope=4, v=8):
        super().__init__()
        self.h, self.nope, self.rope, self.v, self.kv_rank = heads, nope, rope, v, kv_rank
        self.q_a, self.q_b = nn.Linear(dim, q_rank, bias=False), nn.Linear(q_rank, heads * (nope + rope), bias=False)
        self.q_norm, self.kv_norm = nn.RMSNorm(q_rank), nn.RMSNorm(kv_rank)
        self.kv_a = nn.Linear(dim, kv_rank + rope, bias=False)
        self.kv_b = nn.Linear(kv_rank, heads * (nope + v), bias=False)
        self.o = nn.Linear(heads * v, dim, bias=False)

    def forward(self, x):
        b, s, _ = x.shape
        q = self.q_b(self.q_norm(self.q_a(x))).view(b, s, -1, self.nope + self.rope).transpose(1, 2)
        kv, k_rot = torch.split(self.kv_a(x), [self.kv_rank, self.rope], dim=-1)
        kv = self.kv_b(self.kv_norm(kv).view(b, 1, s, self.kv_rank)).view(b, s, -1, self.nope + self.v).transpose(1, 2)
        k_nope, v = torch.split(kv, [self.nope, self.v], dim=-1)
        k_rot = torch.tanh(k_rot).view(b, 1, s, self.rope).expand(-1, k_nope.shape[1], -1, -1)
        k = kv.new_empty(*kv.shape[:-1], self.nope + self.rope)
        k[..., :self.nope].copy_(k_nope)
        k[..., self.nope:].copy_(k_rot)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(o.transpose(1, 2).reshape(b, s, -1))


def test_latent_attention_pattern_splits_by_heads():
    """The pattern on a plain module (cheap: no Hugging Face model): the up projections
    split by heads, the down ones whole with their notes, the output projection row-split,
    the keys' buffer split by heads and the shared rope key expanded to the local heads."""
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan = autoshard.plan(_Latent(), world_size=2, mode="1d", example_inputs={"x": torch.randn(2, 8, 32)})
    spec = {p.name: str(p.spec) for p in plan.params}
    assert spec == {"q_a.weight": "[R, R]", "q_b.weight": "[S(tp), R]", "q_norm.weight": "[R]",
                    "kv_norm.weight": "[R]", "kv_a.weight": "[R, R]", "kv_b.weight": "[S(tp), R]",
                    "o.weight": "[R, S(tp)]"}, spec
    assert not plan.fallbacks, [n.name for n in plan.fallbacks]
    notes = {n.module: n.notes for n in plan.nodes if n.kind == "linear"}
    assert "the down half of a low-rank pair" in notes["q_a"][0] and "(8, 4)" in notes["kv_a"][0], notes
    # the rope key is expanded to the rank's heads only (no local slice of all heads, whose backward
    # would all-gather them): its gradient all-reduced in backward at its one-head size, the writes local
    (ex,) = [n for n in plan.nodes if n.op == "expand"]
    assert str(ex.out_spec) == "[R, S(tp), R, R]" and ex.local_shape[1] == 2, (ex.out_spec, ex.local_shape)
    one_head = math.prod(ex.global_shape) // ex.global_shape[1] * 4          # [b, 1, s, rope] in fp32
    assert [(c.phase, c.kind, c.buffer_bytes) for c in ex.comms] == [("bwd", "all_reduce", one_head)], ex.comms
    assert [n.arg_steps for n in plan.nodes if n.op in ("new_empty", "copy_")] == [(), (), ()]


def _check(rank, world, name, mode="1d"):
    return models.check(rank, world, name, mode, steps=3)


@pytest.mark.slow       # 2 ranks, two exports and 3 AdamW steps per config (~40 s each)
@pytest.mark.parametrize("name", ["deepseekv3", "deepseekv3-q"])
def test_mla_1d_equals_dense(name):
    """Loss, logits, the router's outputs and every local gradient within 1e-5 of dense,
    3 AdamW steps alike; the collectives the ledger records are the plan's, and the local
    parameters' bytes are the plan's (where q_b_proj / kv_b_proj / o_proj hold half)."""
    for rank, r in enumerate(get_pool(2, timeout=900).run(_check, name)):
        assert r["failures"] == [], f"rank {rank}: {r['failures'][:5]}"
        assert r["fallbacks"] == []
        assert (r["ledger_bytes"], r["ledger_calls"]) == (r["plan_bytes"], r["plan_calls"]), f"rank {rank}"
        assert r["param_bytes"] == r["plan_param_bytes"]
        assert len(r["losses"]) == 3 and abs(r["dense_losses"][-1] - r["dense_losses"][0]) > 1e-3
        assert all(abs(a - b) <= 1e-5 for a, b in zip(r["losses"], r["dense_losses"])), r


@pytest.mark.extended   # 4 ranks (~75 s)
def test_mla_2d_equals_dense():
    """2d@4 (the low-rank query): exact with 3 AdamW steps, the ledger the plan's. The cut of
    ``kv_a_proj_with_mqa``'s output into latent and rope key is gathered over col (a fallback),
    as are the router's gate and its ``scatter_`` (docs/design.md, "Low-rank and latent projections")."""
    for rank, r in enumerate(get_pool(4, timeout=900).run(_check, "deepseekv3-q", "2d")):
        assert r["failures"] == [], f"rank {rank}: {r['failures'][:5]}"
        assert (r["ledger_bytes"], r["ledger_calls"]) == (r["plan_bytes"], r["plan_calls"]), f"rank {rank}"
        assert all(abs(a - b) <= 1e-5 for a, b in zip(r["losses"], r["dense_losses"])), r


@pytest.mark.slow       # 4 ranks, a DeepSeek-V2 export and 3 AdamW steps (~20 s)
def test_deepseek_v2_2d_ledger_is_the_plan():
    """DeepSeek-V2 (its rotary embedding complex: ``view_as_complex``, a complex product,
    ``view_as_real``) at 2d@4: exact with 3 AdamW steps, and the ledger's collectives the
    plan's. Before, the complex values were not known to need a gradient, so the plan left
    out the backward all-gather of each complex fallback's row-scattered output: 8 calls
    more in the ledger than in the plan (tests/passes/test_grad_needs.py has the pattern)."""
    for rank, r in enumerate(get_pool(4, timeout=900).run(_check, "deepseekv2", "2d")):
        assert r["failures"] == [], f"rank {rank}: {r['failures'][:5]}"
        assert (r["ledger_bytes"], r["ledger_calls"]) == (r["plan_bytes"], r["plan_calls"]), f"rank {rank}"
        assert len(r["losses"]) == 3 and abs(r["dense_losses"][-1] - r["dense_losses"][0]) > 1e-3
        assert all(abs(a - b) <= 1e-5 for a, b in zip(r["losses"], r["dense_losses"])), r
