"""Pipeline parallelism's training step (autoshard/training/pipeline.py): the point-to-point
transfers in the ledger against the plan's stages, activation checkpointing inside the
stages, sharded checkpoints written per stage. Cheap: 4 ranks, the tiny 2-layer Llama."""

from __future__ import annotations


import pytest
import torch

from dist_pool import get_pool
from models import batch
from test_pipeline_parallel import _build, trained_pp2


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
    res = get_pool(4, timeout=600).run(_p2p_ledger)
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

    res = get_pool(4, timeout=600).run(_checkpointed_vs_dense, "1f1b")
    _check(res)
    for r in res:
        assert r["remat"][0] == r["remat"][1] and r["remat"][0], r["remat"]


def _checkpoint_per_stage(rank, world, folder, layers, pp_again):
    """Train Llama at tp2 × pp2 for two steps, save_checkpoint (each rank its stages'
    blocks) with the AdamW state; then: the folder exported for transformers holds the
    dense run's weights; a fresh module at ``pp_again`` filled from it (weights and AdamW
    state) takes a third step equal to dense; at pp = 1 (1d on every rank)
    load_checkpoint's forward equals dense."""
    import transformers

    import autoshard
    from autoshard.io.export import export_checkpoint
    from autoshard.checkpoint import save_checkpoint
    from autoshard.io.pipeline_checkpoint import load_pipeline_checkpoint
    from autoshard.training.train import train_step

    dense, sharded, mbs, opt_s, opt_d = trained_pp2(layers)
    save_checkpoint(sharded, folder, optimizer=opt_s)
    files = sorted(p.name for p in __import__("pathlib").Path(folder).glob("rank-*.safetensors"))
    state = None
    if rank == 0:
        export_checkpoint(folder, f"{folder}-hf")
        got = transformers.AutoModelForCausalLM.from_pretrained(f"{folder}-hf").state_dict()
        ref = dense.state_dict()
        state = max(float((got[k] - ref[k]).abs().max()) for k in ref)
    torch.distributed.barrier()
    again = autoshard.shard(_build("llama", layers, seed=3), mode="1d", pp=pp_again, example_inputs=mbs[0])
    opt_a = torch.optim.AdamW(again.parameters(), lr=1e-3, eps=1e-6)
    load_pipeline_checkpoint(again, folder, optimizer=opt_a)
    with torch.no_grad():
        want = float(dense(**mbs[0]).loss)
    fwd_pp = abs(float(again(**mbs[0]).loss) - want)
    step = abs(train_step(again, mbs, opt_a)[0] - train_step(dense, mbs, opt_d)[0])
    one = autoshard.load_checkpoint(folder, _build("llama", layers, seed=4), mode="1d", example_inputs=mbs[0])
    with torch.no_grad():
        fwd_one = abs(float(one(**mbs[0]).loss) - want)
    return dict(files=files, state=state, fwd_pp=fwd_pp, step=step, fwd_one=fwd_one)


def _check_checkpoint(res):
    assert res[0]["files"] == [f"rank-{r:05d}-of-00004.safetensors" for r in range(4)], res[0]["files"]
    assert res[0]["state"] < 1e-4, res[0]["state"]
    for r in res:
        assert r["fwd_pp"] < 1e-5 and r["step"] < 1e-5 and r["fwd_one"] < 2e-5, r


def test_save_checkpoint_per_stage_loads_dense_and_sharded(tmp_path):
    """save_checkpoint under pp: one file per rank; loads in dense transformers (export),
    into a fresh pp2 module with the AdamW state (the next step is dense's) and at pp 1."""
    _check_checkpoint(get_pool(4, timeout=600).run(_checkpoint_per_stage, str(tmp_path / "ckpt"), None, 2))


@pytest.mark.slow
def test_save_checkpoint_at_pp2_resumes_at_pp4(tmp_path):
    """The same with 4 layers: saved at tp2 × pp2, resumed at pp4 (tp 1)."""
    _check_checkpoint(get_pool(4, timeout=600).run(_checkpoint_per_stage, str(tmp_path / "ckpt"), 4, 4))
