"""autoshard.training.train on gloo CPU ranks: 1D tp2 × dp2, 2.5D (q2 d2) and 3D (q2) training with gradient
accumulation and active global-norm clipping follows the dense single-process
run step by step (loss within 1e-4, grad norm within 1e-5 relative); a run
checkpointed at step 10 and resumed on a fresh module continues the same curve."""

from __future__ import annotations

import copy

import pytest
import torch

import models
from dist_pool import get_pool

STEPS, ACCUM, CLIP, LR = 20, 2, 0.5, 3e-3


def _global_batches(n: int, b: int = 8, s: int = 8, seed: int = 5) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        ids = torch.randint(0, 128, (b, s), generator=g)
        mask = torch.ones(b, s, dtype=torch.long)
        mask[1, :3] = 0
        labels = ids.clone()
        labels[0, :2] = -100
        out.append({"input_ids": ids, "attention_mask": mask, "labels": labels})
    return out


def _dense_run(name: str, batches: list[dict], steps: int):
    from autoshard.training import train as T

    torch.manual_seed(0)
    dense = models.build(name)
    opt, sched = T.make_optimizer(dense, lr=LR, steps=steps, warmup=3)
    losses, norms = [], []
    for i in range(steps):
        loss, norm = T.train_step(dense, batches[i * ACCUM:(i + 1) * ACCUM], opt, sched, clip=CLIP)
        losses.append(loss)
        norms.append(norm)
    return losses, norms


