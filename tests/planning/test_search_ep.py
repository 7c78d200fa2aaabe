"""``mode="auto"`` weighs expert parallelism against expert-TP (docs/design.md, "Expert
parallelism"): for a model with grouped expert matmuls the search prices each 1d candidate
also with every ep dividing its dp × cp, the cost model chooses, and the chosen plan's first
grouped matmul notes why. A model without experts gets exactly the candidates it had."""

from __future__ import annotations

import pytest
import transformers

import autoshard
from autoshard.planning.search import candidates, ep_verdict, search

import models


def test_ep_candidates():
    """ep=None adds one 1d candidate per divisor > 1 of dp × cp; a pinned ep keeps the 1d
    candidates it divides; ep=1 (the default) leaves the list as it was."""
    assert [c.label for c in candidates(8, dp=4, ep=None) if c.mode == "1d"] == \
        ["1d [2] × dp4", "1d [2] × dp4 · ep2", "1d [2] × dp4 · ep4"]
    assert [c.label for c in candidates(4, ep=2)] == ["1d [2] × dp2 · ep2", "1d [1] × dp4 · ep2"]
    assert candidates(4) == candidates(4, ep=1) and all(c.ep == 1 for c in candidates(4))


def _moe(hidden=512):
    # experts dominate the parameters (8 × 2 × 512 × 2048 per layer): expert-TP's dp all-reduce of
    # their gradients is what ep removes
    return transformers.MixtralConfig(hidden_size=hidden, intermediate_size=4 * hidden, num_hidden_layers=2,
                                      num_attention_heads=8, num_key_value_heads=8, vocab_size=1024,
                                      num_local_experts=8, num_experts_per_tok=2)


@pytest.mark.slow
def test_auto_chooses_ep_where_it_is_cheaper_and_says_why():
    """Mixtral (hidden 512, 8 experts) on 8 ranks with dp=8: ep=8 is priced below expert-TP (its
    experts' 8-way gradient all-reduce dwarfs the all-to-alls of 8 × 64 tokens) and chosen; the plan
    holds the experts split over dp, the all-to-alls, and the verdict as a note; plan(mode="auto",
    dp=8) returns that plan. A model without experts gets no ep candidate."""
    r = search(_moe(), world_size=8, dp=8, batch_size=8, seq_len=64, modes=["1d"])
    best = r.best
    assert best.candidate.ep == 8, [(e.candidate.label, e.cost and e.cost.step_s) for e in r.results]
    tp = next(e for e in r.ranked if e.candidate.ep == 1 and e.candidate.mesh == best.candidate.mesh)
    assert best.cost.step_s < tp.cost.step_s and best.cost.comm_bytes < tp.cost.comm_bytes
    why = ep_verdict(r.results)
    assert why.startswith("experts: ep=8 chosen by the cost model (1d [1] × dp8 · ep8:") and "over 1d [1] × dp8:" in why
    assert any(why in n.notes for n in r.plan.nodes), "the verdict is a note of the plan"
    assert any(c.kind == "all_to_all" for c in r.plan.comms())
    experts = [p for p in r.plan.params if ".experts." in p.name]
    assert experts and all(p.spec.dims[0] == ("dp",) for p in experts)
    p = autoshard.plan(_moe(), world_size=8, mode="auto", dp=8, batch_size=8, seq_len=64)
    assert sum(c.kind == "all_to_all" for c in p.comms()) == sum(c.kind == "all_to_all" for c in r.plan.comms())
    # no experts: the same candidates as without ep, no verdict
    dense = search(transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                            num_attention_heads=4, num_key_value_heads=4, vocab_size=128),
                   world_size=4, dp=2, batch_size=8, seq_len=16)
    assert all(e.candidate.ep == 1 for e in dense.results) and ep_verdict(dense.results) == ""


@pytest.mark.slow
def test_auto_weighs_and_pins_ep_on_a_tiny_moe():
    """The tiny Mixtral at dp=2 (4 ranks): its experts are small, so the all-to-alls' latency
    outweighs the bytes they save and expert-TP is chosen, the verdict naming both; ep=2 pins
    ep (plan(mode="auto", ep=2) is no longer refused by check_ep): every candidate has it."""
    r = search(models.build("mixtral"), world_size=4, dp=2, batch_size=8, seq_len=8,
               example_inputs=models.batch("mixtral"), modes=["1d"])
    assert {e.candidate.ep for e in r.results} == {1, 2}
    assert r.best.candidate.ep == 1 and ep_verdict(r.results).startswith("experts: expert-TP (ep=1) chosen")
    p = autoshard.plan(models.build("mixtral"), world_size=4, mode="auto", dp=2, ep=2, batch_size=8, seq_len=8,
                       example_inputs=models.batch("mixtral"))
    assert p.mode == "1d" and sum(c.kind == "all_to_all" for c in p.comms()) == 2 * 5
