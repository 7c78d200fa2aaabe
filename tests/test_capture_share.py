"""Capture once per job (autoshard/launch/capture_share.py): rank 0 exports, the others load
the program and bind their own weights; the result plans and runs as a capture of
their own would."""

from __future__ import annotations

import copy
import os

import pytest
import torch

import models
from dist_pool import get_pool


def _counted(rank, world, name):
    from autoshard.launch.capture_share import capture_shared
    from autoshard.passes.capture import capture

    torch.set_num_threads(1)
    calls = []
    real = torch.export.export

    def counting(*a, **k):
        calls.append(1)
        return real(*a, **k)

    torch.export.export = counting
    cache = os.environ.get("AUTOSHARD_CACHE")
    os.environ["AUTOSHARD_CACHE"] = "off"          # count exports, not cache hits of earlier tests
    try:
        model = models.build(name)
        inputs = models.batch(name)
        shared = capture_shared(model, example_inputs=inputs)
        n_shared = len(calls)
        own = capture(model, example_inputs=inputs)
    finally:
        torch.export.export = real
        if cache is None:
            os.environ.pop("AUTOSHARD_CACHE", None)
        else:
            os.environ["AUTOSHARD_CACHE"] = cache
    # the same graph as a capture of its own, up to the names export gives helper submodules
    import re

    norm = lambda code: re.sub(r"submod_\d+", "submod", code)
    same_code = norm(shared.module.code) == norm(own.module.code)
    bound = all(p is q for (_, p), (_, q) in zip(sorted(shared.module.named_parameters()),
                                                 sorted(model.named_parameters())))
    from autoshard.passes.pipeline import plan_captured
    from autoshard.policies import make_policy

    pol = make_policy("1d", world, None, 1)

    fp = [plan_captured(c, pol, batch_size=4, seq_len=8).fingerprint() for c in (shared, own)]
    return {"exports": n_shared, "same_code": same_code, "code": shared.module.code, "bound": bound, "same_plan": fp[0] == fp[1],
            "facts": (shared.input_names, shared.seq_range, shared.training, str(shared.batch_symbol),
                      str(shared.seq_symbol)) == (own.input_names, own.seq_range, own.training,
                                                   str(own.batch_symbol), str(own.seq_symbol))}


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_rank0_exports_and_the_others_load(name):
    res = get_pool(2).run(_counted, name)
    assert [r["exports"] for r in res] == [1, 0]
    for r in res:
        assert r["same_code"] and r["bound"] and r["same_plan"] and r["facts"], r
    assert res[0]["code"] == res[1]["code"]                      # every rank holds the very same graph


def _fails(rank, world):
    from autoshard.launch.capture_share import capture_shared
    from autoshard.ir.errors import CaptureError

    class Bad(torch.nn.Module):
        def __init__(self):
            import transformers

            super().__init__()
            self.config = transformers.PretrainedConfig(vocab_size=16)
            self.emb = torch.nn.Embedding(16, 4)

        def forward(self, input_ids, labels=None):
            x = self.emb(input_ids)
            return x * 2 if x.sum() > 0 else x          # data-dependent: export fails

    try:
        capture_shared(Bad(), example_inputs={"input_ids": torch.ones(2, 3, dtype=torch.long)})
    except CaptureError as e:
        return type(e).__name__
    return "no error"


def test_a_failed_capture_raises_on_every_rank():
    assert get_pool(2).run(_fails) == ["CaptureError", "CaptureError"]


