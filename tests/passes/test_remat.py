"""Activation checkpointing (passes/remat.py): blocks are found from numbered
module paths, the checkpointed graph gives bit-identical loss and gradients,
keeps fewer saved activations, and works through autoshard.shard on 2 ranks."""

from __future__ import annotations

import copy

import pytest
import torch

import models
from autoshard.planning.activations import SavedBytes
from dist_pool import get_pool


def _run(gm, inputs):
    for p in gm.parameters():
        p.grad = None
    with SavedBytes(gm.parameters()) as saved:
        out = gm(**inputs)
    out.loss.backward()
    return out.loss.detach(), {k: p.grad.clone() for k, p in gm.named_parameters()}, saved.nbytes


@pytest.mark.parametrize("name", ["gpt2", "llama", "bert"])
def test_checkpointed_graph_is_exact_and_saves_less(name):
    from autoshard.passes.remat import checkpoint_blocks

    b = models.batch(name)
    cap = models.shared_capture(name, models.build(name), b)
    ref = copy.deepcopy(cap.module)            # the shared capture stays untouched (no grads)
    gm = copy.deepcopy(ref)
    assert checkpoint_blocks(gm) == 2                   # one block per layer (2 layers)
    inputs = {**b, **cap.constants}
    l0, g0, s0 = _run(ref, inputs)
    l1, g1, s1 = _run(gm, inputs)
    assert torch.equal(l0, l1)
    assert g0.keys() == g1.keys()                       # parameters keep their names
    for k in g0:
        assert torch.equal(g0[k], g1[k]), k
    assert s1 < 0.75 * s0, (s1, s0)                     # the blocks' activations are not kept


def test_no_numbered_modules_is_a_no_op():
    from torch import fx, nn

    from autoshard.passes.remat import checkpoint_blocks

    gm = fx.symbolic_trace(nn.Sequential(nn.Linear(4, 4), nn.ReLU()))   # paths "0", "1" but no stack meta
    code = gm.code
    assert checkpoint_blocks(gm) == 0 and gm.code == code


def _sharded_remat(rank, world, name):
    import autoshard

    torch.set_num_threads(1)
    dense = models.build(name)
    b = models.batch(name)
    out_d = dense(**b)
    out_d.loss.backward()
    model = copy.deepcopy(dense)
    sharded = autoshard.shard(model, mode="1d", example_inputs=b, activation_checkpointing=True,
                              captured=models.shared_capture(name, model, b))
    n_blocks = sum(1 for n, _ in sharded.graph_module().named_children() if n.startswith("_remat_"))
    out = sharded(**b)
    out.loss.backward()
    dp = dict(dense.named_parameters())
    sp = dict(sharded.named_parameters())
    errs = [(out.loss - out_d.loss).abs().item()]
    for pp in sharded.plan.params:
        errs.append((sp[pp.name].grad - pp.spec.local(dp[pp.name].grad, sharded.mesh, rank)).abs().max().item())
    return n_blocks, max(errs)


def test_shard_with_activation_checkpointing_equals_dense():
    for rank, (n_blocks, err) in enumerate(get_pool(2, timeout=300).run(_sharded_remat, "llama")):
        assert n_blocks == 2, rank
        assert err <= 1e-5, (rank, err)
