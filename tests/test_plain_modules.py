"""Modules as people write them (issue 57): any ``nn.Module``, no ``.config``, inputs under
their own names, positional or by keyword, outputs a tensor, tuple, dict or
``ModelOutput``, the loss computed outside the module; non-tensor keyword arguments part
of the graph's key. Each cell compares outputs, the user's loss, every local gradient and
3 optimizer steps (losses and the stepped weights) with the dense module's within 1e-5
(tests/plain_models.py). The models: PyTorch's own tensor-parallel test Transformer
(``forward(tokens)``) and a timm-style ViT (``forward(x)``, fused ``qkv``)."""

from __future__ import annotations

import pytest
import torch

import plain_models
from dist_pool import get_pool

MODES = {"1d": (2, None), "2d": (4, None), "2.5d": (8, 2)}
CELLS = [("transformer", "1d", "dict", "keyword"), ("vit", "1d", "tensor", "positional"),
         pytest.param("transformer", "1d", "tensor", "keyword", marks=pytest.mark.extended),
         pytest.param("transformer", "2d", "dict", "keyword", marks=pytest.mark.extended),
         pytest.param("transformer", "1d", "tuple", "positional", marks=pytest.mark.extended),
         pytest.param("transformer", "1d", "model_output", "positional", marks=pytest.mark.extended),
         pytest.param("vit", "2d", "tensor", "keyword", marks=pytest.mark.extended),
         pytest.param("transformer", "2.5d", "tensor", "positional", marks=pytest.mark.extended),
         pytest.param("vit", "2.5d", "tensor", "positional", marks=pytest.mark.extended)]


def _id(p):
    v = p.values if hasattr(p, "values") else p
    return "-".join(v)


@pytest.mark.parametrize("name,mode,kind,call", CELLS, ids=[_id(c) for c in CELLS])
def test_plain_module_equals_dense(name, mode, kind, call):
    world, depth = MODES[mode]
    res = get_pool(world, timeout=600).run(plain_models.check, name, mode, depth, kind=kind, call=call)
    for rank, r in enumerate(res):
        assert r["failures"] == [], f"rank {rank}: {r['failures']}"
        # the ViT's fused qkv reshaped to (3, heads, head_dim) and unbound is split per block
        # in every mode (no gather at the reshape), the transformer's separate q/k/v are split
        assert r["fallbacks"] == [], r["fallbacks"]
    if kind != "tensor":        # each value of scale is a graph of its own (the later ones from the skeleton)
        assert [s.split(", ")[-1] for s in res[0]["signatures"]][-2:] == ["scale=0.5", "scale=2.0"], \
            res[0]["signatures"]
    face = res[0]["face"]
    assert face["checkpointing"] and face["remat_blocks"] == 2, face     # gradient_checkpointing_enable: 2 blocks
    assert face["tags"] == ["client"] and face["base"], face
    assert face["embedding"] is True if name == "transformer" else "no token embedding" in face["embedding"], face
    # split, not replicated: the attention and MLP weights of every block
    assert any(n.endswith("w1.weight") or n.endswith("fc1.weight") for n in res[0]["split"]), res[0]["split"]
    assert name != "vit" or {"blocks.0.attn.qkv.weight", "blocks.1.attn.qkv.weight"} <= set(res[0]["split"])


def test_no_config_and_no_example_inputs_is_refused_naming_the_inputs():
    from autoshard.api import validate

    _, problems = validate(plain_models.transformer(), mode="1d", world_size=2)
    assert [p.what for p in problems] == ["example_inputs"], problems
    assert "a tuple (tokens,) or a dict {'tokens': ...}" in problems[0].message, problems[0].message


def test_positional_calls_bind_to_forward_names():
    from autoshard import ConfigError
    from autoshard.hf_face import bind_call, forward_names

    names = forward_names(plain_models.Outputs(plain_models.transformer(), "tuple"))
    assert names == ("tokens", "scale")
    t = torch.zeros(2, 3)
    assert bind_call(names, (t, 2.0), {})["scale"] == 2.0
    with pytest.raises(ConfigError, match="takes 2 positional argument"):
        bind_call(names, (t, 2.0, 3), {})
    with pytest.raises(ConfigError, match="'tokens' both positionally and by keyword"):
        bind_call(names, (t,), {"tokens": t})


def test_main_input_of_a_plain_call():
    from autoshard.ir.signature import batch_of, main_input, seq_input

    tokens = torch.zeros(4, 8, dtype=torch.long)
    assert main_input({"tokens": tokens}) == seq_input({"tokens": tokens}) == "tokens"
    images = {"target": torch.zeros(4, dtype=torch.long), "x": torch.zeros(4, 3, 8, 8)}
    assert main_input(images) == "x" and seq_input(images) is None and batch_of(images) == 4