def test_the_disk_cache_hits_misses_and_rebuilds(tmp_path, monkeypatch):
    """A second capture of the same model and inputs loads from the cache (no export);
    another config, train mode or input shape misses; a corrupt entry is rebuilt;
    AUTOSHARD_CACHE=off turns it off."""
    from autoshard.launch.capture_share import cache_key, capture_shared

    monkeypatch.setenv("AUTOSHARD_CACHE", str(tmp_path))
    calls = []
    real = torch.export.export
    monkeypatch.setattr(torch.export, "export", lambda *a, **k: (calls.append(1), real(*a, **k))[1])
    model, inputs = models.build("gpt2"), models.batch("gpt2")
    first = capture_shared(model, example_inputs=inputs)
    again = capture_shared(copy.deepcopy(model), example_inputs=inputs)
    assert len(calls) == 1 and again.module.code == first.module.code
    assert len(list(tmp_path.glob("*.pt2"))) == 1
    # what the capture depends on changes the key
    key = cache_key(model, inputs)
    assert cache_key(model, models.batch("gpt2", b=6)) != key
    assert cache_key(model.eval(), inputs) != key
    model.train()
    other = copy.deepcopy(model)
    other.config.layer_norm_epsilon = 1e-3              # a config change alone, same structure
    assert cache_key(other, inputs) != key
    assert cache_key(copy.deepcopy(model), inputs) == key
    assert cache_key(models.build("llama"), inputs) != key
    # a corrupt entry is never trusted: rebuilt
    entry = next(tmp_path.glob("*.pt2"))
    entry.write_bytes(entry.read_bytes()[:-100] + b"x" * 100)
    capture_shared(model, example_inputs=inputs)
    assert len(calls) == 2
    # off
    monkeypatch.setenv("AUTOSHARD_CACHE", "off")
    capture_shared(model, example_inputs=inputs)
    capture_shared(model, example_inputs=inputs)
    assert len(calls) == 4


def test_a_capture_made_here_is_not_read_back_and_plans_as_its_load(tmp_path, monkeypatch):
    """capture_cached packs and stores a new capture but does not unpickle it again: the
    module it pickled stands for the load. It has what a load from the cache has (module
    paths as text, no provenance, no program, the model's own tensors, a fake mode without
    fallback kernels) and plans the same; an entry that unpickles but whose graph does not
    load is rebuilt."""
    import pickle

    from torch.fx._graph_pickler import GraphPickler

    from autoshard.launch import cache_dir
    from autoshard.launch.capture_share import cache_key, capture_cached, forget_loaded
    from autoshard.passes.pipeline import plan_captured
    from autoshard.policies import make_policy

    monkeypatch.setenv("AUTOSHARD_CACHE", str(tmp_path))
    exports, loads = [], []
    real_export, real_loads = torch.export.export, GraphPickler.loads
    monkeypatch.setattr(torch.export, "export", lambda *a, **k: (exports.append(1), real_export(*a, **k))[1])
    monkeypatch.setattr(GraphPickler, "loads", lambda *a, **k: (loads.append(1), real_loads(*a, **k))[1])
    model, inputs = models.build("gpt2"), models.batch("gpt2")
    cold = capture_cached(model, example_inputs=inputs)
    assert (len(exports), len(loads)) == (1, 0)
    forget_loaded()
    warm = capture_cached(model, example_inputs=inputs)
    assert (len(exports), len(loads)) == (1, 1)

    def shape(cap):
        stacks = [v for n in cap.module.graph.nodes for v in n.meta.get("nn_module_stack", {}).values()]
        vals = [n.meta["val"] for n in cap.module.graph.nodes if isinstance(n.meta.get("val"), torch.Tensor)]
        return (cap.module.code, [(n.name, n.target, str(n.meta.get("val"))) for n in cap.module.graph.nodes],
                all(isinstance(x, str) for v in stacks for x in v), any("from_node" in n.meta for n in cap.module.graph.nodes),
                cap.program, cap.input_names, cap.seq_range, cap.guards, str(cap.batch_symbol), str(cap.seq_symbol),
                sorted(cap.example_inputs), vals[0].fake_mode.allow_fallback_kernels)

    assert shape(cold) == shape(warm)
    assert shape(cold)[2:5] == (True, False, None) and not shape(cold)[-1]
    for cap in (cold, warm):
        assert all(p is q for (_, p), (_, q) in zip(sorted(cap.module.named_parameters()), sorted(model.named_parameters())))
        assert all(cap.example_inputs[k] is not v and torch.equal(cap.example_inputs[k], v) for k, v in inputs.items())
    pol = make_policy("1d", 2, None, 1)
    assert plan_captured(cold, pol, batch_size=4, seq_len=8).to_json() == \
        plan_captured(warm, pol, batch_size=4, seq_len=8).to_json()
    # an entry that unpickles but whose graph does not load: rebuilt, not raised
    key = cache_key(model, inputs)
    facts = pickle.loads(cache_dir.load("capture", key))["facts"]
    cache_dir.store("capture", key, pickle.dumps({"graph": b"not a graph", "facts": facts}))
    forget_loaded()
    again = capture_cached(model, example_inputs=inputs)
    assert len(exports) == 2 and again.module.code == cold.module.code
    assert pickle.loads(cache_dir.load("capture", key))["graph"] != b"not a graph"


