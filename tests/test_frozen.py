"""Frozen parameters (``requires_grad=False``) in every mode: a constant for the
backward (docs/design.md, frozen parameters and LoRA).

Tiny Llama with the embeddings and layer 0 frozen, on gloo CPU ranks: shard() runs,
loss, logits and every trainable local gradient equal the dense model's within
atol = rtol = 1e-5, frozen slices keep ``requires_grad=False`` and end backward with
``.grad is None``, the plan marks them ``trainable=False`` and plans no gradient
collective for them (no grad sync, no backward collective in the frozen layers), the
ledger equals the plan phase by phase, and 3 AdamW steps over the trainable
parameters track the dense ones (the frozen slices unchanged). The captures are the
ones tests/test_equivalence.py shares (``models.shared_capture``): a capture made from
a model frozen otherwise must not matter, the plan reads the flags of the model given
to shard().
"""

from __future__ import annotations

import copy

import pytest
import torch

import models
from dist_pool import get_pool

STEPS = 3


def _frozen(name: str) -> bool:
    return name.startswith(("model.embed_tokens.", "model.layers.0."))


def _in_frozen_part(module: str) -> bool:
    return module.startswith(("model.embed_tokens", "model.layers.0.")) or module == "model.layers.0"


def check_frozen(rank: int, world: int, mode: str, depth=None, dp: int = 1) -> dict:
    """Run on every rank: the failures of every comparison (empty = exact) and the
    ledger / plan figures, phase by phase (:func:`models.check_trainable`)."""
    torch.set_num_threads(1)
    dense = models.build("llama")
    for n, p in dense.named_parameters():
        p.requires_grad_(not _frozen(n))
    model = copy.deepcopy(dense)
    inputs = models.batch("llama", b=4 * dp)
    tp = world // dp
    rows = slice((rank // tp) * 4, (rank // tp + 1) * 4)
    res, sharded, inputs = models.check_trainable(
        rank, world, dense, model, inputs, mode=mode, depth=depth, dp=dp,
        captured=models.shared_capture("llama", model, {k: v[rows] for k, v in inputs.items()}))
    plan = sharded.plan
    res.update({"frozen_bwd": [n.name for n in plan.nodes if _in_frozen_part(n.module)
                               and any(c.phase == "bwd" for c in n.comms)],
                "bytes": (plan.trainable_bytes_per_rank, plan.frozen_bytes_per_rank, plan.grad_bytes_per_rank,
                          plan.param_bytes_per_rank),
                "local_bytes": (sum(p.numel() * p.element_size() for p in sharded.parameters() if p.requires_grad),
                                sum(p.numel() * p.element_size() for p in sharded.parameters()
                                    if not p.requires_grad))})
    if dp == 1:
        res.update(models.train_trainable(sharded, dense, inputs, STEPS))
    return res


CASES = [  # (world, mode, depth, dp)
    (2, "1d", None, 1),
    (4, "1d", None, 2),
    (4, "2d", None, 1),
    pytest.param((4, "1d-sp", None, 1), marks=pytest.mark.extended),
    pytest.param((8, "2.5d", 2, 1), marks=[pytest.mark.slow, pytest.mark.extended]),
    pytest.param((8, "3d", None, 1), marks=[pytest.mark.slow, pytest.mark.extended]),
]
IDS = ["llama-1d-p2", "llama-1d-tp2-dp2", "llama-2d-q2"]


@pytest.mark.parametrize("case", CASES, ids=IDS + ["llama-1d-sp-p4", "llama-2.5d-q2d2", "llama-3d-q2"])
def test_frozen_equals_dense(case):
    world, mode, depth, dp = case
    results = get_pool(world, timeout=600).run(check_frozen, mode, depth, dp)
    for rank, r in enumerate(results):
        assert r["failures"] == [], f"rank {rank}: {r['failures']}"
        assert r["ledger"] == r["plan"], f"rank {rank}: ledger {r['ledger']} vs plan {r['plan']}"
        assert r["frozen_bwd"] == [], f"backward collectives planned in the frozen layers: {r['frozen_bwd']}"
        trainable, frozen, grads, total = r["bytes"]
        assert frozen > 0 and trainable + frozen == total and grads == trainable
        assert r["local_bytes"] == (trainable, frozen)
        if dp == 1:
            assert r["frozen_moved"] == []
            assert abs(r["dense_losses"][-1] - r["dense_losses"][0]) > 1e-3, "the steps must move the loss"
            for a, b in zip(r["losses"], r["dense_losses"]):
                assert abs(a - b) <= 1e-5, (r["losses"], r["dense_losses"])
    assert len({r["loss"] for r in results}) == 1, [r["loss"] for r in results]


def test_plan_counts_frozen_bytes():
    """On meta, no processes: the frozen parameters plan no gradient sync and no
    gradient bytes; the estimate charges gradients and AdamW state for the trainable
    ones only, and a plan with every parameter trainable has more backward collectives."""
    import autoshard
    from autoshard.ir.plan import ShardingPlan
    from autoshard.planning.cost import estimate

    m = models.build("llama")
    for n, p in m.named_parameters():
        p.requires_grad_(not _frozen(n))
    p = autoshard.plan(m, world_size=4, mode="2d", batch_size=4, seq_len=8)
    full = autoshard.plan(models.build("llama"), world_size=4, mode="2d", batch_size=4, seq_len=8)
    assert {pp.name for pp in p.params if not pp.trainable} == {n for n, _ in m.named_parameters() if _frozen(n)}
    assert all(not pp.grad_sync for pp in p.params if not pp.trainable)
    assert p.trainable_bytes_per_rank + p.frozen_bytes_per_rank == p.param_bytes_per_rank == full.param_bytes_per_rank
    assert p.grad_bytes_per_rank == p.trainable_bytes_per_rank < full.grad_bytes_per_rank
    assert len(p.comms("bwd")) < len(full.comms("bwd")) and p.comms("fwd") == full.comms("fwd")
    s = p.summary()
    assert (s["trainable_bytes_per_rank"], s["frozen_bytes_per_rank"], s["grad_bytes_per_rank"]) == \
        (p.trainable_bytes_per_rank, p.frozen_bytes_per_rank, p.grad_bytes_per_rank)
    assert ShardingPlan.from_json(p.to_json()).params == p.params
    e, ef = estimate(p, "cpu-gloo"), estimate(full, "cpu-gloo")
    assert e.param_bytes == ef.param_bytes and e.grad_bytes == p.grad_bytes_per_rank
    assert e.optimizer_bytes == 2 * 4 * (p.trainable_bytes_per_rank // 4) < ef.optimizer_bytes
