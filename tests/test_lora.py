"""LoRA through peft on a sharded model (docs/design.md, "Frozen parameters and LoRA";
autoshard/adapters.py).

``shard(peft_model)`` of a tiny Llama (LoRA on every Linear), a GPT-2 (LoRA on its
Conv1D ``c_attn`` / ``c_proj`` / ``c_fc``, ``fan_in_fan_out``) and a BERT classifier
(``modules_to_save`` head), on gloo CPU ranks: loss, logits and every trainable local
gradient equal dense peft's within atol = rtol = 1e-5, frozen slices end backward
with ``.grad is None`` and plan no gradient collective, the ledger equals the plan,
3 AdamW steps over the trainable slices track dense peft's, and AdamW's state is
twice the trainable local bytes. The 8-rank cells (2.5d, 3d) run in ``make
test-extended``, with the BERT classifier's tp × dp cell, generate() and the LoRA
variants (rsLoRA, DoRA, lora_dropout, two adapters).
"""

from __future__ import annotations

import copy

import pytest
import torch

import models
from dist_pool import get_pool

pytest.importorskip("peft")

STEPS = 3
TARGETS = {"llama": "all-linear", "gpt2": ["c_attn", "c_proj", "c_fc"], "bert-cls": ["query", "value", "dense"]}


def build(name: str, **lora):
    """The dense peft model of ``name`` (LoRA r=4, its B matrices made non-zero so the
    adapters change the output from the first step)."""
    import peft
    import transformers

    if name == "bert-cls":
        _, _, kw = models.TINY["bert"]
        torch.manual_seed(0)
        base = transformers.BertForSequenceClassification(transformers.BertConfig(**kw, num_labels=3))
        task = dict(task_type="SEQ_CLS")
    else:
        base = models.build(name)
        task = dict(task_type="CAUSAL_LM")
    cfg = dict(r=4, lora_alpha=8, target_modules=TARGETS[name], **task)
    if name == "gpt2":
        cfg["fan_in_fan_out"] = True
    cfg.update(lora)
    model = peft.get_peft_model(base, peft.LoraConfig(**cfg))
    with torch.no_grad():
        torch.manual_seed(1)
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.2)
    model.train()
    return model


def batch(name: str, b: int = 4) -> dict:
    inputs = models.batch("bert" if name == "bert-cls" else name, b=b)
    if name == "bert-cls":
        inputs["labels"] = torch.arange(b) % 3
    return inputs


def check_lora(rank: int, world: int, name: str, mode: str, depth=None, dp: int = 1) -> dict:
    """Run on every rank: the failures of every comparison (empty = exact), the ledger /
    plan figures and the optimizer-state bytes (:func:`models.check_trainable`)."""
    torch.set_num_threads(1)
    dense = build(name)
    res, sharded, inputs = models.check_trainable(
        rank, world, dense, copy.deepcopy(dense), batch(name, b=4 * dp), mode=mode, depth=depth, dp=dp,
        dense_params=dict(dense.get_base_model().named_parameters(remove_duplicate=False)))
    plan = sharded.plan
    res.update({"lora_params": sum("lora_" in pp.name for pp in plan.params),
                "trainable_bytes": sum(p.numel() * p.element_size() for p in sharded.parameters() if p.requires_grad),
                "plan_trainable_bytes": plan.trainable_bytes_per_rank})
    if dp == 1:
        res.update(models.train_trainable(sharded, dense, inputs, STEPS, lr=1e-2))
    return res


CASES = [  # (name, world, mode, depth, dp)
    ("llama", 2, "1d", None, 1),
    ("gpt2", 4, "2d", None, 1),
    pytest.param(("bert-cls", 4, "1d", None, 2), marks=pytest.mark.extended),
    pytest.param(("llama", 4, "1d", None, 1), marks=pytest.mark.extended),
    pytest.param(("llama", 4, "2d", None, 1), marks=pytest.mark.extended),
    pytest.param(("llama", 4, "1d-sp", None, 1), marks=pytest.mark.extended),
    pytest.param(("gpt2", 2, "1d", None, 1), marks=pytest.mark.extended),
    pytest.param(("gpt2", 4, "1d", None, 1), marks=pytest.mark.extended),
    pytest.param(("bert-cls", 2, "1d", None, 1), marks=pytest.mark.extended),
    pytest.param(("bert-cls", 4, "2d", None, 1), marks=pytest.mark.extended),
] + [pytest.param((n, 8, m, d, 1), marks=[pytest.mark.slow, pytest.mark.extended])
     for n in ("llama", "gpt2", "bert-cls") for m, d in (("2.5d", 2), ("3d", None))]


def _id(c) -> str:
    name, world, mode, depth, dp = c
    return f"{name}-{mode}x{world}" + (f"-d{depth}" if depth else "") + (f"-dp{dp}" if dp > 1 else "")


