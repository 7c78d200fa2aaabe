"""Models led by other inputs than token ids (tests/test_modality.py): tiny configs of
vision, speech and image-text architectures, their own inputs, and the sharded-vs-dense
check run on every rank of a pool."""

from __future__ import annotations

import copy

import torch

# name -> (model class, config class, config kwargs); tiny: hidden 32-64, 2 layers
FAMILIES = {
    "vit": ("ViTForImageClassification", "ViTConfig",
            dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
                 image_size=16, patch_size=4, num_labels=10, hidden_dropout_prob=0.0,
                 attention_probs_dropout_prob=0.0)),
    "whisper": ("WhisperForConditionalGeneration", "WhisperConfig",
                dict(vocab_size=96, num_mel_bins=8, encoder_layers=2, decoder_layers=2, d_model=64,
                     encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=128, decoder_ffn_dim=128,
                     max_source_positions=16, max_target_positions=32, pad_token_id=0, bos_token_id=1,
                     eos_token_id=2, decoder_start_token_id=1, dropout=0.0, suppress_tokens=None,
                     begin_suppress_tokens=None)),
    "clip": ("CLIPModel", "CLIPConfig",
             dict(text_config=dict(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, max_position_embeddings=32, bos_token_id=0,
                                   eos_token_id=2, pad_token_id=1),
                  vision_config=dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                     num_attention_heads=4, image_size=16, patch_size=4),
                  projection_dim=32)),
    "llava": ("LlavaForConditionalGeneration", "LlavaConfig",
              dict(vision_config=dict(model_type="clip_vision_model", hidden_size=64, intermediate_size=128,
                                      num_hidden_layers=2, num_attention_heads=4, image_size=16, patch_size=4),
                   text_config=dict(model_type="llama", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2, vocab_size=128,
                                    max_position_embeddings=64),
                   image_token_index=127, image_seq_length=16, vision_feature_layer=-2)),
    "gemma3mm": ("Gemma3ForConditionalGeneration", "Gemma3Config",
                 dict(vision_config=dict(model_type="siglip_vision_model", hidden_size=64, intermediate_size=128,
                                         num_hidden_layers=2, num_attention_heads=4, image_size=16, patch_size=4),
                      text_config=dict(model_type="gemma3_text", hidden_size=64, intermediate_size=128,
                                       num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                       head_dim=16, vocab_size=128, max_position_embeddings=64, sliding_window=4),
                      mm_tokens_per_image=4, image_token_index=127, boi_token_index=125, eoi_token_index=126)),
    "idefics3": ("Idefics3ForConditionalGeneration", "Idefics3Config",
                 dict(vision_config=dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                         num_attention_heads=4, image_size=16, patch_size=4),
                      text_config=dict(model_type="llama", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=2, vocab_size=128,
                                       max_position_embeddings=64),
                      image_token_id=127, scale_factor=2)),
}


# what each family brings that a text model does not (docs/support.md's modality table)
PATTERNS = {
    "vit": "pixel_values, conv patch embedding, CLS token, classifier head ([batch] labels)",
    "whisper": "log-mel input_features, conv1d front end, encoder-decoder, frozen sinusoidal positions",
    "clip": "image-text dual encoder, contrastive loss over every image × text pair (a static batch)",
    "gemma3mm": "vision-language: SigLIP tower, average-pooled to mm_tokens_per_image features, "
                "bidirectional attention over each image's tokens inside a causal Gemma-3 (sliding and global layers)",
    "idefics3": "vision-language: images as [batch, images, 3, H, W], a pixel-shuffle connector "
                "(scale_factor² patches folded into one feature) before a Llama",
    "llava": "vision-language: CLIP vision tower, projector, image features scattered into a Llama's token "
             "sequence (a static batch: the features are listed per image)",
}
# the cells a mode refuses (a static batch is kept whole on every rank, so none for that)
REFUSED: set = set()
# cells that plan with a node run whole on gathered inputs (exact): Idefics3's pixel shuffle
# folds a split hidden dim into patches; the q and kv projections of Gemma-3's SigLIP
# pooling head (nn.MultiheadAttention: its in_proj weight split by slicing)
WITH_FALLBACKS: set = {(n, m) for n in ("idefics3", "gemma3mm") for m in ("2d", "2.5d", "3d")}


def build_meta(name: str):
    import transformers

    cls, cfg_cls, kw = FAMILIES[name]
    with torch.device("meta"):
        return getattr(transformers, cls)(getattr(transformers, cfg_cls)(**kw)).train()


def build(name: str, seed: int = 0):
    import transformers

    cls, cfg_cls, kw = FAMILIES[name]
    torch.manual_seed(seed)
    cfg = getattr(transformers, cfg_cls)(**kw)
    model = getattr(transformers, cls)(cfg).train()
    with torch.no_grad():
        # Gemma-3 starts its image projection at zero, which makes the image tokens' norm
        # divide a zero vector (gradients of 1e9 in fp32); a trained checkpoint's is not zero
        for p in model.parameters():
            if p.dim() == 2 and not p.any():
                p.normal_(0.0, 0.02)
    return model


