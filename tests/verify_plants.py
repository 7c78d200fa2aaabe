"""Planted planner bugs for tests/test_verify.py, called on every rank through
``verify(setup="verify_plants:NAME")`` (tests/ on PYTHONPATH)."""


def partial_through_nonlinear():
    """The generic rule lets a partial sum pass through any op (rsqrt, pow, ...), as if every
    op were linear in it: shapes stay right, values go wrong at the first nonlinear op."""
    from autoshard.policies.ops import pointwise

    pointwise._partial_passes = lambda *args: True


def tiny_llama():
    """A model for ``verify("verify_plants:tiny_llama", ...)``: a function returning a model."""
    import torch
    import transformers

    torch.manual_seed(3)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=131, max_position_embeddings=64))


def llama_with_an_unused_parameter():
    """``tiny_llama`` holding a parameter its forward never reads (as DINOv2's ``mask_token``
    without ``bool_masked_pos``): neither side has a gradient for it."""
    import torch

    model = tiny_llama()
    model.model.mask_token = torch.nn.Parameter(torch.zeros(1, model.config.hidden_size))
    return model
