"""Model specs the command line and :func:`autoshard.verify` accept: a local Hugging Face
folder, a ``config.json``, or a known ``arch:size`` name (public shapes of well-known
checkpoints). Light: ``autoshard --help`` lists the names without importing torch.

    >>> resolve_model("llama:7b").hidden_size
    4096
"""

from __future__ import annotations

import os

from .ir.errors import ConfigError

__all__ = ["KNOWN_MODELS", "DEFAULT_SIZES", "resolve_model"]

# Public shapes of well-known checkpoints, dropout as shipped (the configs' defaults).
KNOWN_MODELS: dict[str, tuple[str, str, dict]] = {
    "llama:tiny": ("LlamaForCausalLM", "LlamaConfig", dict(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=4, vocab_size=128, max_position_embeddings=256)),
    "llama:7b": ("LlamaForCausalLM", "LlamaConfig", dict(
        hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=32, vocab_size=32000, max_position_embeddings=4096)),
    "llama:13b": ("LlamaForCausalLM", "LlamaConfig", dict(
        hidden_size=5120, intermediate_size=13824, num_hidden_layers=40, num_attention_heads=40,
        num_key_value_heads=40, vocab_size=32000, max_position_embeddings=4096)),
    "llama:70b": ("LlamaForCausalLM", "LlamaConfig", dict(
        hidden_size=8192, intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64,
        num_key_value_heads=8, vocab_size=32000, max_position_embeddings=4096)),
    "gpt2:small": ("GPT2LMHeadModel", "GPT2Config", dict(
        n_embd=768, n_layer=12, n_head=12, vocab_size=50257, n_positions=1024)),
    "gpt2:medium": ("GPT2LMHeadModel", "GPT2Config", dict(
        n_embd=1024, n_layer=24, n_head=16, vocab_size=50257, n_positions=1024)),
    "gpt2:large": ("GPT2LMHeadModel", "GPT2Config", dict(
        n_embd=1280, n_layer=36, n_head=20, vocab_size=50257, n_positions=1024)),
    "gpt2:xl": ("GPT2LMHeadModel", "GPT2Config", dict(
        n_embd=1600, n_layer=48, n_head=25, vocab_size=50257, n_positions=1024)),
    "bert:base": ("BertForMaskedLM", "BertConfig", dict(
        hidden_size=768, num_hidden_layers=12, num_attention_heads=12, intermediate_size=3072,
        vocab_size=30522, max_position_embeddings=512)),
    "bert:large": ("BertForMaskedLM", "BertConfig", dict(
        hidden_size=1024, num_hidden_layers=24, num_attention_heads=16, intermediate_size=4096,
        vocab_size=30522, max_position_embeddings=512)),
}

# A family name alone means its best-known size: `autoshard plan gpt2`.
DEFAULT_SIZES = {"gpt2": "gpt2:small", "bert": "bert:base", "llama": "llama:7b"}


def resolve_model(spec: str):
    """A config (or model) for a local folder, a config.json, or a known ``arch:size`` name."""
    import transformers

    if os.path.isdir(spec) or (os.path.isfile(spec) and spec.endswith(".json")):
        try:
            return transformers.AutoConfig.from_pretrained(spec)
        except Exception as e:   # transformers raises OSError / ValueError / KeyError
            raise ConfigError(f"cannot read a Hugging Face config from {spec!r}: {e}") from e
    key = spec.lower()
    key = DEFAULT_SIZES.get(key, key)
    if key in KNOWN_MODELS:
        arch, cfg_cls, kw = KNOWN_MODELS[key]
        return getattr(transformers, cfg_cls)(**kw, architectures=[arch])
    raise ConfigError(f"{spec!r} is neither a local folder, a config.json nor a known model; "
                      f"known: {', '.join(KNOWN_MODELS)} (or a family alone: {', '.join(DEFAULT_SIZES)})")
