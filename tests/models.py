"""Tiny random models shared by the tests (hidden 64, 2 layers), and the
equivalence check run on every rank: sharded vs dense logits, loss, every local
gradient, parameter bytes and the collective ledger vs the plan."""

from __future__ import annotations

import contextlib
import copy
import os

import torch

from arch_models import ARCHS

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
# vocabularies no split divides (131 is prime): padded to the split (autoshard/passes/pad.py)
for _name in ("gpt2", "llama", "bert"):
    _cls, _cfg, _kw = TINY[_name]
    TINY[f"{_name}-v131"] = (_cls, _cfg, {**_kw, "vocab_size": 131})
# 8 heads (and 8 kv heads): every head split divides on 2, 4 and 8 GPUs (make test-gpu)
TINY["gpt2-h8"] = (TINY["gpt2"][0], TINY["gpt2"][1], {**TINY["gpt2"][2], "n_head": 8})
TINY["llama-h8"] = (TINY["llama"][0], TINY["llama"][1],
                    {**TINY["llama"][2], "num_attention_heads": 8, "num_key_value_heads": 8})
TINY["bert-h8"] = (TINY["bert"][0], TINY["bert"][1], {**TINY["bert"][2], "num_attention_heads": 8})
TINY["gpt2-v130"] = (TINY["gpt2"][0], TINY["gpt2"][1], {**TINY["gpt2"][2], "vocab_size": 130})   # 2 divides, 4 not
# q/k RMSNorms over the whole projection, all heads at once (a distributed norm in 1d)
TINY["olmo2"] = ("Olmo2ForCausalLM", "Olmo2Config", {**TINY["llama"][2], "num_key_value_heads": 4})
# per-head q/k RMSNorms computed in float and cast back (type_as), sliding and global layers
# attention sinks (a per-head parameter joined to the scores, then a max over the keys), experts with biases
TINY["gptoss"] = ("GptOssForCausalLM", "GptOssConfig",
                  {**TINY["llama"][2], "intermediate_size": 64, "head_dim": 16, "num_local_experts": 4,
                   "num_experts_per_tok": 2, "sliding_window": 4})
TINY["gemma3"] = ("Gemma3ForCausalLM", "Gemma3TextConfig", {**TINY["llama"][2], "head_dim": 16, "sliding_window": 4})
# state-space models: Mamba's selective scan (a Python loop over the sequence: a static sequence),
# and Jamba's hybrid of scan layers, attention layers and experts
TINY["mamba"] = ("MambaForCausalLM", "MambaConfig", dict(vocab_size=128, hidden_size=64, state_size=8,
                                                         num_hidden_layers=2, expand=2, conv_kernel=4, use_cache=False))
TINY["jamba"] = ("JambaForCausalLM", "JambaConfig",
                 dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, num_experts=2, num_experts_per_tok=1, expert_layer_period=2,
                      expert_layer_offset=1, attn_layer_period=2, attn_layer_offset=1, mamba_d_state=8,
                      mamba_d_conv=4, mamba_expand=2, use_cache=False))
# Falcon-H1: attention and a Mamba-2 mixer side by side in every layer (chunked scan over heads)
TINY["falconh1"] = ("FalconH1ForCausalLM", "FalconH1Config",
                    dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, mamba_d_ssm=64, mamba_n_heads=4,
                         mamba_d_head=16, mamba_n_groups=1, mamba_d_state=8, mamba_d_conv=4, mamba_expand=2,
                         mamba_chunk_size=4, max_position_embeddings=64, use_cache=False))
# Bamba (IBM): Mamba-2 mixer layers with an attention layer among them (one of two here)
TINY["bamba"] = ("BambaForCausalLM", "BambaConfig",
                 dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, attn_layer_indices=[1], mamba_n_heads=4,
                      mamba_d_head=32, mamba_n_groups=1, mamba_d_state=8, mamba_d_conv=4, mamba_expand=2,
                      mamba_chunk_size=4, max_position_embeddings=64, use_cache=False))
# per-head q/k LayerNorms with a [heads, head_dim] weight cast to float (tests/test_whole.py)
TINY["cohere"] = ("CohereForCausalLM", "CohereConfig", {**TINY["llama"][2], "num_key_value_heads": 4,
                                                       "use_qk_norm": True})
# a short causal convolution over the tokens (LFM2's conv layers: padded both sides, the first S kept)
# beside attention layers
TINY["lfm2"] = ("Lfm2ForCausalLM", "Lfm2Config",
                {**TINY["llama"][2], "layer_types": ["conv", "full_attention"], "conv_L_cache": 3, "use_cache": False})