def _run(module, inputs):
    out = module(**inputs, use_cache=False)
    return out.logits if hasattr(out, "logits") else out[0] if isinstance(out, (tuple, list)) else out


def test_the_packed_graph_runs_as_the_capture_and_keeps_its_guards(monkeypatch):
    """pack / unpack send the graph module (fake values, shape environment, node names and
    module paths) without the program: the loaded module computes what the captured one
    does, keeps export's input guards (a sequence longer than the capture proved is
    refused alike), and a graph the graph pickler cannot write goes as the program."""
    from autoshard.launch.capture_share import pack, unpack
    from autoshard.passes.capture import capture, input_symbols

    monkeypatch.setenv("AUTOSHARD_CACHE", "off")
    model, inputs = models.build("gpt2"), models.batch("gpt2")
    own = capture(model, example_inputs=inputs)
    blob = pack(own)
    loaded = unpack(blob, model)
    assert "graph" in __import__("pickle").loads(blob) and loaded.program is None
    assert loaded.module.code == own.module.code
    assert [n.meta.get("nn_module_stack") and list(n.meta["nn_module_stack"].values())[-1][0]
            for n in loaded.module.graph.nodes] == [n.meta.get("nn_module_stack") and
                                                    list(n.meta["nn_module_stack"].values())[-1][0]
                                                    for n in own.module.graph.nodes]
    assert str(input_symbols(loaded.module)) == str(input_symbols(own.module))
    with torch.no_grad():
        torch.testing.assert_close(_run(loaded.module, inputs), _run(own.module, inputs), rtol=0, atol=0)
    long = models.batch("gpt2", s=own.seq_range[1] + 1)
    for m in (own.module, loaded.module):
        with pytest.raises(AssertionError, match="Guard failed"):
            m(**long, use_cache=False)
    # the fallback: the program itself
    from torch.fx import _graph_pickler

    def refuse(*a, **k):
        raise NotImplementedError("TARGET: an op the graph pickler cannot name")

    monkeypatch.setattr(_graph_pickler.GraphPickler, "dumps", refuse)
    blob = pack(own)
    assert "program" in __import__("pickle").loads(blob)
    again = unpack(blob, model)
    assert again.program is not None and again.module.code == own.module.code


def _unshippable(rank, world):
    """A capture neither format can write (as Gemma-3's multi-modal graph, a flat_apply
    node holding a TreeSpec): every rank captures the model itself, and the module runs
    exactly."""
    import autoshard
    import autoshard.launch.capture_share as cs

    torch.set_num_threads(1)
    real, cache = cs._pack, os.environ.get("AUTOSHARD_CACHE")

    def refuse(cap):
        raise cs.Unshippable(cap, RuntimeError("Failed serializing node flat_apply"))

    cs._pack, os.environ["AUTOSHARD_CACHE"] = refuse, "off"
    try:
        dense = models.build("gpt2")
        inputs = models.batch("gpt2")
        sharded = autoshard.shard(copy.deepcopy(dense), mode="1d", example_inputs=inputs)
        out, ref = sharded(**inputs), dense(**inputs)
        return (out.loss - ref.loss).abs().item(), (out.logits - ref.logits).abs().max().item()
    finally:
        cs._pack = real
        if cache is None:
            os.environ.pop("AUTOSHARD_CACHE", None)
        else:
            os.environ["AUTOSHARD_CACHE"] = cache


@pytest.mark.slow      # a GPT-2 export on every rank
def test_a_capture_that_does_not_serialise_is_captured_on_every_rank():
    for loss_err, logits_err in get_pool(2).run(_unshippable):
        assert loss_err < 1e-5 and logits_err < 1e-5