@pytest.mark.parametrize("case", CASES, ids=_id)
def test_lora_equals_dense_peft(case):
    name, world, mode, depth, dp = case
    results = get_pool(world, timeout=900).run(check_lora, name, mode, depth, dp)
    for rank, r in enumerate(results):
        assert r["failures"] == [], f"rank {rank}: {r['failures']}"
        assert r["ledger"] == r["plan"], f"rank {rank}: ledger {r['ledger']} vs plan {r['plan']}"
        assert r["lora_params"] > 0
        assert r["trainable_bytes"] == r["plan_trainable_bytes"]
        if dp == 1:
            assert r["frozen_moved"] == []
            assert abs(r["dense_losses"][-1] - r["dense_losses"][0]) > 1e-3, "the steps must move the loss"
            for a, b in zip(r["losses"], r["dense_losses"]):
                assert abs(a - b) <= 1e-5, (r["losses"], r["dense_losses"])
            # AdamW keeps exp_avg and exp_avg_sq of each trainable local shard, nothing for the frozen base
            assert abs(r["adam_bytes"] - 2 * r["trainable_bytes"]) <= 0.02 * 2 * r["trainable_bytes"]
    assert len({r["loss"] for r in results}) == 1, [r["loss"] for r in results]


def test_lora_plan_keeps_the_adapter_in_the_base_layout():
    """On meta, no processes: in 1d a column-split base gets a whole A and a column-split
    B, a row-split base a row-split A and a whole B whose partial sum joins the base's
    (one all-reduce after their add): the forward has the collectives of the model
    without adapters; a row-split target's B syncs its gradient (its input is a partial
    sum); the plan table shows the adapters."""
    import autoshard

    m = build("llama")
    p = autoshard.plan(m.get_base_model(), world_size=2, mode="1d", batch_size=4, seq_len=8)
    full = autoshard.plan(models.build("llama"), world_size=2, mode="1d", batch_size=4, seq_len=8)
    spec = {pp.name: str(pp.spec) for pp in p.params}
    pre = "model.layers.0."
    for col in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.up_proj", "mlp.gate_proj"):
        assert spec[f"{pre}{col}.base_layer.weight"] == "[S(tp), R]"
        assert (spec[f"{pre}{col}.lora_A.default.weight"], spec[f"{pre}{col}.lora_B.default.weight"]) \
            == ("[R, R]", "[S(tp), R]"), col
    for row in ("self_attn.o_proj", "mlp.down_proj"):
        assert spec[f"{pre}{row}.base_layer.weight"] == "[R, S(tp)]"
        assert (spec[f"{pre}{row}.lora_A.default.weight"], spec[f"{pre}{row}.lora_B.default.weight"]) \
            == ("[R, S(tp)]", "[R, R]"), row
    assert len(p.comms("fwd")) == len(full.comms("fwd"))
    sync = {pp.name: pp.grad_sync for pp in p.params}
    assert sync[f"{pre}self_attn.o_proj.lora_B.default.weight"] and not sync[f"{pre}self_attn.q_proj.lora_B.default.weight"]
    from rich.console import Console

    console = Console(record=True, width=400)
    console.print(p.table())
    text = console.export_text()
    assert "lora_A" in text and "lora_B" in text


def _round_trip(rank: int, world: int, mode: str, folder: str) -> dict:
    """Save the adapters (and the merged model) of a sharded peft Llama; peft loads them on a
    dense base (rank 0); a peft folder loaded into shard() resumes where it was."""
    import os

    import peft
    import transformers

    import autoshard

    torch.set_num_threads(1)
    inputs = batch("llama")
    dense = build("llama")
    sharded = autoshard.shard(copy.deepcopy(dense), mode=mode, example_inputs=inputs)
    sharded.eval()
    logits = sharded(**inputs).logits.detach()
    sharded.save_pretrained(os.path.join(folder, "adapter"))
    sharded.save_pretrained(os.path.join(folder, "merged"), merged=True)
    sharded.save_checkpoint(os.path.join(folder, "ckpt"))
    out = {"files": sorted(os.listdir(os.path.join(folder, "adapter")))}
    if rank == 0:
        loaded = peft.PeftModel.from_pretrained(models.build("llama"), os.path.join(folder, "adapter")).eval()
        out["peft_loaded"] = (loaded(**inputs).logits - logits).abs().max().item()
        merged = transformers.AutoModelForCausalLM.from_pretrained(os.path.join(folder, "merged")).eval()
        out["merged"] = (merged(**inputs).logits - logits).abs().max().item()
        out["merged_names"] = [n for n, _ in merged.named_parameters() if "lora" in n]
        from autoshard.cli import main as cli

        assert cli(["export", os.path.join(folder, "ckpt"), os.path.join(folder, "exported")]) == 0
        exported = transformers.AutoModelForCausalLM.from_pretrained(os.path.join(folder, "exported")).eval()
        out["exported"] = (exported(**inputs).logits - logits).abs().max().item()
    resumed = peft.PeftModel.from_pretrained(models.build("llama"), os.path.join(folder, "adapter"), is_trainable=True)
    again = autoshard.shard(resumed, mode=mode, example_inputs=inputs).eval()
    out["resumed"] = (again(**inputs).logits - logits).abs().max().item()
    out["resumed_trainable"] = sum(p.requires_grad for p in again.parameters())
    return out