# mixtures of experts beside Mixtral (expert parallelism, tests/test_expert_parallel.py): Qwen3-MoE
# (per-head q/k norms, normalised top-k), OLMoE (q/k norms over the projection, top-k unnormalised),
# DeepSeek-V3 (a shared expert beside the routed ones, sigmoid router with a bias, low-rank attention)
_MOE = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, vocab_size=128,
            max_position_embeddings=64, num_experts_per_tok=2, output_router_logits=True)
TINY["qwen3moe"] = ("Qwen3MoeForCausalLM", "Qwen3MoeConfig",
                    dict(_MOE, intermediate_size=128, moe_intermediate_size=64, num_experts=4, head_dim=16,
                         norm_topk_prob=True))
TINY["olmoe"] = ("OlmoeForCausalLM", "OlmoeConfig",
                 dict(_MOE, intermediate_size=64, num_experts=4, eos_token_id=1, pad_token_id=0))
TINY["deepseekv3"] = ("DeepseekV3ForCausalLM", "DeepseekV3Config",
                      dict(_MOE, intermediate_size=128, moe_intermediate_size=64, n_routed_experts=4, n_shared_experts=1,
                           first_k_dense_replace=0, n_group=1, topk_group=1, q_lora_rank=None, kv_lora_rank=16,
                           qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16))
# DeepSeek-V3's query as the full model has it (q_lora_rank set): q_a_proj, an RMSNorm, q_b_proj
TINY["deepseekv3-q"] = ("DeepseekV3ForCausalLM", "DeepseekV3Config", dict(TINY["deepseekv3"][2], q_lora_rank=16))
# DeepSeek-V2: MLA with a complex rotary embedding (view_as_complex, a complex product,
# view_as_real), a dense first layer and an MoE second (first_k_dense_replace=1)
TINY["deepseekv2"] = ("DeepseekV2ForCausalLM", "DeepseekV2Config",
                      dict(_MOE, intermediate_size=128, moe_intermediate_size=32, n_routed_experts=4, n_shared_experts=1,
                           first_k_dense_replace=1, n_group=1, topk_group=1, q_lora_rank=None, kv_lora_rank=16,
                           qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8, output_router_logits=False))
# a fused Wqkv viewed as [.., 3, heads, head_dim] and unbound (split per block: each rank its heads of
# q, k and v), an encoder with rotary, local and global attention layers and a fused gated MLP
TINY["modernbert"] = ("ModernBertForMaskedLM", "ModernBertConfig",
                      dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                           vocab_size=128, max_position_embeddings=64, global_attn_every_n_layers=2,
                           local_attention=4, hidden_dropout=0.0, attention_dropout=0.0, embedding_dropout=0.0,
                           mlp_dropout=0.0, pad_token_id=0, eos_token_id=1, bos_token_id=2, cls_token_id=2,
                           sep_token_id=1))
# heads and widths no split divides (autoshard/passes/pad.py, pad_widths; docs/design.md, "Uneven widths"):
# 8 heads (and an intermediate size of 160) at 3 ranks, GPT-2's 12 heads at 8, Qwen2's 28 heads and 4 kv heads
TINY["llama-h8-i160"] = ("LlamaForCausalLM", "LlamaConfig", {**TINY["llama"][2], "hidden_size": 96, "num_attention_heads": 8,
                                                       "num_key_value_heads": 8, "intermediate_size": 160})
TINY["gpt2-h12"] = ("GPT2LMHeadModel", "GPT2Config", {**TINY["gpt2"][2], "n_embd": 96, "n_head": 12})
# 2 kv heads at 4 ranks: each kv head held by the 2 ranks whose query heads read it
TINY["llama-kv2"] = ("LlamaForCausalLM", "LlamaConfig", {**TINY["llama"][2], "num_attention_heads": 8,
                                                        "num_key_value_heads": 2, "hidden_size": 96})
# 2d at 9 ranks (q=3): 8 heads padded to 9, an intermediate size of 160 to 162; 4 layers, so the embedding
# table, which 2d holds whole over row, is not most of the parameter bytes per rank as it is in 2 layers
TINY["llama-h8-l4"] = ("LlamaForCausalLM", "LlamaConfig", {**TINY["llama-h8-i160"][2], "num_hidden_layers": 4})
# 6 heads, 3 kv heads and an intermediate size of 150 at 4 ranks (1d-sp: the sequence of 8 splits)
TINY["llama-h6"] = ("LlamaForCausalLM", "LlamaConfig", {**TINY["llama"][2], "num_attention_heads": 6,
                                                       "num_key_value_heads": 3, "hidden_size": 96,
                                                       "intermediate_size": 150})
