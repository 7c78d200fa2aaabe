"""FSDP2 over the dp axis (issue 39): ``shard(..., dp=2, fsdp=True)`` trains as the dense
model does (20 AdamW steps, warmup + cosine, 2 accumulated micro-batches, global-norm
clipping active every step) with each rank holding 1/dp of its TP block of every
parameter at rest (dense / (tp · dp) bytes, ± 5 %), and one transformer block's
parameters gathered at a time (each block is an FSDP unit: ``split_blocks``).

GPT-2 at 1d tp2 × dp2 (its position table's gradient is summed over dp by the graph
itself: FSDP must not count it twice) and Llama at 2d q2 × dp2.
"""

from __future__ import annotations

import pytest
import torch

import models
from dist_pool import get_pool
from test_train import ACCUM, CLIP, STEPS, _dense_reference, _global_batches, train_like_dense


def _fsdp_run(rank, world, name, mode, dp, steps, depth=None, checkpoint=False):
    import autoshard
    from autoshard.training import train as T

    torch.set_num_threads(1)
    batches = _global_batches(steps * ACCUM)
    model = models.build(name)
    dense_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    example = T.local_rows_for(dp, rank // (world // dp), batches[0])
    sharded = autoshard.shard(model, mode=mode, dp=dp, depth=depth, example_inputs=example, fsdp=True,
                              activation_checkpointing=checkpoint, captured=models.shared_capture(name, model, example))
    at_rest = sum(p.to_local().numel() * p.element_size() for p in sharded.parameters())
    tp_bytes = sum(pp.local_bytes(sharded.mesh) for pp in sharded.plan.params if not pp.is_buffer)
    kinds = {type(p).__name__ for p in sharded.parameters()}
    # one block gathered at a time: at each block's forward, the whole (gathered) parameters are the
    # root's (embedding, head, final norm) and that block's only
    from torch.distributed.tensor import DTensor

    gathered = []

    def whole_now(mod, args):
        gathered.append(sum(p.numel() * p.element_size() for p in sharded.parameters()
                            if not isinstance(p, DTensor)))
    blocks = [sharded.get_submodule(k) for k in sharded.block_paths]
    hooks = [b.register_forward_pre_hook(whole_now) for b in blocks]
    block_bytes = [sum(p.to_local().numel() * p.element_size() for p in b.parameters()) * dp for b in blocks]
    saved = {}
    if checkpoint:          # activations saved by one forward, checkpointed blocks vs a plain FSDP module
        plain = autoshard.shard(models.build(name), mode=mode, dp=dp, depth=depth, example_inputs=example,
                                fsdp=True, captured=models.shared_capture(name, model, example))
        for label, m in (("checkpointed", sharded), ("plain", plain)):
            total = [0]

            def pack(t, total=total):
                total[0] += t.numel() * t.element_size()
                return t
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                m(**T.local_rows(m, batches[0])).loss.backward()
            m.zero_grad(set_to_none=True)
            saved[label] = total[0]
    losses, norms = train_like_dense(sharded, batches, steps)
    for h in hooks:
        h.remove()
    tp = sharded.mesh.world_size // dp
    return {"saved": saved, "blocks": list(sharded.block_paths), "gathered": gathered[:len(blocks)], "block_bytes": block_bytes,
            "losses": losses, "norms": norms, "at_rest": at_rest, "dense_bytes": dense_bytes, "tp": tp,
            "tp_bytes": tp_bytes, "kinds": kinds}


@pytest.mark.parametrize("case", [("gpt2", "1d", 4, False), pytest.param(("llama", "2d", 8, False), marks=pytest.mark.slow),
                                  ("llama", "1d", 4, True)],
                         ids=lambda c: f"{c[0]}-{c[1]}-dp2" + ("-checkpointed" if c[3] else ""))
def test_fsdp_over_dp_follows_dense(case):
    """... and with activation_checkpointing=True each block (an FSDP unit) also recomputes its
    activations in backward."""
    name, mode, world, checkpoint = case
    res = get_pool(world, timeout=900).run(_fsdp_run, name, mode, 2, STEPS, checkpoint=checkpoint)
    ref_losses, ref_norms = _dense_reference(name)
    assert min(ref_norms) > CLIP, "clipping must be active in every step"
    for rank, r in enumerate(res):
        assert r["kinds"] == {"DTensor"}, r["kinds"]
        if checkpoint:
            assert r["saved"]["checkpointed"] < 0.6 * r["saved"]["plain"], r["saved"]
        assert len(r["blocks"]) == 2 and r["blocks"][0].endswith(".0"), r["blocks"]
        root = r["tp_bytes"] - sum(r["block_bytes"])
        for got, block in zip(r["gathered"], r["block_bytes"]):
            assert abs(got - (root + block)) <= 0.01 * r["tp_bytes"], (got, root, block)
        for i, (a, b) in enumerate(zip(r["losses"], ref_losses)):
            assert abs(a - b) <= 1e-4, f"rank {rank} step {i + 1}: {a} vs dense {b}"
        for i, (a, b) in enumerate(zip(r["norms"], ref_norms)):
            assert abs(a - b) <= 1e-5 * b, f"rank {rank} step {i + 1}: norm {a} vs dense {b}"
        # at rest: this rank's 1/dp of its TP block (FSDP's part: exact up to its chunk rounding) ...
        assert abs(r["at_rest"] - r["tp_bytes"] / 2) <= 0.01 * r["tp_bytes"], (r["at_rest"], r["tp_bytes"])
        # ... and so dense / (tp·dp) as far as the TP plan is dense / tp: 1d splits every matrix and the
        # vocabulary; 2d keeps this tiny Llama's embedding on one axis (q of the q² ranks hold each block)
        ratio = r["at_rest"] / (r["dense_bytes"] / (r["tp"] * 2))
        tp_ratio = r["tp_bytes"] / (r["dense_bytes"] / r["tp"])
        assert abs(ratio - tp_ratio) <= 0.01 * tp_ratio, (ratio, tp_ratio)
        if mode == "1d":
            assert 0.95 <= ratio <= 1.05, ratio


def _refused(rank, world):
    import autoshard
    from autoshard import ConfigError

    try:
        autoshard.shard(models.build("llama"), mode="1d", fsdp=True, example_inputs=models.batch("llama"))
    except ConfigError as e:
        return str(e)
    return None


def test_fsdp_without_dp_is_refused_before_any_collective():
    for msg in get_pool(2, timeout=300).run(_refused):
        assert msg is not None and "dp >= 2" in msg, msg


def _fsdp_dcp(rank, world, path):
    """FSDP2 module: full_state_dict is the dense one; a DCP save (model + AdamW) loads into
    another FSDP2 module (same next steps) and into a 2d module without FSDP (same logits)."""
    import autoshard
    from autoshard.io import dcp as adcp
    from autoshard.training import train as T

    torch.set_num_threads(1)
    batches = _global_batches(4)
    dense = models.build("gpt2")
    example = T.local_rows_for(2, rank // 2, batches[0])
    full_in = batches[0]
    sharded = autoshard.shard(models.build("gpt2"), mode="1d", dp=2, example_inputs=example, fsdp=True)
    from autoshard import ConfigError

    try:
        sharded.save_checkpoint(path + "-ours")
        refused = None
    except ConfigError as e:
        refused = str(e)
    full = sharded.full_state_dict(rank0_only=False)
    dense_ok = all(torch.equal(full[k], v) for k, v in dense.state_dict().items() if k in full)
    opt = torch.optim.AdamW(sharded.parameters(), lr=1e-2, eps=1e-3)
    T.train_step(sharded, [T.local_rows(sharded, batches[0])], opt)
    adcp.save(sharded, path, optimizer=opt)
    with torch.no_grad():
        logits = sharded(**T.local_rows(sharded, full_in)).logits
    after = [T.train_step(sharded, [T.local_rows(sharded, b)], opt)[0] for b in batches[1:3]]
    other = autoshard.shard(models.build("gpt2", seed=1), mode="1d", dp=2, example_inputs=example, fsdp=True)
    opt2 = torch.optim.AdamW(other.parameters(), lr=1e-2, eps=1e-3)
    adcp.load(other, path, optimizer=opt2)
    with torch.no_grad():
        logits2 = other(**T.local_rows(other, full_in)).logits
    after2 = [T.train_step(other, [T.local_rows(other, b)], opt2)[0] for b in batches[1:3]]
    plain = autoshard.shard(models.build("gpt2", seed=1), mode="2d", example_inputs=full_in)
    adcp.load(plain, path)
    with torch.no_grad():
        logits3 = plain(**full_in).logits
    rows = logits.shape[0]
    mine = logits3[(rank // 2) * rows:(rank // 2 + 1) * rows]
    return {"refused": refused, "dense_ok": dense_ok, "same_fsdp": (logits2 - logits).abs().max().item(), "after": after,
            "after2": after2, "plain_2d": (mine - logits).abs().max().item()}


def test_fsdp_module_checkpoints_through_dcp(tmp_path):
    for rank, r in enumerate(get_pool(4, timeout=900).run(_fsdp_dcp, str(tmp_path / "ckpt"))):
        assert r["dense_ok"], rank
        assert r["refused"] and "io.dcp.save" in r["refused"], r["refused"]     # our format: refused, pointing at DCP
        assert r["same_fsdp"] <= 1e-6 and r["plain_2d"] <= 1e-5, r
        assert r["after2"] == pytest.approx(r["after"], abs=1e-6), r


@pytest.mark.slow
def test_finetune_example_with_fsdp_saves_a_dcp_checkpoint(tmp_path):
    """examples/finetune.py --fsdp under torchrun (1d tp2 × dp2): the same losses as without
    FSDP, half the per-rank bytes reported, and a DCP folder that `autoshard convert` turns
    into a Hugging Face folder."""
    import subprocess
    import sys

    from test_multinode import JOB, ROOT, TORCHRUN, _env, _losses, _port

    def run(*extra):
        out = subprocess.run([*TORCHRUN, "--nproc-per-node", "4", "--master-port", str(_port()), *JOB, *extra],
                             env=_env(), capture_output=True, text=True, timeout=400)
        assert out.returncode == 0, out.stderr[-3000:]
        return out.stdout
    plain, fsdp = run(), run("--fsdp", "--checkpoint-dir", str(tmp_path / "ck"))
    assert len(_losses(fsdp)) == 3
    assert [float(x) for x in _losses(fsdp)] == pytest.approx([float(x) for x in _losses(plain)], abs=1e-3)
    assert "(FSDP2 over dp=2)" in fsdp and "DCP" in fsdp, fsdp
    conv = subprocess.run([sys.executable, "-m", "autoshard.cli", "convert", str(tmp_path / "ck" / "step_000003"),
                           str(tmp_path / "hf")], env=_env(), capture_output=True, text=True, cwd=ROOT)
    assert conv.returncode == 0 and (tmp_path / "hf" / "model.safetensors").exists(), conv.stderr