# a model whose inputs its config cannot describe (Idefics3's images per sample) is given a
# batch of 2; one whose batch cannot be padded to the batch split (Gemma-3 counts its image
# tokens over the whole batch) a batch that fills it: the size of that batch per (name, mode)
OWN_INPUTS = {("idefics3", m): 2 for m in ("1d", "2d", "2.5d", "3d")} | {("gemma3mm", "2.5d"): 4}


def inputs(name: str, model, b: int = 4, seed: int = 1) -> dict:
    """The batch a user would bring: the model's own kind of inputs, ``b`` samples."""
    from autoshard.passes.capture import default_example_inputs

    torch.manual_seed(seed)
    if name == "idefics3":          # its processor's layout: images per sample, (16/4)² / 2² = 4 tokens each
        ids = torch.randint(0, 120, (b, 8))
        ids = torch.cat([torch.full((b, 4), 127), ids], 1)
        labels = ids.clone()
        labels[:, :4] = -100
        return dict(input_ids=ids, attention_mask=torch.ones_like(ids), labels=labels,
                    pixel_values=torch.randn(b, 1, 3, 16, 16))
    return default_example_inputs(model, batch_size=b, seq_len=8)


def check(rank: int, world: int, name: str, mode: str, depth=None) -> dict:
    """``shard(model)`` with no example inputs, then the model's own batch: loss, logits
    and every local gradient against the dense model's (atol = rtol = 1e-5)."""
    import autoshard
    import models
    from autoshard.runtime.collectives import CommLedger

    torch.set_num_threads(1)
    dense = build(name)
    model = copy.deepcopy(dense)
    b = OWN_INPUTS.get((name, mode))
    example = inputs(name, dense, b=b) if b else None
    sharded = autoshard.shard(model, mode=mode, depth=depth, example_inputs=example)
    batch = inputs(name, dense, b=sharded.plan.batch_size)     # the batch the plan counts bytes for
    out_d = dense(**batch)
    out_d.loss.backward()
    with CommLedger() as led:
        out = sharded(**batch)
        out.loss.backward()
    plan = sharded.plan
    failures = []
    worst = {"out": 0.0, "grad": 0.0}
    strict = models.comparer(failures)

    def cmp(what, got, ref):             # within 1e-5, and the worst difference kept for the report
        key = "grad" if what.startswith("grad") else "out"
        if got.shape == ref.shape and got.numel():
            worst[key] = max(worst[key], (got.double() - ref.double()).abs().max().item())
        strict(what, got, ref)

    for k, ref in out_d.items():        # the loss, the logits, and every other tensor the model returns
        if isinstance(ref, torch.Tensor):
            cmp(k, out[k], ref)
    dparams = dict(dense.named_parameters(remove_duplicate=False))
    sparams = dict(sharded.named_parameters(remove_duplicate=False))
    for pp in plan.params:
        got = sparams[pp.name].grad
        if not pp.trainable:            # frozen in the model (Whisper's sinusoidal encoder positions)
            if got is not None or dparams[pp.name].requires_grad:
                failures.append(f"{pp.name}: frozen in the plan, a gradient here or trainable in the model")
            continue
        if dparams[pp.name].grad is None:     # no output depends on it (LLaVA's unread last vision layer)
            if got is not None:
                failures.append(f"grad {pp.name}: dense has none")
            continue
        if got is None:
            failures.append(f"grad {pp.name}: missing")
            continue
        cmp(f"grad {pp.name}", got, pp.spec.local(pp.pad(dparams[pp.name].grad), plan.mesh, rank))
    return {"failures": failures, "fallbacks": [n.name for n in plan.fallbacks], "worst": worst,
            "ledger": (led.count(), led.bytes_per_rank()), "plan": (len(plan.comms()), plan.comm_bytes_per_rank()),
            "param_bytes": sum(p.numel() * p.element_size() for p in sharded.parameters()),
            "plan_param_bytes": plan.param_bytes_per_rank,
            "dense_param_bytes": sum(p.numel() * p.element_size() for p in dense.parameters())}


def static_seq_llama():
    """A tiny Llama whose forward reads the sequence length as a Python int (``len`` of a
    row, as Mamba's scan loop does): export makes the sequence static, one graph per length."""
    import transformers

    class StaticSeqLlama(transformers.LlamaForCausalLM):
        def forward(self, input_ids=None, attention_mask=None, labels=None, use_cache=None, **kw):
            n = len(input_ids[0])                  # a Python int: export specialises the sequence
            return super().forward(input_ids=input_ids[:, :n], attention_mask=attention_mask, labels=labels,
                                   use_cache=use_cache, **kw)

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=128, max_position_embeddings=64)
    return StaticSeqLlama(cfg).train()


