"""The batch contract (docs/design.md, "The batch contract"): ops that couple the
samples of a batch split across ranks compute what the dense model computes on the
global batch. Train-mode BatchNorm runs as SyncBatchNorm (statistics all-gathered over
the batch axes, running statistics from the global figures), cross-entropy in every
form takes the global sum and weight, and an op with no rule is run on whole tensors.

Each cell (tests/batch_models.py): loss, logits, every local gradient and every
buffer (the running statistics) within atol = rtol = 1e-5 of the dense model, then 5
SGD steps whose losses and buffers stay within 1e-5; no fallback row, and the
collective ledger equal to the plan. In `make test`: the label-smoothing and the
weighted ``reduction='none'`` probes and ResNet at 2d@4; SegFormer, the dp cells and
the 8-rank cells are slow."""

from __future__ import annotations

import pytest

import batch_models
from dist_pool import get_pool

# (model, mode, world, depth, dp)
CELLS = [("smoothing", "2d", 4, None, 1), ("weighted_none", "2d", 4, None, 1), ("resnet", "2d", 4, None, 1),
         ("segformer", "2d", 4, None, 1), ("resnet", "1d", 4, None, 2), ("segformer", "1d", 4, None, 2),
         ("resnet", "2.5d", 8, 2, 1), ("segformer", "2.5d", 8, 2, 1)]
FAST = {("smoothing", "2d"), ("weighted_none", "2d"), ("resnet", "2d")}


def _id(c):
    return f"{c[0]}-{c[1]}@{c[2]}" + (f"-dp{c[4]}" if c[4] > 1 else "")


@pytest.mark.parametrize("cell", [pytest.param(c, id=_id(c), marks=() if (c[0], c[1]) in FAST and c[4] == 1
                                               else pytest.mark.slow) for c in CELLS])
def test_samples_meet_as_in_the_dense_model(cell):
    name, mode, world, depth, dp = cell
    res = get_pool(world, timeout=900).run(batch_models.check, name, mode, depth, dp, 5)
    for rank, r in enumerate(res):
        assert r["failures"] == [], f"rank {rank}: {r['failures'][:6]}"
        assert r["fallbacks"] == [], r["fallbacks"]
        assert r["ledger"] == r["plan"], f"rank {rank}: ledger {r['ledger']} vs plan {r['plan']}"
    if name in ("resnet", "segformer"):        # the batch is split: BatchNorm synced, never local
        assert res[0]["synced"], "no BatchNorm ran as SyncBatchNorm"


def test_batch_norm_refuses_padding():
    """A batch that does not divide the split is padded only where padded rows change
    nothing: a train-mode BatchNorm's statistics would count them."""
    import torch

    from autoshard.ir.signature import pad_blocker
    from autoshard.passes.capture import capture

    m = batch_models.build("resnet")
    cap = capture(m, example_inputs=batch_models.inputs("resnet", b=4))
    why = pad_blocker(cap.module, cap.batch_symbol)
    assert why is not None and "batch_norm" in why, why
    m.eval()
    cap = capture(m, example_inputs=batch_models.inputs("resnet", b=4))
    assert pad_blocker(cap.module, cap.batch_symbol) is None     # running statistics: rows independent
    del torch


def test_plan_rows_say_how_samples_meet():
    """The plan table says which rows couple samples and how."""
    import torch
    import transformers

    import autoshard

    cls, cfg_cls, kw = batch_models.FAMILIES["segformer"]
    with torch.device("meta"):
        m = getattr(transformers, cls)(getattr(transformers, cfg_cls)(**kw)).train()
    p = autoshard.plan(m, world_size=4, mode="2d", batch_size=8, example_inputs=batch_models.inputs("segformer"))
    notes = {n.name: " ".join(n.notes) for n in p.nodes}
    assert "statistics synced over row" in notes["batch_norm"], notes["batch_norm"]
    assert p.node("batch_norm").kernel.name == "sync_batch_norm"
    assert "couples samples: global mean over row" in notes["cross_entropy_loss"], notes["cross_entropy_loss"]
    assert "per sample: rows over row" in notes["upsample_bilinear2d"], notes["upsample_bilinear2d"]
    assert p.fallbacks == []
    import io

    from rich.console import Console

    buf = io.StringIO()
    Console(file=buf, width=400).print(p.table())
    assert "statistics synced over row" in buf.getvalue()     # the synced BatchNorm has its row in the table
