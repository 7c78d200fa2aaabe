"""Pipeline parallelism (autoshard/pipeline_parallel.py, passes/stages.py,
autoshard/training/pipeline.py): stages cut from the graph, run by torch's schedules, trained
against the dense model on the same micro-batches (losses and the gathered state dict)."""

from __future__ import annotations

import copy

import pytest
import torch

from dist_pool import get_pool
from models import TINY, batch


def _build(name: str, layers: int | None = None, seed: int = 0):
    import transformers

    cls, cfg_cls, kw = TINY[name]
    kw = dict(kw)
    if layers is not None:
        kw["n_layer" if "n_layer" in kw else "num_hidden_layers"] = layers
    torch.manual_seed(seed)
    model = getattr(transformers, cls)(getattr(transformers, cfg_cls)(**kw))
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.2)
    model.train()
    return model


def _train_vs_dense(rank, world, name, mode, pp, schedule, *, layers=None, steps=3, n_mb=4, depth=None, clip=None,
                    save=None):
    """Train the pipelined module and the dense model alike; returns per rank
    (pipelined losses, dense losses, max |state dict difference| on rank 0, stage info)."""
    import autoshard
    from autoshard.training.train import train_step

    torch.set_num_threads(1)
    dense = _build(name, layers)
    model = copy.deepcopy(dense)
    mbs = [batch(name, b=2, s=8, seed=10 + i) for i in range(n_mb)]
    sharded = autoshard.shard(model, mode=mode, pp=pp, schedule=schedule, example_inputs=mbs[0], depth=depth)
    opt_s = torch.optim.AdamW(sharded.parameters(), lr=1e-3)
    opt_d = torch.optim.AdamW(dense.parameters(), lr=1e-3)
    ls, ld, ns, nd = [], [], [], []
    for _ in range(steps):
        loss, norm = train_step(sharded, mbs, opt_s, clip=clip)
        ls.append(loss)
        ns.append(norm)
        loss, norm = train_step(dense, mbs, opt_d, clip=clip)
        ld.append(loss)
        nd.append(norm)
    full = sharded.full_state_dict()
    diff = None
    if rank == 0:
        ref = dense.state_dict()
        missing = sorted(set(ref) - set(full))
        assert not missing, missing
        diff = max(float((full[k].float() - ref[k].float()).abs().max()) for k in ref)
    if save is not None:
        sharded.save_pretrained(save)
    out = sharded(**mbs[0])         # forward through the stages, outputs on every rank
    with torch.no_grad():
        dense_out = dense(**mbs[0])
    fwd = float((out.logits - dense_out.logits).abs().max()), abs(float(out.loss) - float(dense_out.loss))
    return dict(ls=ls, ld=ld, ns=ns, nd=nd, diff=diff, fwd=fwd, stages=sharded.stage_indices, tied=sharded.tied,
                table=sharded.describe_stages(n_mb))


def _check(results, tol_loss=1e-5, tol_state=1e-4):
    for r in results:
        assert max(abs(a - b) for a, b in zip(r["ls"], r["ld"])) < tol_loss, (r["ls"], r["ld"])
        assert r["fwd"][0] < 1e-4 and r["fwd"][1] < 1e-5, r["fwd"]
    assert results[0]["diff"] < tol_state, results[0]["diff"]
    # every rank reports the same loss
    assert all(r["ls"] == results[0]["ls"] for r in results)


def test_llama_1d_tp2_pp2_1f1b():
    res = get_pool(4).run(_train_vs_dense, "llama", "1d", 2, "1f1b")
    _check(res)
    assert [r["stages"] for r in res] == [(0,), (0,), (1,), (1,)]