def test_adapter_round_trip(tmp_path):
    """2d@4: ``save_pretrained`` writes peft's adapter folder, which
    ``PeftModel.from_pretrained`` loads on a dense base with the sharded module's logits;
    ``merged=True`` writes a folder transformers loads with the same logits, and so does
    ``autoshard export`` of a sharded checkpoint (the adapter merged); the adapter
    folder loaded into ``shard()`` gives them again, its adapters trainable."""
    results = get_pool(4, timeout=900).run(_round_trip, "2d", str(tmp_path))
    r0 = results[0]
    assert {"adapter_config.json", "adapter_model.safetensors"} <= set(r0["files"])
    assert r0["peft_loaded"] <= 1e-5 and r0["merged"] <= 1e-5 and r0["exported"] <= 1e-5, r0
    assert r0["merged_names"] == []
    for r in results:
        assert r["resumed"] <= 1e-5 and r["resumed_trainable"] > 0, r


def _generate(rank: int, world: int, mode: str) -> dict:
    import autoshard

    torch.set_num_threads(1)
    dense = build("llama").eval()
    ids = torch.randint(3, 128, (2, 5), generator=torch.Generator().manual_seed(3))
    kw = dict(max_new_tokens=8, min_new_tokens=8, do_sample=False, pad_token_id=0)
    ref = dense.generate(input_ids=ids, **kw)
    sharded = autoshard.shard(copy.deepcopy(dense), mode=mode, example_inputs=batch("llama"))
    return {"got": sharded.generate(input_ids=ids, **kw).tolist(), "ref": ref.tolist()}


@pytest.mark.extended
def test_generate_equals_dense_peft():
    """generate() on a sharded peft Llama (1d@2): peft's dense generate, token for token
    (the step graphs are rebuilt with the adapters re-injected)."""
    for r in get_pool(2, timeout=900).run(_generate, "1d"):
        assert r["got"] == r["ref"]


def test_refused_by_name():
    """Prefix tuning and a quantized base are refused before any collective, naming them."""
    import peft

    import autoshard
    from autoshard.ir.errors import ConfigError

    base = models.build("llama")
    prefix = peft.get_peft_model(base, peft.PrefixTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=4))
    with pytest.raises(ConfigError, match="PREFIX_TUNING"):
        autoshard.shard(prefix, mode="1d")
    q = models.build("llama")
    q.config.quantization_config = {"quant_method": "bitsandbytes", "load_in_4bit": True}
    q.is_loaded_in_4bit = True
    with pytest.raises(ConfigError, match="bitsandbytes"):
        autoshard.shard(q, mode="1d")


def _variants(rank: int, world: int, folder: str) -> dict:
    """rsLoRA, DoRA, lora_dropout under dropout="dense", and two adapters with the second
    active: loss and logits of each equal dense peft's; both adapters are saved."""
    import os

    import autoshard

    torch.set_num_threads(1)
    inputs = batch("llama")
    out = {}
    for label, kw, opts in (("rslora", dict(use_rslora=True), {}), ("dora", dict(use_dora=True), {}),
                            ("dropout", dict(lora_dropout=0.3), dict(dropout="dense")), ("two", {}, {})):
        dense = build("llama", **kw)
        if label == "two":
            import peft

            dense.add_adapter("second", peft.LoraConfig(r=2, lora_alpha=16, target_modules=["q_proj", "v_proj"],
                                                        task_type="CAUSAL_LM"))
            dense.set_adapter("second")
        model = copy.deepcopy(dense)
        torch.manual_seed(5)
        ref = dense(**inputs)
        ref.loss.backward()
        sharded = autoshard.shard(model, mode="1d", example_inputs=inputs, **opts)
        torch.manual_seed(5)
        got = sharded(**inputs)
        got.loss.backward()
        dparams = dict(dense.get_base_model().named_parameters())
        grads = [(pp.spec.local(pp.pad(dparams[pp.name].grad), sharded.plan.mesh, rank)
                  - p.grad).abs().max().item()
                 for pp in sharded.plan.params for p in [sharded.get_parameter(pp.name)] if p.grad is not None]
        out[label] = {"loss": (got.loss - ref.loss).abs().item(), "logits": (got.logits - ref.logits).abs().max().item(),
                      "grad": max(grads), "trainable": sum(p.requires_grad for p in sharded.parameters())}
        if label == "two":
            sharded.save_pretrained(os.path.join(folder, "two"))
            out[label]["files"] = sorted(os.listdir(os.path.join(folder, "two")))
    return out


@pytest.mark.extended
def test_lora_variants_equal_dense_peft(tmp_path):
    for r in get_pool(2, timeout=900).run(_variants, str(tmp_path)):
        for label, v in r.items():
            assert v["loss"] <= 1e-5 and v["logits"] <= 1e-5 and v["grad"] <= 1e-5, (label, v)
            assert v["trainable"] > 0, label
        assert "second" in r["two"]["files"] and "adapter_model.safetensors" in r["two"]["files"], r["two"]["files"]
