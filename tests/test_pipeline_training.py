"""Pipeline parallelism's training step (autoshard/training/pipeline.py): the point-to-point
transfers in the ledger against the plan's stages, activation checkpointing inside the
stages, sharded checkpoints written per stage. Cheap: 4 ranks, the tiny 2-layer Llama."""

from __future__ import annotations

import copy

import pytest
import torch

from dist_pool import get_pool
from models import batch
from test_pipeline_parallel import _build


def _p2p_ledger(rank, world):
    """One 1F1B step of Llama tp2 × pp2 over 4 micro-batches and one evaluation forward,
    each in a ledger; returns the counted and the predicted sends and receives."""
    import autoshard
    from autoshard.planning.pipeline_cost import p2p_per_step
    from autoshard.runtime.collectives import CommLedger
    from autoshard.training.train import train_step

    torch.set_num_threads(1)
    mbs = [batch("llama", b=2, s=8, seed=10 + i) for i in range(4)]
    sharded = autoshard.shard(_build("llama"), mode="1d", pp=2, example_inputs=mbs[0])
    opt = torch.optim.AdamW(sharded.parameters(), lr=1e-3)

    def counted(led):
        out = {}
        for c in led.calls:
            if c.kind in ("send", "recv"):
                n, b = out.get(c.kind, (0, 0))
                out[c.kind] = (n + 1, b + c.buffer_bytes)
        return out, sorted({c.group for c in led.calls if c.kind in ("send", "recv")}), \
            sum(1 for c in led.calls if c.group == "pp" and c.kind == "all_reduce")
    with CommLedger() as step:
        train_step(sharded, mbs, opt, clip=1.0)
    with CommLedger() as fwd:
        sharded(**mbs[0])
    want = {k: v for k, v in p2p_per_step(sharded.stages, 4)[sharded.pp_rank].items() if v[0]}
    st = sharded.stages[1]
    eval_want = {"send" if sharded.pp_rank == 0 else "recv": (st.carried_in, st.carried_bytes)}
    return dict(step=counted(step), want=want, fwd=counted(fwd)[0], eval_want=eval_want,
                stage=(st.carried_in, st.carried_bytes, st.grad_in, st.grad_bytes))


def test_p2p_in_the_ledger_is_the_plans():
    """Every activation sent forward and every gradient sent back across the cut is in the
    ledger (kind send / recv on the pp group), with the calls and bytes the plan's stages
    predict: per micro-batch the mask, rotary cos and sin and the hidden states forward
    (5248 B per rank at 2 × 8, hidden 64), the hidden states' gradient alone back (4096 B:
    the mask and the rotary tables, made from no parameter, get none)."""
    res = get_pool(4).run(_p2p_ledger)
    for r in res:
        (got, groups, loss_sums), want = r["step"], r["want"]
        assert got == want, (got, want)
        assert groups == ["pp"] and loss_sums == 1, (groups, loss_sums)
        assert r["fwd"] == r["eval_want"], (r["fwd"], r["eval_want"])
        assert r["stage"] == (4, 5248, 1, 4096), r["stage"]
    assert res[0]["want"] == {"send": (16, 4 * 5248), "recv": (4, 4 * 4096)}
    assert res[2]["want"] == {"recv": (16, 4 * 5248), "send": (4, 4 * 4096)}


def _checkpointed_vs_dense(rank, world, schedule):
    """_train_vs_dense with activation_checkpointing=True, and how many blocks this rank's
    stages run under checkpointing."""
    import autoshard
    from test_pipeline_parallel import _train_vs_dense

    made, shard = [], autoshard.shard

    def keep(*args, **kwargs):
        made.append(shard(*args, **kwargs))
        return made[-1]
    autoshard.shard = keep
    try:
        res = _train_vs_dense(rank, world, "llama", "1d", 2, schedule, steps=2,
                              shard_kw={"activation_checkpointing": True})
    finally:
        autoshard.shard = shard
    sharded = made[0]
    # the blocks run checkpointed, against the blocks the stages hold
    res["remat"] = (sorted({m.key for i in sharded.stage_indices for m in sharded.runner(i).stage_gm.children()
                            if type(m).__name__ == "_Checkpointed"}),
                    sorted(b for i in sharded.stage_indices for b in sharded.stages[i].blocks))
    return res


def test_activation_checkpointing_inside_the_stages_is_exact():
    """activation_checkpointing=True under pp: every block of each stage runs checkpointed,
    and two AdamW steps of tp2 × pp2 equal the
    dense train_step (losses, local gradients, gathered state, the forward)."""
    from test_pipeline_parallel import _check

    res = get_pool(4).run(_checkpointed_vs_dense, "1f1b")
    _check(res)
    for r in res:
        assert r["remat"][0] == r["remat"][1] and r["remat"][0], r["remat"]
