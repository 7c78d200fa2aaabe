"""Optimizer state sharded over the data-parallel replicas (ZeRO-1 / ZeRO-2, issue 20).

The training curve of ``autoshard.training.zero.ZeroAdamW`` (20 AdamW steps, warmup +
cosine, 2 accumulated micro-batches, global-norm clipping active every step) must
be the dense model's; each rank must hold 1/dp of the AdamW state a plain
optimizer over its TP shards holds; a checkpoint saved with ZeRO at one dp must
resume at another and give the loss the uninterrupted run gives.
"""

from __future__ import annotations

import copy

import pytest
import torch

import models
from dist_pool import get_pool
from test_train import ACCUM, CLIP, LR, STEPS, _dense_reference, _global_batches


def _zero_run(rank, world, name, dp, stage, mode, steps, cp: int = 1):
    import autoshard
    from autoshard.training import train as T
    from autoshard.runtime.collectives import CommLedger
    from autoshard.training.zero import optimizer_state_bytes

    torch.set_num_threads(1)
    batches = _global_batches(steps * ACCUM)
    model = models.build(name)
    example = T.local_rows_for(dp, rank // (world // dp), batches[0])
    sharded = autoshard.shard(model, mode=mode, dp=dp, example_inputs=example, cp=cp,
                              captured=models.shared_capture(name, model, example))
    opt, sched = T.make_optimizer(sharded, lr=LR, steps=steps, warmup=3, zero=stage)
    local = [T.local_rows(sharded, b) for b in batches]
    losses, norms, calls = [], [], {}
    for i in range(steps):
        with CommLedger() as led:
            loss, norm = T.train_step(sharded, local[i * ACCUM:(i + 1) * ACCUM], opt, sched, clip=CLIP)
        losses.append(loss)
        norms.append(norm)
        if i == 0:
            calls = {f"{k}({g})": n for (k, g), (n, _) in led.by_kind().items()}
    plain = torch.optim.AdamW(sharded.parameters())         # what a plain optimizer would hold here
    for p in sharded.parameters():
        plain.state[p] = {"step": torch.zeros(()), "exp_avg": torch.zeros_like(p), "exp_avg_sq": torch.zeros_like(p)}
    return {"losses": losses, "norms": norms, "opt_bytes": optimizer_state_bytes(opt),
            "plain_bytes": optimizer_state_bytes(plain), "calls": calls, "n_synced": sum("dp" in pp.grad_sync for pp, _, _ in opt.entries),
            "node_dp": sum(1 for n in sharded.plan.nodes for c in n.comms if "dp" in c.axes)}


@pytest.mark.parametrize("case", [pytest.param(("llama", "1d", 4, 1), marks=pytest.mark.slow), ("gpt2", "1d", 4, 2),
                                  pytest.param(("llama", "2d", 8, 2), marks=pytest.mark.slow)],
                         ids=lambda c: f"{c[0]}-{c[1]}-dp2-zero{c[3]}")
def test_zero_equals_dense(case):
    """1d tp2 x dp2 (Llama ZeRO-1; GPT-2 ZeRO-2, whose position table gets its
    gradient summed over dp before the lookup), 2d q2 x dp2 (ZeRO-2): losses within 1e-4 and
    norms within 1e-5 (relative) of the dense run; the AdamW state per rank is
    1/dp of a plain optimizer's over the same shards (within 2%); ZeRO-2 reduce-
    scatters over dp instead of all-reducing, in buckets."""
    name, mode, world, stage = case
    res = get_pool(world, timeout=900).run(_zero_run, name, 2, stage, mode, STEPS)
    ref_losses, ref_norms = _dense_reference(name)
    assert min(ref_norms) > CLIP, "clipping must be active in every step"
    for rank, r in enumerate(res):
        for i, (a, b) in enumerate(zip(r["losses"], ref_losses)):
            assert abs(a - b) <= 1e-4, f"rank {rank} step {i + 1}: {a} vs dense {b}"
        for i, (a, b) in enumerate(zip(r["norms"], ref_norms)):
            assert abs(a - b) <= 1e-5 * b, f"rank {rank} step {i + 1}: norm {a} vs dense {b}"
        ratio = r["opt_bytes"] / (r["plain_bytes"] / 2)
        assert 0.98 <= ratio <= 1.02, (r["opt_bytes"], r["plain_bytes"])
        rs = {k: n for k, n in r["calls"].items() if k.startswith("reduce_scatter(dp")}
        ag = {k: n for k, n in r["calls"].items() if k.startswith("all_gather(dp")}
        assert sum(ag.values()) == 1, r["calls"]           # the parameters: one flat all-gather per step
        if stage == 2:      # the gradients: reduce-scattered; what all-reduces over dp is the loss's mean
            # in buckets: one reduce-scatter per backward (the tiny model's gradients fit one bucket)
            assert r["n_synced"] > 1 and sum(rs.values()) == ACCUM, r["calls"]
            ar = sum(n for k, n in r["calls"].items() if k.startswith("all_reduce(dp"))
            assert ar == r["node_dp"] * ACCUM, (r["calls"], r["node_dp"])
        else:
            assert not rs, r["calls"]
    print(f"\n{name} {mode} dp2 zero{stage}: optimizer bytes per rank {res[0]['opt_bytes']:,} "
          f"(plain {res[0]['plain_bytes']:,}); step-1 collectives {res[0]['calls']}")


def _zero_resume(rank, world, name, dp_save, dp_load, path, phase):
    import autoshard
    from autoshard.training import train as T

    torch.set_num_threads(1)
    steps, half = 12, 6
    batches = _global_batches(steps * ACCUM)
    base = models.build(name)
    if phase == "save":
        dp = dp_save
        ex = T.local_rows_for(dp, rank // (world // dp), batches[0])
        sharded = autoshard.shard(copy.deepcopy(base), mode="1d", dp=dp, example_inputs=ex)
        opt, sched = T.make_optimizer(sharded, lr=LR, steps=steps, warmup=3, zero=2)
        local = [T.local_rows(sharded, b) for b in batches]
        run = [T.train_step(sharded, local[i * ACCUM:(i + 1) * ACCUM], opt, sched, clip=CLIP)[0]
               for i in range(half)]
        T.save_state(sharded, path, opt, step=half)
        nxt = T.train_step(sharded, local[half * ACCUM:(half + 1) * ACCUM], opt, sched, clip=CLIP)[0]
        return {"run": run, "next": nxt}
    dp = dp_load
    ex = T.local_rows_for(dp, rank // (world // dp), batches[0])
    sharded, opt, sched, step = T.load_state(path, copy.deepcopy(base), mode="1d", dp=dp, example_inputs=ex,
                                             lr=LR, steps=steps, warmup=3, zero=1 if dp > 1 else 0)
    local = [T.local_rows(sharded, b) for b in batches]
    return {"step": step, "next": T.train_step(sharded, local[step * ACCUM:(step + 1) * ACCUM], opt, sched,
                                                clip=CLIP)[0]}


def test_zero_checkpoint_resumes_on_another_dp(tmp_path):
    """Saved by 1d tp2 x dp2 with ZeRO-2 (the AdamW state gathered into the usual
    checkpoint), resumed by 1d tp2 x dp1 (plain AdamW): the next loss is the
    uninterrupted run's within 1e-6."""
    path = str(tmp_path / "ckpt")
    saved = get_pool(4, timeout=600).run(_zero_resume, "llama", 2, 1, path, "save")
    resumed = get_pool(2, timeout=600).run(_zero_resume, "llama", 2, 1, path, "load")
    for r in resumed:
        assert r["step"] == 6
        assert abs(r["next"] - saved[0]["next"]) <= 1e-6, (r["next"], saved[0]["next"])


def test_estimate_counts_zero():
    """The cost model splits the optimizer state (ZeRO-1) and the gradients (ZeRO-2) over dp."""
    import autoshard
    from autoshard.planning.cost import estimate

    p = autoshard.plan(models.build("llama"), world_size=4, mode="1d", dp=2, batch_size=8, seq_len=8,
                       example_inputs=models.batch("llama"))
    e0, e1, e2 = (estimate(p, "cpu-gloo", zero=z) for z in (0, 1, 2))
    assert e1.optimizer_bytes == -(-e0.optimizer_bytes // 2) and e1.grad_bytes == e0.grad_bytes
    assert e2.grad_bytes == -(-e0.grad_bytes // 2) and e2.memory_bytes < e1.memory_bytes < e0.memory_bytes
    with pytest.raises(autoshard.ConfigError, match="valid choices"):
        estimate(p, "cpu-gloo", zero=3)


def test_search_prices_zero_and_sequence_parallel():
    """The auto search lists 1d-sp candidates and, with zero=2, prices the optimizer
    state and gradients split over each candidate's dp."""
    import autoshard

    kw = dict(world_size=4, cluster="cpu-gloo", batch_size=8, seq_len=8, example_inputs=models.batch("llama"))
    plain = autoshard.search(models.build("llama"), **kw)
    zero = autoshard.search(models.build("llama"), zero=2, **kw)
    labels = {e.candidate.label for e in plain.ranked}
    assert "1d-sp [4]" in labels and "1d [2] × dp2" in labels, labels
    by = lambda res: {e.candidate.label: e.cost for e in res.ranked}      # noqa: E731
    a, b = by(plain)["1d [2] × dp2"], by(zero)["1d [2] × dp2"]
    assert b.optimizer_bytes == -(-a.optimizer_bytes // 2) and b.grad_bytes < a.grad_bytes
    assert by(zero)["1d [4]"].optimizer_bytes == by(plain)["1d [4]"].optimizer_bytes        # no dp: nothing to split