def _sharded_run(rank, world, name, dp, steps, mode="1d", depth=None):
    import autoshard
    from autoshard.training import train as T

    torch.set_num_threads(1)
    batches = _global_batches(steps * ACCUM)
    model = models.build(name)
    example = T.local_rows_for(dp, rank // (world // dp), batches[0])
    sharded = autoshard.shard(model, mode=mode, depth=depth, dp=dp, example_inputs=example,
                              captured=models.shared_capture(name, model, example))
    losses, norms = train_like_dense(sharded, batches, steps)
    return {"losses": losses, "norms": norms}


def train_like_dense(sharded, batches: list[dict], steps: int) -> tuple[list, list]:
    """``steps`` steps of the dense reference's recipe (AdamW, warmup + cosine, ACCUM
    micro-batches, clipping at CLIP) on ``sharded``, each replica on its rows: the
    losses and gradient norms."""
    from autoshard.training import train as T

    opt, sched = T.make_optimizer(sharded, lr=LR, steps=steps, warmup=3)
    local = [T.local_rows(sharded, b) for b in batches]
    losses, norms = [], []
    for i in range(steps):
        loss, norm = T.train_step(sharded, local[i * ACCUM:(i + 1) * ACCUM], opt, sched, clip=CLIP)
        losses.append(loss)
        norms.append(norm)
    return losses, norms


_DENSE: dict = {}


def _dense_reference(name: str):
    if name not in _DENSE:
        torch.set_num_threads(1)
        _DENSE[name] = _dense_run(name, _global_batches(STEPS * ACCUM), STEPS)
    return _DENSE[name]


@pytest.mark.parametrize("world,mode,depth,dp", [(4, "1d", None, 2), pytest.param(8, "2.5d", 2, 1, marks=pytest.mark.slow),
                                                 pytest.param(8, "3d", None, 1, marks=pytest.mark.slow)],
                         ids=["1d-tp2-dp2", "2.5d-q2-d2", "3d-q2"])
def test_train_accum_clip_equals_dense(world, mode, depth, dp):
    """20 AdamW steps (warmup + cosine), 2 accumulated micro-batches each, global-norm
    clipping active every step: the sharded run's losses and norms are the dense run's."""
    results = get_pool(world, timeout=900).run(_sharded_run, "llama", dp, STEPS, mode, depth)
    ref_losses, ref_norms = _dense_reference("llama")
    assert min(ref_norms) > CLIP, "clipping must be active in every step"
    for rank, r in enumerate(results):
        assert len(r["losses"]) == STEPS
        for i, (a, b) in enumerate(zip(r["losses"], ref_losses)):
            assert abs(a - b) <= 1e-4, f"rank {rank} step {i + 1}: {a} vs dense {b}"
        for i, (a, b) in enumerate(zip(r["norms"], ref_norms)):
            assert abs(a - b) <= 1e-5 * b, f"rank {rank} step {i + 1}: norm {a} vs dense {b}"
    # the loss is the global mean: identical on every rank
    assert all(r["losses"] == results[0]["losses"] for r in results)


def _resume_run(rank, world, name, dp, path):
    import autoshard
    from autoshard.training import train as T

    torch.set_num_threads(1)
    steps, half = 20, 10
    batches = _global_batches(steps * ACCUM)
    base = models.build(name)
    ex = T.local_rows_for(dp, rank // (world // dp), batches[0])

    def run(sharded, opt, sched, lo, hi):
        local = [T.local_rows(sharded, b) for b in batches]
        return [T.train_step(sharded, local[i * ACCUM:(i + 1) * ACCUM], opt, sched, clip=CLIP)[0]
                for i in range(lo, hi)]

    first = autoshard.shard(copy.deepcopy(base), mode="1d", dp=dp, example_inputs=ex)
    opt, sched = T.make_optimizer(first, lr=LR, steps=steps, warmup=3)
    run(first, opt, sched, 0, half)
    T.save_state(first, path, opt, step=half)
    uninterrupted = [None] * half + run(first, opt, sched, half, steps)      # saving does not disturb the run

    resumed, opt, sched, step = T.load_state(path, copy.deepcopy(base), mode="1d", dp=dp, example_inputs=ex,
                                             lr=LR, steps=steps, warmup=3)
    assert step == half
    after = run(resumed, opt, sched, half, steps)
    return {"full": uninterrupted[half:], "resumed": after}


def test_resume_continues_the_same_curve(tmp_path):
    results = get_pool(4, timeout=600).run(_resume_run, "llama", 2, str(tmp_path / "ckpt"))
    for rank, r in enumerate(results):
        assert len(r["resumed"]) == len(r["full"]) == 10
        for i, (a, b) in enumerate(zip(r["resumed"], r["full"])):
            assert abs(a - b) <= 1e-6, f"rank {rank} step {i + 11}: resumed {a} vs uninterrupted {b}"


def _torch_clip(rank: int, world: int, mode: str) -> dict:
    import autoshard
    import autoshard.training.train as T
    from autoshard.ir.errors import ConfigError

    torch.set_num_threads(1)
    dense = models.build("llama")
    batch = models.batch("llama")
    sharded = autoshard.shard(copy.deepcopy(dense), mode=mode, example_inputs=batch)
    dense(**batch).loss.backward()
    ref = torch.nn.utils.clip_grad_norm_(dense.parameters(), 0.1)
    sharded(**batch).loss.backward()
    params = [p for p in sharded.parameters() if p.grad is not None]
    saved = [p.grad.clone() for p in params]
    theirs = torch.nn.utils.clip_grad_norm_(sharded.parameters(), 0.1)
    clipped = [p.grad.clone() for p in params]
    for p, g in zip(params, saved):
        p.grad.copy_(g)
    ours = T.clip_grad_norm_(sharded, 0.1)
    out = {"ref": ref.item(), "theirs": theirs.item(), "ours": ours.item(),
           "grads": max((a - p.grad).abs().max().item() for a, p in zip(clipped, params)),
           "local": sum(g.double().pow(2).sum() for g in saved).sqrt().item()}
    errors = []
    extra = torch.nn.Parameter(torch.ones(2))
    extra.grad = torch.ones(2)
    for kw, ps in (({}, list(sharded.parameters()) + [extra]), ({"norm_type": "inf"}, list(sharded.parameters()))):
        try:
            torch.nn.utils.clip_grad_norm_(ps, 0.1, **kw)
        except ConfigError as e:
            errors.append(str(e))
    plain = torch.nn.Parameter(torch.ones(3))
    plain.grad = torch.full((3,), 2.0)
    out["plain"] = torch.nn.utils.clip_grad_norm_([plain], 100.0).item()      # not ours: torch's own
    out["errors"] = errors
    return out


def test_torch_clip_grad_norm_on_sharded_parameters_is_the_global_norm():
    """torch's ``clip_grad_norm_`` over a sharded module's parameters returns the global
    norm (the dense model's, not this rank's local one) and clips every gradient as
    ``autoshard.training.train.clip_grad_norm_`` does; mixing in other tensors or asking
    another norm is refused naming ours; other tensors keep torch's own behaviour."""
    for rank, r in enumerate(get_pool(2).run(_torch_clip, "1d")):
        assert abs(r["theirs"] - r["ours"]) <= 1e-6 * r["ours"] and abs(r["ours"] - r["ref"]) <= 1e-5 * r["ref"], r
        assert abs(r["local"] - r["ref"]) > 1e-3 * r["ref"], r        # the local norm alone would be wrong
        assert r["grads"] <= 1e-7, r
        assert r["plain"] == pytest.approx(12 ** 0.5)
        assert len(r["errors"]) == 2, r["errors"]
        assert "and 1 other tensors" in r["errors"][0] and "clip_grad_norm_(sharded" in r["errors"][0], r["errors"]
        assert "only the L2 norm is global" in r["errors"][1] and "clip_grad_norm_(sharded" in r["errors"][1]


def _torch_clip_fsdp(rank: int, world: int) -> dict:
    import autoshard
    import autoshard.training.train as T

    torch.set_num_threads(1)
    dense = models.build("llama")
    batch = models.batch("llama", b=8)
    local = T.local_rows_for(2, rank // 2, batch)
    sharded = autoshard.shard(copy.deepcopy(dense), mode="1d", dp=2, fsdp=True, example_inputs=local)
    dense(**batch).loss.backward()
    ref = torch.nn.utils.clip_grad_norm_(dense.parameters(), 0.1).item()
    sharded(**local).loss.backward()
    params = [p for p in sharded.parameters() if p.grad is not None]
    saved = [T.local_grad(p).clone() for p in params]
    theirs = torch.nn.utils.clip_grad_norm_(sharded.parameters(), 0.1).item()
    clipped = [T.local_grad(p).clone() for p in params]
    for p, g in zip(params, saved):
        T.local_grad(p).copy_(g)
    ours = T.clip_grad_norm_(sharded, 0.1).item()
    return {"ref": ref, "theirs": theirs, "ours": ours,
            "grads": max((a - T.local_grad(p)).abs().max().item() for a, p in zip(clipped, params)),
            "dtensor": type(params[0].grad).__name__}


@pytest.mark.extended
def test_torch_clip_grad_norm_with_fsdp2_over_dp():
    """The same with FSDP2 over dp (tp2 × dp2): the gradients are DTensors over dp, torch's
    ``clip_grad_norm_`` still gives the dense norm and clips their local chunks as ours does."""
    for rank, r in enumerate(get_pool(4).run(_torch_clip_fsdp)):
        assert r["dtensor"] == "DTensor", r
        assert abs(r["theirs"] - r["ours"]) <= 1e-6 * r["ours"] and abs(r["ours"] - r["ref"]) <= 1e-5 * r["ref"], r
        assert r["grads"] <= 1e-7, r


def test_train_step_reads_the_norm_after_the_optimizer_step(monkeypatch):
    """The clipped norm is a device tensor until the step is launched: a host read
    (``.item()``, ``float()``) before ``optimizer.step()`` would stall a GPU step."""
    import types

    from autoshard.training.train import train_step

    log = []

    class Tiny(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.ones(3))

        def forward(self, x):
            return types.SimpleNamespace(loss=(self.w * x).sum())

    class Logged(torch.optim.SGD):
        def step(self, closure=None):
            log.append("step")
            return super().step(closure)

    m = Tiny()
    opt = Logged(m.parameters(), lr=0.1)
    real_item, real_float = torch.Tensor.item, torch.Tensor.__float__
    monkeypatch.setattr(torch.Tensor, "item", lambda t: (log.append("read"), real_item(t))[1])
    monkeypatch.setattr(torch.Tensor, "__float__", lambda t: (log.append("read"), real_float(t))[1])
    loss, norm = train_step(m, [{"x": torch.full((3,), 2.0)}], opt, clip=1.0)
    assert loss == 6.0 and abs(norm - 12 ** 0.5) < 1e-6
    assert log.index("step") < log.index("read"), log
