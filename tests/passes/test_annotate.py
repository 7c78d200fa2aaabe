"""annotate: node kinds against the modules the model actually runs.

Expected counts come from the model itself: forward hooks record which modules a
real forward pass calls (and how often), so unused modules (e.g. a pooler) and
tied weights (one lm_head call, one embedding call) are counted as they run.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch
import transformers
from torch import nn
from transformers.pytorch_utils import Conv1D

import models
import tiny_plans as tp
from autoshard.passes.annotate import annotate

NAMES = ["gpt2", "llama", "bert"]


def _kind_of_module(mod: nn.Module) -> str | None:
    if isinstance(mod, (nn.Linear, Conv1D)):
        return "linear"
    if isinstance(mod, nn.LayerNorm) or type(mod).__name__.endswith("RMSNorm"):
        return "norm"
    if isinstance(mod, nn.Embedding):
        return "embedding"
    return None


def _called_modules(model) -> dict[str, list[str]]:
    """kind -> module names, once per call, from a real forward pass."""
    calls: dict[str, list[str]] = {"linear": [], "norm": [], "embedding": []}
    hooks = []
    for name, mod in model.named_modules():
        kind = _kind_of_module(mod)
        if kind:
            hooks.append(mod.register_forward_hook(lambda m, i, o, name=name, kind=kind: calls[kind].append(name)))
    try:
        with torch.no_grad():
            model(**models.batch(_name_of(model)))
    finally:
        for h in hooks:
            h.remove()
    return calls


def _name_of(model) -> str:
    return {"GPT2LMHeadModel": "gpt2", "LlamaForCausalLM": "llama", "BertForMaskedLM": "bert"}[type(model).__name__]


def _layers(model) -> tuple[str, int]:
    """The ModuleList that holds the decoder / encoder layers: (its name, its length)."""
    n = model.config.num_hidden_layers
    lists = [(name, len(m)) for name, m in model.named_modules() if isinstance(m, nn.ModuleList) and len(m) == n]
    assert len(lists) == 1, lists
    return lists[0]


@pytest.fixture(scope="module")
def setup():
    out = {}
    for name in NAMES:
        model = models.build(name)
        ann = annotate(tp.cached_capture(model).module)
        out[name] = (model, ann, _called_modules(model))
    return out


def _by_kind(ann, kind):
    return [a for a in ann.values() if a.kind == kind]


@pytest.mark.parametrize("kind", ["linear", "norm", "embedding"])
@pytest.mark.parametrize("name", NAMES)
def test_counts_match_called_modules(setup, name, kind):
    model, ann, calls = setup[name]
    got = Counter(a.module for a in _by_kind(ann, kind))
    want = Counter(calls[kind])
    assert want, f"{name} runs no {kind} module?"
    assert got == want


@pytest.mark.parametrize("name", NAMES)
def test_linear_count_against_module_census(setup, name):
    """Every nn.Linear / Conv1D of these models runs once per forward, the tied
    LM head included (counted once, as a Linear; its table use is an embedding)."""
    model, ann, _ = setup[name]
    census = sum(isinstance(m, (nn.Linear, Conv1D)) for m in model.modules())
    assert len(_by_kind(ann, "linear")) == census
    tied = model.config.tie_word_embeddings
    emb = model.get_input_embeddings().weight
    head = model.get_output_embeddings().weight
    assert (emb is head) == bool(tied)


@pytest.mark.parametrize("kind", ["linear", "embedding", "norm"])
@pytest.mark.parametrize("name", NAMES)
def test_weights_are_the_modules_parameters(setup, name, kind):
    """The annotated weight is the node's parameter operand: the same tensor as the
    module's weight (possibly under a tied alias)."""
    model, ann, _ = setup[name]
    params = dict(model.named_parameters(remove_duplicate=False))
    mods = dict(model.named_modules())
    for a in _by_kind(ann, kind):
        if a.weight is None:
            # the inline RMSNorm pattern is counted at its mean, before the weight
            assert kind == "norm" and type(mods[a.module]).__name__.endswith("RMSNorm")
            continue
        assert params[a.weight] is mods[a.module].weight


@pytest.mark.parametrize("name", NAMES)
def test_one_attention_per_layer(setup, name):
    model, ann, _ = setup[name]
    layers, n = _layers(model)
    att = _by_kind(ann, "attention")
    assert len(att) == n == model.config.num_hidden_layers
    idx = sorted(int(a.module[len(layers) + 1:].split(".")[0]) for a in att)
    assert idx == list(range(n))
    assert all(a.module.startswith(layers + ".") for a in att)


@pytest.mark.parametrize("name", NAMES)
def test_one_loss(setup, name):
    _, ann, _ = setup[name]
    assert len(_by_kind(ann, "loss")) == 1


@pytest.mark.parametrize("name", NAMES)
def test_every_node_annotated(setup, name):
    model, ann, _ = setup[name]
    gm = tp.cached_capture(model).module
    assert set(ann) == {n.name for n in gm.graph.nodes}
    kinds = {"linear", "norm", "attention", "embedding", "loss", "pointwise", "view", "reduction", "other"}
    assert {a.kind for a in ann.values()} <= kinds


def test_eager_attention_pattern():
    """With eager attention (no SDPA op) the softmax(Q·Kᵀ)·V pattern is found, once per layer."""
    cls, cfg_cls, kw = models.TINY["llama"]
    cfg = getattr(transformers, cfg_cls)(**{**kw, "num_hidden_layers": 1})
    cfg._attn_implementation = "eager"
    with torch.device("meta"):
        model = getattr(transformers, cls)(cfg)
    model.train()
    gm = tp.cached_capture(model).module
    assert not any(n.target == torch.ops.aten.scaled_dot_product_attention.default for n in gm.graph.nodes)
    ann = annotate(gm)
    att = _by_kind(ann, "attention")
    assert [a.module for a in att] == ["model.layers.0.self_attn"]
    softmax = {torch.ops.aten.softmax.int, torch.ops.aten._softmax.default}
    assert all(n.target in softmax for n in gm.graph.nodes if n.name in {k for k, a in ann.items() if a.kind == "attention"})
    # the other kinds are unaffected by the attention implementation
    assert len(_by_kind(ann, "linear")) == sum(isinstance(m, nn.Linear) for m in model.modules())
    assert len(_by_kind(ann, "norm")) == sum(type(m).__name__.endswith("RMSNorm") for m in model.modules())
