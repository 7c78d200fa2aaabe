"""Layer stamping (autoshard.passes.stamp): a graph exported with three layers per stack
and stamped to the model's depth is the graph a full export gives, and plans alike.

The comparison is node by node (op, target, inputs by position, module path and the
value's shape) and plan by plan (fingerprint, and every node's op, module, specs,
kernel, collectives and local shape); node *names* are not compared: export numbers
them with gaps left by nodes it erased while tracing, which no copy can predict.
"""

from __future__ import annotations

import json
import re

import pytest
import torch
import transformers
from torch import fx

from arch_models import ARCHS
from autoshard.io.builder import model_from
from autoshard.launch.capture_share import capture_cached
from autoshard.passes.annotate import module_path
from autoshard.passes.pipeline import plan_captured
from autoshard.passes.stamp import KEEP, capture_stamped, shrink_config, stamp
from autoshard.policies import make_policy

DEPTH = KEEP + 2        # two stamped layers: the second reads the first copy, not the template
DEPTHS = {"t5": KEEP + 1, "bart": KEEP + 1}   # one stamped layer per stack: T5's full export costs 40 s at depth 5 under load

_LAYER_KEYS = {"gpt2": "n_layer", "t5": "num_layers", "gptneo": "num_layers"}


def _config(arch: str, depth: int = DEPTH):
    cls, cfg_cls, kw, _ = ARCHS[arch]
    kw = dict(kw, **{_LAYER_KEYS.get(arch, "num_hidden_layers"): depth}, architectures=[cls])
    if arch == "t5":
        kw["num_decoder_layers"] = depth
    if arch == "bart":          # the decoder's cross-attention reads the encoder's last layer itself
        kw.pop("num_hidden_layers", None)
        kw.update(encoder_layers=depth, decoder_layers=depth)
    if arch == "gptneo":
        kw["attention_types"] = [[["global", "local"], depth // 2]] if depth % 2 == 0 else [[["global"], depth]]
    return getattr(transformers, cfg_cls)(**kw)


def _build(config):
    """The model of ``config`` on meta in train mode: the full model, and stamping's shallow one."""
    return model_from(config).train()


def _signature(gm: fx.GraphModule) -> list:
    idx: dict = {}
    out = []
    for i, n in enumerate(gm.graph.nodes):
        idx[n] = i
        target = "submodule" if n.op == "get_attr" and n.name.startswith("submod") else str(n.target)
        out.append((n.op, target, repr(fx.map_arg((n.args, n.kwargs), lambda x: idx[x])), module_path(n),
                    str(n.meta.get("val"))))
    return out


def _plan_rows(p) -> list:
    """Every node's decisions, with node names replaced by their position."""
    d = json.loads(p.to_json())
    names = {n["name"]: f"#{i}" for i, n in enumerate(d["nodes"])}
    pat = re.compile(r"(?<![\w])(" + "|".join(sorted(map(re.escape, names), key=len, reverse=True)) + r")(?![\w])")
    rows = []
    for n in d["nodes"]:
        row = {}
        for k, v in n.items():
            if k == "name":
                continue
            text = json.dumps(v, sort_keys=True)
            if k not in ("op", "kind", "module", "weight"):       # fields that may name other nodes
                text = pat.sub(lambda m: names[m.group(1)], text)
            row[k] = text
        rows.append(json.dumps(row, sort_keys=True))
    return rows


_CASES = {}


def _captures(arch: str):
    if arch not in _CASES:
        full = _build(_config(arch, DEPTHS.get(arch, DEPTH)))
        _CASES[arch] = (capture_cached(full), capture_stamped(full, build=_build, capture_fn=capture_cached))
    return _CASES[arch]


# llama's (23 s) is slow: gpt2's runs in `make test`, and llama's layers are stamped by every 1d cell
@pytest.mark.parametrize("arch", ["gpt2", pytest.param("llama", marks=pytest.mark.slow),
                                  pytest.param("bert", marks=pytest.mark.slow),
                                  pytest.param("t5", marks=pytest.mark.slow),
                                  pytest.param("bart", marks=pytest.mark.slow)])
def test_stamped_graph_is_the_full_export(arch):
    full, stamped = _captures(arch)
    assert stamped.stamped, "stamping did not happen: the full model was exported"
    a, b = _signature(full.module), _signature(stamped.module)
    assert len(a) == len(b)
    diff = [(i, x, y) for i, (x, y) in enumerate(zip(a, b)) if x != y]
    assert not diff, diff[:3]
    last = DEPTHS.get(arch, DEPTH) - 1
    n_layer = sum(1 for x in b if x[0] == "call_function" and f".{last}." in x[3] + ".")
    assert n_layer > 10, "the last stamped layer has no nodes"


@pytest.mark.parametrize("arch", ["gpt2", "llama", pytest.param("bert", marks=pytest.mark.slow),
                                  pytest.param("t5", marks=pytest.mark.slow),
                                  pytest.param("bart", marks=pytest.mark.slow)])
@pytest.mark.parametrize("mode", ["1d", "2d"])
def test_stamped_plan_equals_full_plan(arch, mode):
    full, stamped = _captures(arch)
    pol = make_policy(mode, 4, None, 1)
    pa = plan_captured(full, pol, batch_size=4, seq_len=16)
    pb = plan_captured(stamped, pol, batch_size=4, seq_len=16)
    assert pa.fingerprint() == pb.fingerprint()
    assert pa.summary() == pb.summary()
    ra, rb = _plan_rows(pa), _plan_rows(pb)
    assert len(ra) == len(rb)
    diff = [i for i, (x, y) in enumerate(zip(ra, rb)) if x != y]
    assert not diff, (ra[diff[0]][:400], rb[diff[0]][:400])


def test_plan_uses_stamping_and_keeps_the_depth():
    """autoshard.plan on a config plans every layer (parameters of the last one
    included) from a shallow export."""
    import autoshard

    cfg = _config("llama", depth=6)
    p = autoshard.plan(cfg, world_size=2, mode="1d", batch_size=2, seq_len=8)
    names = {q.name for q in p.params}
    assert "model.layers.5.mlp.down_proj.weight" in names
    assert p.param("model.layers.5.mlp.down_proj.weight").spec == p.param("model.layers.1.mlp.down_proj.weight").spec


def test_non_uniform_layers_are_exported_whole():
    """GPT-Neo alternates global and local attention: its per-layer list is not uniform,
    so nothing is stamped (the full export is used)."""
    full = _build(_config("gptneo", depth=4))
    assert shrink_config(full.config, full) is None
    cap = capture_stamped(full, build=_build, capture_fn=capture_cached)
    assert not cap.stamped
    assert any("h.3." in module_path(n) + "." for n in cap.module.graph.nodes)


def test_layers_that_differ_are_refused():
    """A shallow capture whose last two layers differ is refused, not stamped."""
    from autoshard.passes import stamp as stamp_mod

    full = _build(_config("llama"))
    small_cfg, lists = shrink_config(full.config, full)
    cap = capture_cached(_build(small_cfg))
    for n in cap.module.graph.nodes:     # plant a difference: layer 2's SiLU becomes a GELU
        if n.target == torch.ops.aten.silu.default and f"layers.{KEEP - 1}." in module_path(n):
            n.target = torch.ops.aten.gelu.default
            break
    else:
        pytest.fail("no SiLU in the last captured layer")
    with pytest.raises(stamp_mod.StampRefused, match="silu|gelu"):
        stamp(cap, lists)
