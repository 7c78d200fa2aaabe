"""Mixture-of-experts (issue 21): the experts' weights are split, exactly.

A Mixtral-style layer (router Linear, top-2 of 4 experts, the experts as one
grouped matmul over a 3-D weight) is planned from the graph like a dense MLP:
``autoshard/passes/experts.py`` gives the grouped matmul its parameter as a
direct operand, and the 1d Linear rules split each expert's ``gate_up`` on its
output features (two fused blocks) and ``down`` on its input features; the
partial sum is reduced once, after the routing weights and the top-k sum.
"""

from __future__ import annotations

import pytest

import models
from dist_pool import get_pool

import autoshard
from autoshard.ir.grouped import grouped_linear
from autoshard.passes.capture import capture
from autoshard.passes.experts import fold_grouped_weights


def test_fold_keeps_the_values():
    """The folded graph (parameters as direct operands of grouped_linear) gives the
    dense logits, loss and gradients, and every grouped matmul is a Linear."""
    from autoshard.passes.annotate import annotate

    model = models.build("mixtral")
    inputs = models.batch("mixtral")
    cap = capture(model, example_inputs=inputs)
    folded = fold_grouped_weights(cap)
    assert folded.module is not cap.module
    grouped = [n for n in folded.module.graph.nodes if n.target is grouped_linear]
    assert len(grouped) == 4
    ann = annotate(folded.module)
    assert {ann[n.name].kind for n in grouped} == {"linear"}
    assert fold_grouped_weights(folded) is folded
    models.assert_same_values(cap, folded, inputs)


# (mode, world, depth, the mode's weight split); the mixtral cells of the support matrix
CASES = [pytest.param(m, w, d, ways, id=f"{m}-{w}") for m, w, d, ways in
         [("1d", 2, None, 2), ("1d", 4, None, 4), ("2d", 4, None, 4), ("2.5d", 8, 2, 4), ("3d", 8, None, 8)]]


@pytest.mark.parametrize("mode,world,depth,ways", CASES)
def test_moe_equals_dense(mode, world, depth, ways):
    """Every mode: logits, loss (with the router's auxiliary loss), router logits,
    every local gradient and 2 AdamW steps equal dense; ledger = plan; the experts
    are split, so the parameter bytes per rank are within 1.15x of dense / the
    mode's weight split (p; q² in 2.5d, whose depth replicates the weights).

    With the batch split (2d, 2.5d, 3d) each rank routes its own tokens: the sort
    by expert, the gathers / scatters by its indices and the per-expert counts are
    rank-local (``passes/row_order.py``), and the counts are summed where a
    consumer needs the dense ones (the load-balancing loss)."""
    results = get_pool(world, timeout=600).run(models.check, "mixtral", mode, depth, 2, None, 1, True)
    for rank, r in enumerate(results):
        assert r["failures"] == [], f"rank {rank}: {r['failures']}"
        assert r["param_bytes"] == r["plan_param_bytes"]
        assert (r["ledger_bytes"], r["ledger_calls"]) == (r["plan_bytes"], r["plan_calls"])
        assert r["fallbacks"] == []
        for a, b in zip(r["losses"], r["dense_losses"]):
            assert abs(a - b) <= 1e-5, (r["losses"], r["dense_losses"])
    dense_bytes = sum(p.numel() * 4 for p in models.build("mixtral").parameters())
    assert results[0]["param_bytes"] <= 1.15 * dense_bytes / ways, (results[0]["param_bytes"], dense_bytes)


def test_moe_plan_shows_the_experts():
    """The expert matmuls are rows of the plan table, split per expert."""
    plan = autoshard.plan(models.build("mixtral"), world_size=4, mode="1d", batch_size=4, seq_len=8,
                          example_inputs=models.batch("mixtral"))
    experts = {p.name: p.spec for p in plan.params if ".experts." in p.name}
    assert experts and all(s.axes == ("tp",) for s in experts.values()), experts
    rows = [n for n in plan.nodes if n.op == "grouped_linear"]
    assert len(rows) == 4 and all(n.kind == "linear" for n in rows)
    assert {n.weight.split(":")[0] for n in rows} == {"column", "row"}
    assert plan.parallel_fraction()["vs_ideal"] <= 1.15


def _new_signature(rank, world):
    import copy

    import torch

    torch.set_num_threads(1)
    dense = models.build("mixtral").eval()
    ids = models.batch("mixtral")["input_ids"]
    sharded = autoshard.shard(copy.deepcopy(dense), mode="1d", example_inputs={"input_ids": ids})
    out = sharded(input_ids=ids, labels=ids)        # another signature: captured again, on meta
    ref = dense(input_ids=ids, labels=ids)
    return len(sharded.signatures), (out.logits - ref.logits).abs().max().item(), abs(out.loss.item() - ref.loss.item())


def test_moe_captured_again_on_meta_runs_on_cpu():
    """A graph captured on meta (a new input signature) took transformers' off-CPU routing
    branch, a ``histc`` of integers the CPU kernel refuses: counted on floats, it runs and
    equals dense (:func:`autoshard.passes.experts.count_on_floats`)."""
    for n, logits_err, loss_err in get_pool(2, timeout=600).run(_new_signature):
        assert n == 2 and logits_err <= 1e-5 and loss_err <= 1e-5