# 3d at 8 ranks (q=2): 31 heads padded to 32, an intermediate size of 402 to 404 (a multiple of q²: the
# weights split their out features over two axes); hidden 248, so the embedding table, which 3d holds whole
# over two axes, is not most of the bytes per rank
TINY["llama-h31"] = ("LlamaForCausalLM", "LlamaConfig", {**TINY["llama"][2], "hidden_size": 248,
                                                           "num_attention_heads": 31, "num_key_value_heads": 31,
                                                           "intermediate_size": 402})
# multi-query attention (one kv head) at 4 ranks: the kv head held by every rank (1d), by both cols (2d)
TINY["llama-mqa"] = ("LlamaForCausalLM", "LlamaConfig", {**TINY["llama"][2], "num_key_value_heads": 1})
# a hidden size no grid side divides (63: 2d, 2.5d and 3d at q=2), 4 heads of 16 (q_proj [64, 63]; Mistral's
# config, unlike Llama's, lets the heads not divide the hidden size)
TINY["mistral-d63"] = ("MistralForCausalLM", "MistralConfig", {**TINY["llama"][2], "hidden_size": 63, "head_dim": 16})
# LayerNorm models whose hidden size no grid side divides (hidden = heads × head_dim: the heads are padded
# too, so q/k/v and the output projection are padded on both dims): GPT-2 with 7 heads of 9 (hidden 63) at
# q=2, BERT with 4 heads of 25 (hidden 100) at q=3
TINY["gpt2-d63"] = ("GPT2LMHeadModel", "GPT2Config", {**TINY["gpt2"][2], "n_embd": 63, "n_head": 7})
TINY["bert-d100"] = ("BertForMaskedLM", "BertConfig", {**TINY["bert"][2], "hidden_size": 100})
TINY["qwen2-h28"] = ("Qwen2ForCausalLM", "Qwen2Config",
                     {**TINY["llama"][2], "hidden_size": 112, "num_attention_heads": 28, "num_key_value_heads": 4,
                      "intermediate_size": 144, "tie_word_embeddings": False})
# Phi-3's fused qkv_proj with 2 kv heads for 8 query heads: sliced [:64] [64:80] [80:], blocks of unequal
# widths split per block (each rank its q, k and v heads)
TINY["phi3-kv2"] = ("Phi3ForCausalLM", "Phi3Config",
                    dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=8,
                         num_key_value_heads=2, vocab_size=128, max_position_embeddings=64, pad_token_id=0,
                         resid_pdrop=0.0, embd_pdrop=0.0, attention_dropout=0.0, tie_word_embeddings=False))
# the architecture matrix (tests/arch_models.py) adds its tiny configs (gptneo, debertav2, qwen3,
# mixtral: local attention, relative attention, per-head q/k norms, mixture of experts, ...)
TINY.update({k: v[:3] for k, v in ARCHS.items() if k not in TINY})
# expert counts that expert parallelism does not divide (3 experts at ep=2, 6 at ep=4): zero-padded experts
TINY["mixtral-e3"] = ("MixtralForCausalLM", "MixtralConfig", {**TINY["mixtral"][2], "num_local_experts": 3})
TINY["mixtral-e6"] = ("MixtralForCausalLM", "MixtralConfig", {**TINY["mixtral"][2], "num_local_experts": 6})


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
    if b > 1:
        mask[1, :3] = 0                   # left padding in one row
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def comparer(failures: list, *, detail: bool = True):
    """``cmp(what, got, ref)``: ``got`` against ``ref`` within atol = rtol = 1e-5, a
    mismatch appended to ``failures`` (with torch's worst-element lines if ``detail``)."""
    def cmp(what, got, ref):
        try:
            torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
        except AssertionError as e:
            lines = str(e).splitlines()
            failures.append(f"{what}: {lines[0]} {lines[2:4]}" if detail else f"{what}: {lines[0]}")
    return cmp


