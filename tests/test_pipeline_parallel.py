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
    # models.build's widened init (0.2), narrowed for deeper stacks: its activations grow
    # with depth and fp32 rounding of the tensor-parallel sums with them (the 8-layer Llama at
    # 0.2 and tp=2 drifts 2e-5 from dense in 3 steps with or without pp; at tp=1 pp is bit-exact)
    std = 0.2 * (2 / max(layers or 2, 2)) ** 0.5
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, std)
    model.train()
    return model


def _train_vs_dense(rank, world, name, mode, pp, schedule, *, layers=None, steps=3, n_mb=4, depth=None, clip=None,
                    save=None, eps=1e-6, untie=False, shard_kw=None):
    """Train the pipelined module and the dense model alike; returns per rank
    (pipelined losses, dense losses, max |state dict difference| on rank 0, stage info)."""
    import autoshard
    from autoshard.training.train import train_step

    torch.set_num_threads(1)
    dense = _build(name, layers)
    model = copy.deepcopy(dense)
    from autoshard.training.train import local_rows_for

    dp = (shard_kw or {}).get("dp", 1)
    mbs = [batch(name, b=2 * dp, s=8, seed=10 + i) for i in range(n_mb)]
    # each dp replica takes its own rows of every micro-batch; the dense model takes them all
    index = (rank % (world // pp)) // (world // pp // dp)
    mine = [local_rows_for(dp, index, mb) for mb in mbs]
    sharded = autoshard.shard(model, mode=mode, pp=pp, schedule=schedule, example_inputs=mine[0], depth=depth,
                              **(shard_kw or {}))
    assert sharded.coords.get("dp", 0) == index
    if untie:       # the check that the tied gradients' sum matters: leave it out
        sharded.sum_tied_grads = lambda: None
    # eps 1e-6: a gradient that is 0 in exact arithmetic (GPT-2's key bias) is rounding noise
    # in both runs, and at eps 1e-8 AdamW turns any noise into a full lr-sized step
    opt_s = torch.optim.AdamW(sharded.parameters(), lr=1e-3, eps=eps)
    opt_d = torch.optim.AdamW(dense.parameters(), lr=1e-3, eps=eps)
    ls, ld, ns, nd = [], [], [], []
    grad_diff = None
    for i in range(steps):
        loss, norm = train_step(sharded, mine, opt_s, clip=clip)
        ls.append(loss)
        ns.append(norm)
        loss, norm = train_step(dense, mbs, opt_d, clip=clip)
        ld.append(loss)
        nd.append(norm)
        if i == 0:
            grad_diff = _local_grad_diff(sharded, dense)
    full = sharded.full_state_dict()
    diff = worst = None
    if rank == 0:
        ref = dense.state_dict()
        missing = sorted(set(ref) - set(full))
        assert not missing, missing
        per = {k: float((full[k].float() - ref[k].float()).abs().max()) for k in ref}
        diff = max(per.values())
        worst = sorted(per.items(), key=lambda kv: -kv[1])[:3]
    if save is not None:
        sharded.save_pretrained(save)
    out = sharded(**mine[0])         # forward through the stages, outputs on every rank
    with torch.no_grad():
        dense_out = dense(**mbs[0])
    rows = local_rows_for(dp, index, {"logits": dense_out.logits})["logits"]
    fwd = float((out.logits - rows).abs().max()), abs(float(out.loss) - float(dense_out.loss))
    return dict(ls=ls, ld=ld, ns=ns, nd=nd, diff=diff, fwd=fwd, grad_diff=grad_diff, stages=sharded.stage_indices, tied=sharded.tied,
                table=sharded.describe_stages(n_mb), worst=worst)


def _local_grad_diff(sharded, dense) -> float:
    """The largest difference between this rank's local gradients (after the step's sums:
    tensor-parallel, dp, tied) and its block of the dense model's."""
    plans = {n: q for q in sharded.plan.params for n in (q.name, *q.aliases)}
    ref = dict(dense.named_parameters(remove_duplicate=False))
    worst = 0.0
    for name, p in sharded.named_parameters(remove_duplicate=False):
        q = plans[name]
        want = q.spec.local(q.pad(ref[name].grad), sharded.mesh, sharded.local_rank)
        worst = max(worst, float((p.grad - want).abs().max()))
    return worst


def _check(results, tol_loss=1e-5, tol_state=1e-4):
    for r in results:
        assert r["grad_diff"] < 1e-5, r["grad_diff"]
        assert max(abs(a - b) for a, b in zip(r["ls"], r["ld"])) < tol_loss, (r["ls"], r["ld"])
        assert r["fwd"][0] < 1e-4 and r["fwd"][1] < 1e-5, r["fwd"]
        assert all((a is None) == (b is None) and (a is None or abs(a - b) < 1e-4 * max(1.0, b))
                   for a, b in zip(r["ns"], r["nd"])), (r["ns"], r["nd"])
    assert results[0]["diff"] < tol_state, (results[0]["diff"], results[0]["worst"])
    # every rank reports the same loss
    assert all(r["ls"] == results[0]["ls"] for r in results)


# -------------------------------------------------------------------- cheap, one process

def test_check_pipeline_names_the_valid_choices():
    from autoshard.pipeline_parallel import check_pipeline

    def msgs(**kw):
        base = dict(pp=2, schedule="1f1b", world=4, mode="1d")
        return " | ".join(p.message for p in check_pipeline(**{**base, **kw}))
    assert msgs() == ""
    assert "'gpipe', '1f1b', 'interleaved', 'zbv'" in msgs(schedule="zb")
    assert "does not divide the 6 ranks" in msgs(world=6, pp=4)
    assert "mode='auto'" in msgs(mode="auto") and msgs(mode="auto", auto=True) == ""
    assert "pp <= 1" in msgs(schedule="interleaved", config=type("C", (), {"num_hidden_layers": 3})())
    assert "whole number" in msgs(pp=0)


# -------------------------------------------------------------------- ranks

@pytest.mark.slow
def test_pp2_is_the_dense_step_bit_for_bit():
    """tp = 1, two stages on two ranks, 1F1B: the losses and weights after two AdamW
    steps are the dense model's exactly (no tensor-parallel sum reorders the floats)."""
    res = get_pool(2).run(_train_vs_dense, "llama", "1d", 2, "1f1b", steps=2, n_mb=2)
    for r in res:
        assert r["ls"] == r["ld"], (r["ls"], r["ld"])
    assert res[0]["diff"] == 0.0, res[0]["worst"]


@pytest.mark.slow
def test_llama_1d_tp2_pp2_1f1b():
    """Acceptance: Llama, 1d tp2 × pp2 on 4 ranks, 3 AdamW steps over 4 micro-batches, clipped."""
    res = get_pool(4).run(_train_vs_dense, "llama", "1d", 2, "1f1b", clip=0.5)
    _check(res)
    assert [r["stages"] for r in res] == [(0,), (0,), (1,), (1,)]


@pytest.mark.slow
def test_gpt2_pp4_tied_embedding_gradient_summed():
    """GPT-2 at pp4 (4 layers): the tied wte/lm_head is read on stages 0 and 3, its
    gradient summed over them; without the sum the run leaves dense at step 2."""
    res = get_pool(4).run(_train_vs_dense, "gpt2", "1d", 4, "1f1b", layers=4)
    _check(res)
    assert res[0]["tied"] == res[3]["tied"] == ("lm_head.weight",) and res[1]["tied"] == ()
    bad = get_pool(4).run(_train_vs_dense, "gpt2", "1d", 4, "1f1b", layers=4, steps=2, untie=True)
    assert abs(bad[0]["ls"][1] - bad[0]["ld"][1]) > 1e-3


@pytest.mark.slow
def test_llama_interleaved_8_layers():
    """Interleaved 1F1B: 4 stages of 2 blocks on pp2 (rank 0 holds stages 0 and 2), tp2."""
    res = get_pool(4).run(_train_vs_dense, "llama", "1d", 2, "interleaved", layers=8)
    _check(res)
    assert [r["stages"] for r in res] == [(0, 2), (0, 2), (1, 3), (1, 3)]


@pytest.mark.extended
@pytest.mark.parametrize("schedule", ["gpipe", "zbv"])
def test_llama_other_schedules(schedule):
    res = get_pool(4).run(_train_vs_dense, "llama", "1d", 2, schedule, layers=4 if schedule == "zbv" else None)
    _check(res)
    if schedule == "zbv":       # the V: rank 0 holds the first and the last stage
        assert res[0]["stages"] == (0, 3) and res[2]["stages"] == (1, 2)


@pytest.mark.slow
def test_qwen2_2d_pp2_8_ranks():
    """Qwen2 in 2d (SUMMA 2×2) × pp2 on 8 ranks."""
    res = get_pool(8, timeout=900).run(_train_vs_dense, "qwen2", "2d", 2, "1f1b")
    _check(res)


def trained_pp2(layers: int):
    """A Llama of ``layers`` sharded at 1d × pp2 and its dense twin, each after two AdamW steps
    of :func:`~autoshard.training.train.train_step` over the same 4 micro-batches (call on
    every rank): ``(dense, sharded, micro_batches, sharded's optimizer, dense's optimizer)``."""
    import autoshard
    from autoshard.training.train import train_step

    torch.set_num_threads(1)
    dense = _build("llama", layers)
    mbs = [batch("llama", b=2, s=8, seed=10 + i) for i in range(4)]
    sharded = autoshard.shard(copy.deepcopy(dense), mode="1d", pp=2, example_inputs=mbs[0])
    opt_s = torch.optim.AdamW(sharded.parameters(), lr=1e-3, eps=1e-6)
    opt_d = torch.optim.AdamW(dense.parameters(), lr=1e-3, eps=1e-6)
    for _ in range(2):
        train_step(sharded, mbs, opt_s)
        train_step(dense, mbs, opt_d)
    return dense, sharded, mbs, opt_s, opt_d


def _checkpoint_across_pp(rank, world, folder):
    """Train at pp2 (tp2), save a Hugging Face folder and the AdamW state; the folder loads
    in dense transformers and at pp4 (tp1), where the forward matches and, with the saved
    optimizer state, two more steps give the dense run's losses."""
    import transformers

    import autoshard
    from autoshard.training.train import train_step

    dense, sharded, mbs, opt_s, opt_d = trained_pp2(4)
    sharded.save_pretrained(folder)
    optim = sharded.full_optimizer_state(opt_s)
    if rank == 0:
        torch.save(optim, f"{folder}/optimizer.pt")
    torch.distributed.barrier()
    loaded = transformers.AutoModelForCausalLM.from_pretrained(folder)
    ref = dense.state_dict()
    got = loaded.state_dict()
    diff_dense = max(float((got[k] - ref[k]).abs().max()) for k in ref)
    again = autoshard.shard(loaded, mode="1d", pp=4, example_inputs=mbs[0])
    out = again(**mbs[0])
    with torch.no_grad():
        want = dense(**mbs[0])
    fwd = abs(float(out.loss) - float(want.loss))
    # a dense state dict loads into a pipelined module of another pp (each rank keeps its stages)
    third = autoshard.shard(_build("llama", 4, seed=3), mode="1d", pp=2, example_inputs=mbs[0])
    third.load_state_dict(dense.state_dict())
    fwd_loaded = abs(float(third(**mbs[0]).loss) - float(want.loss))
    # the resume at pp4 with the AdamW state saved at pp2 continues as the dense run does
    opt_a = torch.optim.AdamW(again.parameters(), lr=1e-3, eps=1e-6)
    again.load_optimizer_state(opt_a, torch.load(f"{folder}/optimizer.pt"))
    steps = [abs(train_step(again, mbs, opt_a)[0] - train_step(dense, mbs, opt_d)[0]) for _ in range(2)]
    return diff_dense, fwd, fwd_loaded, max(steps)


@pytest.mark.slow
def test_checkpoint_saved_at_pp2_loads_dense_and_at_pp4(tmp_path):
    res = get_pool(4).run(_checkpoint_across_pp, str(tmp_path / "ckpt"))
    for diff_dense, fwd, fwd_loaded, step in res:
        assert diff_dense < 1e-4 and fwd < 1e-5 and fwd_loaded < 1e-5 and step < 1e-5, (diff_dense, fwd, fwd_loaded, step)


@pytest.mark.slow
def test_plan_with_pp_shows_the_stages_and_the_bubble():
    """autoshard.plan(..., pp=2) without processes: two stages of two blocks, each block's
    layout the 1d plan's on 2 ranks, the bubble priced; a bad schedule is refused by name."""
    from transformers import LlamaConfig

    import autoshard
    from autoshard.ir.errors import ConfigError

    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=128)
    pl = autoshard.plan(cfg, world_size=4, mode="1d", pp=2, batch_size=4, seq_len=16, micro_batches=4)
    assert [s.blocks for s in pl.stages] == [("model.layers.0", "model.layers.1"), ("model.layers.2", "model.layers.3")]
    assert pl.plan.mesh.world_size == 2 and pl.mesh.axes[0] == "pp"
    assert pl.stages[1].carried_bytes >= 4 * 16 * 64 * 4          # at least the hidden states, fp32
    assert 0 < pl.estimate.bubble < 1 and pl.estimate.p2p_bytes > 0
    assert "bubble 20.0% with equal stages" in str(pl)
    with pytest.raises(ConfigError, match="'gpipe', '1f1b'"):
        autoshard.plan(cfg, world_size=4, mode="1d", pp=2, schedule="zb")


@pytest.mark.extended
@pytest.mark.parametrize("shard_kw", [{"dp": 2}, {"sequence_parallel": True}, {"cp": 2}], ids=["dp2", "1d-sp", "cp2"])
def test_llama_pp2_with_dp_sp_or_cp(shard_kw):
    """pp2 composed with dp2 (each replica its own rows), 1d-sp (tp2) or cp2 (ring attention)
    on 4 ranks; clipped, so the gradient norm (not only AdamW's scale-free step) is compared."""
    res = get_pool(4).run(_train_vs_dense, "llama", "1d", 2, "1f1b", shard_kw=shard_kw, clip=0.5)
    _check(res)


def _refusals(rank, world):
    """Bad pipeline arguments raise the same ConfigError on every rank before any
    collective; generate() is refused by name."""
    import autoshard
    from autoshard.ir.errors import ConfigError

    model = _build("llama")
    b = batch("llama", b=2, s=8)
    out = []
    for kw in ({"pp": 2, "schedule": "zb"}, {"pp": 3}, {"pp": 2, "cp": 2, "cp_attention": "auto"},
               {"pp": 2, "fsdp": True, "dp": 2}):
        try:
            autoshard.shard(model, **{"mode": "1d", **kw}, example_inputs=b)
            out.append(None)
        except ConfigError as e:
            out.append(str(e))
    sharded = autoshard.shard(model, mode="1d", pp=2, example_inputs=b)
    try:
        sharded.generate(b["input_ids"], max_new_tokens=2)
        out.append(None)
    except ConfigError as e:
        out.append(str(e))
    return out


@pytest.mark.slow
def test_bad_pipeline_arguments_are_refused_on_every_rank():
    res = get_pool(2).run(_refusals)
    assert res[0] == res[1]
    zb, three, auto, fsdp, gen = res[0]
    assert "'gpipe', '1f1b', 'interleaved', 'zbv'" in zb
    assert "pp=3 does not divide the 2 ranks" in three
    assert "cp_attention='auto' is not built with pp > 1" in auto
    assert "fsdp=True is not built with pp > 1" in fsdp
    assert gen is not None and "generate() on a module sharded with pp=2" in gen


@pytest.mark.extended
def test_llama_pp2_mode_auto_searches_each_stage_layout():
    """mode='auto' with pp2 on 4 ranks: the layout of each stage's 2 ranks is searched (the
    same on every rank) and the run matches dense."""
    res = get_pool(4).run(_train_vs_dense, "llama", "auto", 2, "1f1b", steps=2)
    _check(res)