def check_static_seq(rank: int, world: int) -> dict:
    """``shard()`` a model whose graph has a static sequence, call it at two lengths: each
    length gets its graph, both equal dense."""
    import autoshard

    torch.set_num_threads(1)
    dense = static_seq_llama()
    sharded = autoshard.shard(copy.deepcopy(dense), mode="1d")
    out = {}
    for s in (8, 6, 8):
        g = torch.Generator().manual_seed(s)
        ids = torch.randint(0, 128, (2, s), generator=g)
        got, ref = sharded(input_ids=ids, labels=ids), dense(input_ids=ids, labels=ids)
        out[s] = ((got.logits - ref.logits).abs().max().item(), (got.loss - ref.loss).abs().item())
    out["signatures"] = [g.signature.describe() for g in sharded._graphs]
    return out


def generate_whisper(rank: int, world: int, mode: str) -> dict:
    """``sharded.generate(input_features=...)`` of a Whisper sharded with no example inputs,
    against transformers' ``GenerationMixin.generate`` of the dense model (greedy, 8 new
    tokens, the step scores returned): tokens and the worst score difference."""
    import autoshard
    from transformers import GenerationMixin

    torch.set_num_threads(1)
    dense = build("whisper").eval()
    sharded = autoshard.shard(copy.deepcopy(dense), mode=mode)
    features = inputs("whisper", dense, b=3, seed=5)["input_features"]     # the same batch on every rank
    kw = dict(max_new_tokens=8, do_sample=False, output_scores=True, return_dict_in_generate=True)
    ref = GenerationMixin.generate(dense, input_features=features, **kw)
    got = sharded.generate(input_features=features, **kw)
    return {"tokens": got.sequences.tolist(), "ref_tokens": ref.sequences.tolist(),
            "scores": max((a - b).abs().max().item() for a, b in zip(ref.scores, got.scores)),
            "steps": len(got.scores), "captures": sharded._generator.captures}


if __name__ == "__main__":          # python tests/modality.py: every family in every mode, the figures
    from rich.console import Console
    from rich.table import Table

    from dist_pool import get_pool

    modes = {"1d": (2, None), "2d": (4, None), "2.5d": (8, 2), "3d": (8, None)}
    t = Table(title="shard(model) with no example inputs vs the dense model (worst over ranks)", header_style="bold")
    for c in ("model", "mode", "exact (1e-5)", "max |Δ| outputs", "max |Δ| grads", "bytes/rank ÷ dense",
              "collectives", "ledger = plan"):
        t.add_column(c, justify="right")
    for name in FAMILIES:
        for mode, (world, depth) in modes.items():
            res = get_pool(world, timeout=900).run(check, name, mode, depth)
            t.add_row(name, f"{mode}@{world}", "yes" if not any(r["failures"] for r in res) else "NO",
                      f"{max(r['worst']['out'] for r in res):.1e}", f"{max(r['worst']['grad'] for r in res):.1e}",
                      f"{max(r['param_bytes'] for r in res) / res[0]['dense_param_bytes']:.3f}",
                      str(res[0]["ledger"][0]), "yes" if all(r["ledger"] == r["plan"] for r in res) else "NO")
    Console(width=160).print(t)


def whisper_labels_as_long_as_mel_bins(rank: int, world: int, mode: str = "1d") -> dict:
    """Whisper fine-tuned as people do (``input_features`` and ``labels``), its label
    length equal to its mel bins (16): the call's signature keeps the mel bins static
    (never the sequence), so the graph captured for it takes 16 channels. Loss, logits and
    every local gradient against dense."""
    import autoshard
    import transformers

    torch.set_num_threads(1)
    cls, cfg_cls, kw = FAMILIES["whisper"]
    torch.manual_seed(0)
    dense = getattr(transformers, cls)(getattr(transformers, cfg_cls)(**{**kw, "num_mel_bins": 16})).train()
    sharded = autoshard.shard(copy.deepcopy(dense), mode=mode)
    g = torch.Generator().manual_seed(3)
    batch = {"input_features": torch.randn(4, 16, 32, generator=g), "labels": torch.randint(3, 96, (4, 16), generator=g)}
    out, ref = sharded(**batch), dense(**batch)
    out.loss.backward()
    ref.loss.backward()
    failures = []
    for what, a, b in (("loss", out.loss, ref.loss), ("logits", out.logits, ref.logits)):
        if not torch.allclose(a, b, atol=1e-5, rtol=1e-5):
            failures.append(f"{what}: {(a - b).abs().max().item()}")
    params = dict(dense.named_parameters(remove_duplicate=False))     # tied proj_out too
    for pp in sharded.plan.params:
        got = sharded.get_parameter(pp.name).grad
        if params[pp.name].grad is None:        # frozen (the encoder's sinusoidal positions)
            if got is not None:
                failures.append(f"grad {pp.name}: frozen, has a gradient")
            continue
        want = pp.spec.local(params[pp.name].grad, sharded.mesh, rank)
        if got is None or not torch.allclose(got, want, atol=1e-5, rtol=1e-5):
            failures.append(f"grad {pp.name}")
    return {"failures": failures, "signatures": sharded.signatures}