class _Flags(torch.nn.Module):
    """Takes its flags through ``**kwargs``, as transformers models take ``return_dict``
    and ``output_attentions`` (BERT under sentence-transformers)."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, x, **kwargs):
        y = self.lin(x)
        return {"y": y * 2 if kwargs.get("double") else y} if kwargs.get("return_dict") else (y,)


def test_keyword_flags_through_kwargs_are_bound_not_inputs():
    """Flags a forward takes through ``**kwargs`` are constants of the graph (its key), not
    its inputs (torch.export's dynamic-shapes matching fails on them): the graph answers
    a call with the same flags and no other (another signature, another graph)."""
    from autoshard.ir.signature import InputSignature, SignatureGraph
    from autoshard.passes.capture import capture

    torch.manual_seed(0)
    m = _Flags()
    ex = {"x": torch.randn(2, 5, 8), "return_dict": True, "double": True}
    cap = capture(m, example_inputs=ex)
    assert cap.input_names == ("x",) and cap.constants == {"return_dict": True, "double": True}
    g = SignatureGraph(cap.module, None, cap.input_names, dict(cap.constants), InputSignature.of(cap.example_inputs),
                       frozenset({"x"}), None)
    x = torch.randn(3, 5, 8)
    full = g.accepts({"x": x, "return_dict": True, "double": True})
    assert full is not None and set(full) == {"x"}
    torch.testing.assert_close(cap.module(**full)["y"], m(x, return_dict=True, double=True)["y"])
    assert g.accepts({"x": x, "return_dict": True, "double": False}) is None
    assert g.accepts({"x": x, "return_dict": True}) is None


class _LooseTensors(torch.nn.Module):
    """Takes a tensor only through ``**kwargs``: one it reads (a bias per token) and one it
    ignores (sentence-transformers hands DistilBERT ``token_type_ids`` so)."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, x, **kwargs):
        return self.lin(x) + kwargs["bias"].unsqueeze(-1)


def test_tensors_through_kwargs_are_inputs_with_dynamic_dims():
    """torch.export cannot match dynamic shapes to a tensor inside ``**kwargs``: capture gives
    each such tensor a parameter of its own, and the graph answers another batch size as
    the module does."""
    from autoshard.passes.capture import capture

    torch.manual_seed(0)
    m = _LooseTensors()
    ex = {"x": torch.randn(2, 5, 8), "bias": torch.randn(2, 5), "token_type_ids": torch.zeros(2, 5, dtype=torch.long),
          "return_dict": True}
    cap = capture(m, example_inputs=ex)
    assert cap.input_names == ("x", "bias", "token_type_ids") and cap.constants == {"return_dict": True}
    x, bias = torch.randn(3, 5, 8), torch.randn(3, 5)
    torch.testing.assert_close(cap.module(x=x, bias=bias, token_type_ids=torch.zeros(3, 5, dtype=torch.long)),
                               m(x, bias=bias))


class _Branches(torch.nn.Module):
    """The constructs the issue met in models torch.export cannot capture: wav2vec2's
    ``if labels.max() >= vocab_size``, DETR's ``isfinite(...).all()``, Qwen2-VL's
    ``lengths.tolist()``."""

    def __init__(self, kind: str):
        super().__init__()
        self.kind, self.lin = kind, torch.nn.Linear(8, 8)

    def forward(self, x, labels=None):
        y = self.lin(x)
        if self.kind == "labels":
            if labels.max() >= 8:
                raise ValueError("labels out of range")
        elif self.kind == "computed":
            if not torch.isfinite(y).all():
                raise ValueError("not finite")
        else:
            n = int(labels.sum().item())
            y = y[:, :n]
        return y


@pytest.mark.parametrize("kind,construct,fix", [
    ("labels", "branches on a tensor's values", "the line reads input labels: call the model without it (compute "
                                                "the loss outside the model from its logits)"),
    ("computed", "branches on a tensor's values", "the branch depends on values computed in the model"),
    ("tolist", "reads a tensor's values as Python numbers", "the line reads input labels")])
def test_an_uncapturable_model_is_named_by_its_line(kind, construct, fix):
    """The CaptureError names the model's file and line, the construct and what would make
    it capturable, not torch's internals."""
    import inspect

    from autoshard.ir.errors import CaptureError
    from autoshard.passes.capture import capture

    with pytest.raises(CaptureError) as e:
        capture(_Branches(kind), example_inputs={"x": torch.randn(2, 5, 8), "labels": torch.randint(0, 4, (2, 5))})
    first = str(e.value).splitlines()[0]
    src, start = inspect.getsourcelines(_Branches.forward)
    line = start + next(i for i, ln in enumerate(src) if {"labels": "labels.max()", "computed": "isfinite",
                                                          "tolist": ".item()"}[kind] in ln)
    assert f"{__file__}:{line} (`" in first, first
    assert construct in first and fix in first, first