def compare_local_grads(cmp, failures: list, plan, sharded, dense, rank: int) -> None:
    """Every parameter's local gradient of ``sharded`` against the matching slice of
    ``dense``'s (padded as the plan pads it), through ``cmp`` (:func:`comparer`); a
    missing gradient appended to ``failures``."""
    dparams = dict(dense.named_parameters(remove_duplicate=False))
    sparams = dict(sharded.named_parameters(remove_duplicate=False))
    for pp in plan.params:
        got = sparams[pp.name].grad
        if got is None:
            failures.append(f"grad {pp.name}: missing")
            continue
        cmp(f"grad {pp.name}", got, pp.spec.local(pp.pad(dparams[pp.name].grad), plan.mesh, rank))


def compile_setup(name: str, mode: str, depth=None):
    """``(sharded, inputs)`` for a compile test on a rank: one thread, dynamo's caches
    reset, the tiny model ``name`` sharded in ``mode`` from its batch."""
    import torch._dynamo

    import autoshard

    torch.set_num_threads(1)
    torch._dynamo.reset()
    inputs = batch(name)
    return autoshard.shard(build(name), mode=mode, depth=depth, example_inputs=inputs), inputs


def step_state(out, sharded, clone: bool = False) -> dict:
    """Loss, logits and every local gradient of a step of ``sharded`` that gave ``out``."""
    return {"loss": out.loss.detach(), "logits": out.logits.detach(),
            **{f"grad {n}": p.grad.clone() if clone else p.grad for n, p in sharded.named_parameters()}}


