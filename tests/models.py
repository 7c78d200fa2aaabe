"""Tiny random models shared by the tests (hidden 64, 2 layers), and the
equivalence check run on every rank: sharded vs dense logits, loss, every local
gradient, parameter bytes and the collective ledger vs the plan."""

from __future__ import annotations

import copy

import torch

TINY = {
    "gpt2": ("GPT2LMHeadModel", "GPT2Config", dict(n_embd=64, n_layer=2, n_head=4, vocab_size=128, n_positions=64,
                                                   resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)),
    "llama": ("LlamaForCausalLM", "LlamaConfig", dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=128,
                                                      max_position_embeddings=64)),
    "bert": ("BertForMaskedLM", "BertConfig", dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                                   num_attention_heads=4, vocab_size=128, max_position_embeddings=64,
                                                   hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)),
}


def build(name: str, seed: int = 0):
    import transformers

    cls, cfg_cls, kw = TINY[name]
    torch.manual_seed(seed)
    model = getattr(transformers, cls)(getattr(transformers, cfg_cls)(**kw))
    # tiny random init is too small to tell layers apart: widen it
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.2)
    model.train()
    return model


def batch(name: str, b: int = 4, s: int = 8, seed: int = 1) -> dict:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 128, (b, s), generator=g)
    labels = ids.clone()
    labels[0, :2] = -100
    mask = torch.ones(b, s, dtype=torch.long)
    mask[1, :3] = 0                       # left padding in one row
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def check(rank: int, world: int, name: str, mode: str, depth=None, steps: int = 0) -> dict:
    """Run on every rank; returns max errors and the ledger / plan figures."""
    import autoshard
    from autoshard.collectives import CommLedger

    torch.set_num_threads(1)
    dense = build(name)
    model = copy.deepcopy(dense)
    inputs = batch(name)
    out_d = dense(**inputs)
    out_d.loss.backward()
    sharded = autoshard.shard(model, mode=mode, depth=depth, example_inputs=inputs)
    with CommLedger() as led:
        out = sharded(**inputs)
        out.loss.backward()
    plan = sharded.plan
    res = {"loss": (out.loss - out_d.loss).abs().item(),
           "logits": (out.logits - out_d.logits).abs().max().item(),
           "ledger_bytes": led.bytes_per_rank(), "plan_bytes": plan.comm_bytes_per_rank(),
           "ledger_calls": led.count(), "plan_calls": len(plan.comms()),
           "param_bytes": sum(p.numel() * p.element_size() for p in sharded.parameters()),
           "plan_param_bytes": plan.param_bytes_per_rank, "grad": 0.0, "n_params": 0,
           "fallbacks": [n.name for n in plan.fallbacks]}
    dparams = dict(dense.named_parameters(remove_duplicate=False))
    sparams = dict(sharded.named_parameters(remove_duplicate=False))
    worst = ("", 0.0)
    for pp in plan.params:
        ref = pp.spec.local(dparams[pp.name].grad, plan.mesh, rank)
        got = sparams[pp.name].grad
        err = (got - ref).abs().max().item() if got is not None else float("inf")
        rel = err / (ref.abs().max().item() + 1e-12)
        if rel > worst[1]:
            worst = (pp.name, rel)
        res["grad"] = max(res["grad"], err)
        res["n_params"] += 1
    res["worst_grad"] = worst
    res["tied_one_param"] = len(list(sharded.parameters())) == len({id(p) for p in dense.parameters()})
    if steps:
        res["losses"], res["dense_losses"] = _train(sharded, dense, inputs, steps)
    return res


def _train(sharded, dense, inputs, steps):
    opt_s = torch.optim.AdamW(sharded.parameters(), lr=1e-3)
    opt_d = torch.optim.AdamW(dense.parameters(), lr=1e-3)
    ls, ld = [], []
    for m, opt, out in ((sharded, opt_s, ls), (dense, opt_d, ld)):
        for _ in range(steps):
            opt.zero_grad()
            loss = m(**inputs).loss
            loss.backward()
            opt.step()
            out.append(loss.item())
    return ls, ld