def aot_recorder(codes: dict):
    """A ``torch.compile`` backend that keeps the code of dynamo's graph and of
    AOTAutograd's forward and backward in ``codes`` and runs them as they are."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    def keep(tag):
        def compiler(gm, example_inputs):
            codes[tag] = gm.code
            return make_boxed_func(gm.forward)
        return compiler

    aot = aot_autograd(fw_compiler=keep("forward"), bw_compiler=keep("backward"))

    def backend(gm, example_inputs):
        codes["dynamo"] = gm.code
        return aot(gm, example_inputs)
    return backend


def check(rank: int, world: int, name: str, mode: str, depth=None, steps: int = 0, mutate: str | None = None,
          dp: int = 1, share_capture: bool = False, cp: int = 1, rows_per_replica: int = 4, seq: int = 8,
          cp_attention: str = "ring", cp_order: str = "balanced", ep: int = 1) -> dict:
    """Run on every rank. Returns the failures of every comparison (empty = exact),
    the worst errors, and the ledger / plan figures.

    ``mutate="no_depth_sync"`` drops the depth all-reduce of gradients (a planted
    bug the comparison must catch). With ``dp > 1`` the dense model sees the
    global batch and each data-parallel replica its own 4 rows of it.
    ``share_capture`` reuses this worker's earlier export of the same model
    (same seed, same input shapes), so several modes pay for one capture."""
    import autoshard
    from autoshard.runtime.collectives import CommLedger, is_balanced
    from autoshard.runtime.parallel_ops import ring_work

    torch.set_num_threads(1)
    dense = build(name)
    model = copy.deepcopy(dense)
    r = rows_per_replica
    inputs = batch(name, b=r * dp, s=seq)
    out_d = dense(**inputs)
    out_d.loss.backward()
    tp = world // dp
    rows = slice((rank // tp) * r, (rank // tp + 1) * r)       # dp is the outermost mesh axis
    ref_logits = out_d.logits[rows]
    inputs = {k: v[rows] for k, v in inputs.items()}
    sharded = autoshard.shard(model, mode=mode, depth=depth, dp=dp, example_inputs=inputs, cp=cp, cp_attention=cp_attention,
                              cp_order=cp_order, captured=shared_capture(name, model, inputs) if share_capture else None,
                              **({"ep": ep} if ep > 1 else {}))
    if mutate == "no_depth_sync":
        _drop_axis_from_grad_sync(sharded, "dep")
    with CommLedger() as led, ring_work() as work:
        out = sharded(**inputs)
        out.loss.backward()
    plan = sharded.plan
    failures = []
    cmp = comparer(failures)

    cmp("loss", out.loss, out_d.loss)
    cmp("logits", out.logits, ref_logits)
    if getattr(out_d, "aux_loss", None) is not None:          # MoE: the router's load-balancing loss
        cmp("aux_loss", out.aux_loss, out_d.aux_loss)
        for i, (got, ref) in enumerate(zip(out.router_logits, out_d.router_logits)):
            cmp(f"router_logits[{i}]", got, ref.view(r * dp, -1, ref.shape[-1])[rows].reshape(got.shape))
    dparams = dict(dense.named_parameters(remove_duplicate=False))
    sparams = dict(sharded.named_parameters(remove_duplicate=False))
    grad_err = 0.0
    for pp in plan.params:
        ref = pp.spec.local(pp.pad(dparams[pp.name].grad), plan.mesh, rank)     # a padded vocabulary: zero rows
        got = sparams[pp.name].grad
        if got is None:
            failures.append(f"grad {pp.name}: missing")
            continue
        cmp(f"grad {pp.name}", got, ref)
        grad_err = max(grad_err, (got - ref).abs().max().item())
    if (r, seq) != (4, 8):      # the module's plan is made at its capture's shape: plan the call's for the ledger
        plan = autoshard.plan(copy.deepcopy(dense), world_size=world, mode=mode, depth=depth, dp=dp, cp=cp,
                              cp_attention=cp_attention, cp_order=cp_order, batch_size=r * dp, seq_len=seq)
    res = {"failures": failures, "loss": out.loss.item(), "loss_err": (out.loss - out_d.loss).abs().item(),
           "logits_err": (out.logits - ref_logits).abs().max().item(), "grad_err": grad_err,
           "ledger_bytes": led.bytes_per_rank(), "plan_bytes": plan.comm_bytes_per_rank(),
           "ledger_calls": led.count(), "plan_calls": len(plan.comms()),
           "param_bytes": sum(p.numel() * p.element_size() for p in sharded.parameters()),
           "plan_param_bytes": plan.param_bytes_per_rank,
           "n_local_params": len(list(sharded.parameters())),
           "n_dense_params": len({id(p) for p in dense.parameters()}),
           "fallbacks": [n.name for n in plan.fallbacks],
           "cp_nodes": sum(1 for n in plan.nodes if "cp" in getattr(n.out_spec, "axes", ())),
           "sdpa_cp_gathers": sum(1 for n in plan.nodes if n.kind == "attention" for c in n.comms
                                  if c.kind == "all_gather" and c.axes == ("cp",) and c.phase == "fwd"),
           "ring_attention": sum(1 for n in plan.nodes if n.kind == "attention" and n.kernel is not None
                                 and n.kernel.name == "ring_attention"),
           "batch_split": sharded.batch_split,
           "ring_scores": work["scores"],       # attention scores ring attention computed here (forward)
           # convolutions along a cp-split sequence: their halo and its collectives' buffers
           "halo": [(n.kernel.left, n.kernel.right, n.out_spec.dims[2]) for n in plan.nodes
                    if n.kernel is not None and n.kernel.name == "sequence_conv"],
           "halo_buffers": sorted((c.kind, c.buffer_bytes) for n in plan.nodes if n.kernel is not None
                                  and n.kernel.name == "sequence_conv" for c in n.comms if c.kind != "all_reduce"),
           "min_seq": plan.min_seq_len,
           "balanced": cp > 1 and is_balanced(sharded.groups["cp"])}
    if steps and dp == 1:
        res["losses"], res["dense_losses"] = _train(sharded, dense, inputs, steps)
    return res


def assert_same_values(cap, folded, inputs: dict) -> None:
    """A graph-normalising pass kept the values: loss, logits and every parameter's
    gradient of ``folded`` bit-equal to those of the captured graph ``cap``."""
    kw = {**inputs, **cap.constants}
    a, b = cap.module(**kw), folded.module(**kw)
    torch.testing.assert_close(b[0], a[0], atol=0, rtol=0)
    torch.testing.assert_close(b[1], a[1], atol=0, rtol=0)
    a[0].backward()
    b[0].backward()
    for name, p in cap.module.named_parameters():
        torch.testing.assert_close(folded.module.get_parameter(name).grad, p.grad, atol=0, rtol=0)


def shared_capture(name: str, model, inputs: dict):
    """One export per model and input shapes per worker: the rewrite copies the
    captured module, so planning several modes from it leaves it untouched."""
    from autoshard.launch.capture_share import capture_shared
    from dist_pool import worker_cache

    key = ("captured", name, str(next(model.parameters()).dtype),
           tuple(sorted((k, tuple(v.shape)) for k, v in inputs.items())))
    cache = worker_cache()
    if key not in cache:            # every rank misses together: rank 0 exports, the others load
        cache[key] = capture_shared(model, example_inputs=inputs)
    return cache[key]


def _drop_axis_from_grad_sync(sharded, axis: str) -> None:
    from autoshard.sharded.grads import sync_hook as _sync_hook

    sharded.clear_grad_sync()
    params = dict(sharded.named_parameters(remove_duplicate=False))
    for pp in sharded.plan.params:
        axes = tuple(a for a in pp.grad_sync if a != axis)
        if axes:
            params[pp.name].register_hook(_sync_hook(sharded.groups[",".join(axes)]))


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


def check_trainable(rank: int, world: int, dense, model, inputs: dict, *, mode: str, depth=None, dp: int = 1,
                    dense_params: dict | None = None, captured=None, **shard_kw) -> tuple[dict, object, dict]:
    """The frozen-parameter comparison (tests/test_frozen.py, tests/test_lora.py), run on
    every rank: ``dense`` (some parameters frozen) on the global batch ``inputs``,
    ``model`` (a copy, or the same model wrapped) sharded and run on this replica's
    rows. Returns ``(result, sharded, local inputs)``: ``result`` holds the failures
    (empty = exact: loss, logits, every trainable local gradient within 1e-5; frozen
    slices without a gradient, not trainable in the plan, no gradient sync) and the
    ledger / plan figures per phase. ``dense_params``: the dense parameters under the
    sharded module's names (default: ``dense``'s)."""
    import autoshard
    from autoshard.runtime.collectives import CommLedger

    out_d = dense(**inputs)
    out_d.loss.backward()
    tp = world // dp
    rows = slice((rank // tp) * 4, (rank // tp + 1) * 4)
    ref_logits = out_d.logits[rows]
    inputs = {k: v[rows] for k, v in inputs.items()}
    sharded = autoshard.shard(model, mode=mode, depth=depth, dp=dp, example_inputs=inputs, captured=captured,
                              **shard_kw)
    plan = sharded.plan
    with CommLedger() as fwd:
        out = sharded(**inputs)
    with CommLedger() as bwd:
        out.loss.backward()
    failures = []
    cmp = comparer(failures, detail=False)

    cmp("loss", out.loss, out_d.loss)
    cmp("logits", out.logits, ref_logits)
    dparams = dense_params if dense_params is not None else dict(dense.named_parameters(remove_duplicate=False))
    sparams = dict(sharded.named_parameters(remove_duplicate=False))
    for pp in plan.params:
        got = sparams[pp.name]
        if pp.trainable != dparams[pp.name].requires_grad:
            failures.append(f"{pp.name}: plan trainable={pp.trainable}")
        if got.requires_grad != pp.trainable:
            failures.append(f"{pp.name}: local slice requires_grad={got.requires_grad}")
        if not pp.trainable:
            if got.grad is not None:
                failures.append(f"{pp.name}: frozen, has a gradient")
            if pp.grad_sync:
                failures.append(f"{pp.name}: frozen, grad sync over {pp.grad_sync}")
            continue
        if got.grad is None:
            failures.append(f"grad {pp.name}: missing")
            continue
        cmp(f"grad {pp.name}", got.grad, pp.spec.local(pp.pad(dparams[pp.name].grad), plan.mesh, rank))
    res = {"failures": failures, "loss": out.loss.item(),
           "ledger": {"fwd": (fwd.count(), fwd.bytes_per_rank()), "bwd": (bwd.count(), bwd.bytes_per_rank())},
           "plan": {ph: (len(plan.comms(ph)), plan.comm_bytes_per_rank(ph)) for ph in ("fwd", "bwd")}}
    return res, sharded, inputs


def train_trainable(sharded, dense, inputs, steps: int, lr: float = 1e-3) -> dict:
    """``steps`` AdamW steps over each model's trainable parameters: the losses, the
    frozen slices that moved (none should), and the sharded optimizer's state bytes."""
    before = {n: p.detach().clone() for n, p in sharded.named_parameters() if not p.requires_grad}
    out = {}
    for key, m in (("losses", sharded), ("dense_losses", dense)):
        opt = torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=lr)
        out[key] = []
        for _ in range(steps):
            opt.zero_grad()
            loss = m(**inputs).loss
            loss.backward()
            opt.step()
            out[key].append(loss.item())
        if m is sharded:
            out["adam_bytes"] = sum(t.numel() * t.element_size() for s in opt.state.values()
                                    for t in s.values() if isinstance(t, torch.Tensor) and t.dim() > 0)
    out["frozen_moved"] = [n for n, p in sharded.named_parameters() if n in before and not torch.equal(p, before[n])]
    return out


@contextlib.contextmanager
def torchrun_env(rank: int, world: int):
    """The environment torchrun gives a rank (``RANK``, ``WORLD_SIZE``, ``LOCAL_*``), for
    the block: ``Trainer`` then sees a multi-process job; restored after."""
    env = {"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": str(world)}
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
